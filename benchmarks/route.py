"""Benchmark: the route kernel (top-k expert selection and its weights) in ms, against the
jnp reference of the same selection (moe_xla.reference.route, XLA's sort-based top_k) and
a plain device copy of the same bytes, taking turns on the device in the same run
(alternating_times).

    python benchmarks/route.py [--out benchmarks/results] [--name route] [--ops route xla copy]

Shapes (T tokens, E experts, k, score, groups, logits dtype): the router outputs of the
benchmark layers (benchmarks/cases.json: SonicMoE's three 30B configurations, qwen3,
deepseek-v3 with its sigmoid score, selection bias and group limit) and one bf16-logits
case. Bytes = the logits read + weights and ids written (T E b + 8 T k), for every op; the copy
reads and writes an array of half that many bytes, so it moves the same bytes;
fraction_of_copy = the copy's time / the op's time.
"""

from __future__ import annotations

from _timing import OP_COLUMNS, environment, normal, op_parser, op_rows, write_results

import jax
import jax.numpy as jnp

import moe_xla
from moe_xla import reference

# (name, T, E, k, score, n_groups, topk_groups, logits dtype)
SHAPES = [("sonicmoe_n256", 32768, 256, 16, "softmax", 1, 1, jnp.float32),
          ("sonicmoe_n512", 32768, 128, 8, "softmax", 1, 1, jnp.float32),
          ("sonicmoe_n1024", 32768, 64, 4, "softmax", 1, 1, jnp.float32),
          ("qwen3", 16384, 128, 8, "softmax", 1, 1, jnp.float32),
          ("deepseek_v3", 8192, 256, 8, "sigmoid", 8, 4, jnp.float32),
          ("bf16_n256", 32768, 256, 16, "softmax", 1, 1, jnp.bfloat16)]


def main():
    args = op_parser(__doc__, "route").parse_args()
    rows = []
    for name, t, e, k, score, n_groups, topk_groups, dtype in SHAPES:
        keys = jax.random.split(jax.random.key(0), 2)
        logits = normal(keys[0], (t, e), dtype)
        bias = 0.1 * jax.random.normal(keys[1], (e,), jnp.float32) if score == "sigmoid" else None
        options = dict(score=score, bias=bias)
        if n_groups > 1:
            options.update(n_groups=n_groups, topk_groups=topk_groups)
        nbytes = t * e * jnp.dtype(dtype).itemsize + 8 * t * k
        copied = jnp.zeros((nbytes // 8,), jnp.float32)  # nbytes / 2 read + nbytes / 2 written
        ops = {
            "route": lambda x, c: moe_xla.route(x, k, **options),
            "xla": lambda x, c: reference.route(x, top_k=k, **options),
            "copy": lambda x, c: c.copy(),
        }
        shape = f"T{t} E{e} k{k} {score} g{n_groups} {jnp.dtype(dtype).name}"
        rows += op_rows(args, name, shape, ops, (logits, copied), nbytes)
        del logits, copied
    write_results(args.out, args.name, environment(), rows, OP_COLUMNS)


if __name__ == "__main__":
    main()
