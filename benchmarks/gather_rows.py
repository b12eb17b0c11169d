"""Benchmark: the gather_rows kernel (rows[r] = values[src[r]], and with a factor per row)
in GB/s, against XLA's gathers of the same rows and a plain device copy of the same bytes,
taking turns on the device in the same run (alternating_times).

Ops: gather_rows (the primitive, a copy of each row), gather_rows_factor (the primitive
with a float32 factor per row), xla_gather (values[src], XLA's gather), xla_gather_factor
(factor[:, None] * values[src] in float32, rounded to the dtype), permute (moe_xla.permute
of the T tokens to their k experts: the sort, row_map, and the rows written in expert
order, each token row read once for its k rows), copy (an [R, H] array copied on the
device).

    python benchmarks/gather_rows.py [--out benchmarks/results] [--name gather_rows] [--ops gather_rows copy ...]

Shapes (T tokens, k rows per token, H, dtype): R = T * k rows gathered from values [T, H],
each token named k times at random places (as the MoE backward's cotangent gather and
permute's dispatch do). Bytes = R rows read + R rows written (2 R H x the element size),
for every op, the copy included; fraction_of_copy = GB/s / the copy's GB/s.
"""

from __future__ import annotations

from _timing import OP_COLUMNS, environment, normal, op_parser, op_rows, write_results

import jax
import jax.numpy as jnp

import moe_xla
from moe_xla.primitives.gather_rows import gather_rows

# (name, T, k, H, dtype): SonicMoE-like (8 KiB rows), DeepSeek-V3-like (14 KiB rows), rows
# of 1 KiB and of 2 KiB, a float32 case.
SHAPES = [("sonicmoe", 32768, 16, 4096, jnp.bfloat16), ("deepseek_v3", 8192, 8, 7168, jnp.bfloat16),
          ("rows_1k", 65536, 8, 512, jnp.bfloat16), ("rows_2k", 32768, 8, 1024, jnp.bfloat16),
          ("f32", 16384, 8, 2048, jnp.float32)]


def _inputs(t, k, h, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    values = normal(keys[0], (t, h), dtype)
    src = (jax.random.permutation(keys[1], t * k) // k).astype(jnp.int32)
    factor = jax.random.uniform(keys[2], (t * k,), jnp.float32)
    experts = jax.random.randint(keys[3], (t, k), 0, 64, jnp.int32)
    return values, src, factor, experts


def main():
    args = op_parser(__doc__, "gather_rows").parse_args()
    ops = {
        "gather_rows": lambda v, s, f, e, c: gather_rows(v, s),
        "gather_rows_factor": lambda v, s, f, e, c: gather_rows(v, s, f),
        "xla_gather": lambda v, s, f, e, c: v[s],
        "xla_gather_factor": lambda v, s, f, e, c: (f[:, None] * v[s].astype(jnp.float32)).astype(v.dtype),
        "permute": lambda v, s, f, e, c: moe_xla.permute(v, e, 64)[0],
        "copy": lambda v, s, f, e, c: c.copy(),
    }
    rows = []
    for name, t, k, h, dtype in SHAPES:
        values, src, factor, experts = _inputs(t, k, h, dtype)
        r = t * k
        copied = normal(jax.random.key(5), (r, h), dtype)
        operands = (values, src, factor, experts, copied)
        rows += op_rows(args, name, f"T{t} k{k} H{h} {jnp.dtype(dtype).name}", ops, operands,
                        2 * r * h * jnp.dtype(dtype).itemsize)
        del values, src, factor, experts, copied, operands
    write_results(args.out, args.name, environment(), rows, OP_COLUMNS)


if __name__ == "__main__":
    main()
