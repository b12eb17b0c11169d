"""Benchmark: the gathered weight gradients of the expert MLP (gather_tgmm) in both block
layouts, against the transpose XLA would otherwise add, taking turns on the device in the
same run (alternating_times).

    python benchmarks/gather_tgmm.py [--out benchmarks/results] [--name gather_tgmm] [--ops ...]
        [--seconds 0.3] [--rounds 4]

Per case, T tokens routed to k experts each (uniform, distinct experts per token), the
M = T k rows sorted by expert (src [M] the token of each row, group sizes [E]):
  w_out:  d w_out [E, F, H] = b_e^T c_e with c[r] = dy[src[r]] (dy [T, H], b [M, F]),
          the second product's weight gradient in moe()'s gathered backward:
            transposed   gather_tgmm(dy, src, b, transpose_out=True)     (one kernel)
            swapped      swapaxes(gather_tgmm(dy, src, b), 1, 2)         (kernel + XLA transpose)
  w_in:   d w_in [E, H, 2F] = x[src]_e^T d h_e (x [T, H], d h [M, 2F]), the first's:
            plain        gather_tgmm(x, src, d h)
TFLOP/s = 2 M H F' / t (F' = F or 2F); vs_swapped = the swapped op's time / the op's time.
Shapes: SonicMoE's three 30B configurations and qwen3-30b-a3b (benchmarks/cases.json),
bf16.
"""

from __future__ import annotations

import statistics

from _timing import alternating_times, environment, normal, op_parser, write_results

import jax
import jax.numpy as jnp

from moe_xla.primitives.gather_tgmm import gather_tgmm

# (name, T, H, F, E, k)
SHAPES = [("sonicmoe_n256", 32768, 4096, 256, 256, 16), ("sonicmoe_n512", 32768, 4096, 512, 128, 8),
          ("sonicmoe_n1024", 32768, 4096, 1024, 64, 4), ("qwen3", 16384, 2048, 768, 128, 8)]

COLUMNS = ["case", "op", "shape", "ms", "tflops", "vs_swapped"]

OPS = {
    "transposed": lambda x, src, rows, gs: gather_tgmm(x, src, rows, gs, transpose_out=True),
    "swapped": lambda x, src, rows, gs: jnp.swapaxes(gather_tgmm(x, src, rows, gs), 1, 2),
    "plain": lambda x, src, rows, gs: gather_tgmm(x, src, rows, gs),
}


def routing(key, tokens: int, experts: int, k: int):
    """(src [T k], group sizes [E]) of uniform top-k routing, rows sorted by expert."""
    experts_of = jnp.argsort(jax.random.uniform(key, (tokens, experts)), axis=1)[:, :k].reshape(-1)
    order = jnp.argsort(experts_of, stable=True)
    return (order // k).astype(jnp.int32), jnp.bincount(experts_of, length=experts).astype(jnp.int32)


def main():
    args = op_parser(__doc__, "gather_tgmm").parse_args()
    rows = []
    for name, t, h, f, e, k in SHAPES:
        keys = jax.random.split(jax.random.key(0), 3)
        src, gs = routing(keys[0], t, e, k)
        m = t * k
        tokens = normal(keys[1], (t, h), jnp.bfloat16)
        # (x, grouped rows, ops) of each weight gradient
        for grad, width, ops in (("w_out", f, ("transposed", "swapped")), ("w_in", 2 * f, ("plain",))):
            grouped = normal(keys[2], (m, width), jnp.bfloat16)
            impls = {}
            for op in ops:
                if args.ops and op not in args.ops:
                    continue
                jitted = jax.jit(OPS[op])
                impls[op] = (lambda jitted=jitted: jitted(tokens, src, grouped, gs), jax.block_until_ready)
            times, _ = alternating_times(impls, args.seconds, args.rounds)
            seconds = {op: statistics.median(ts) for op, ts in times.items()}
            for op, s in seconds.items():
                row = {"case": f"{name}/{grad}", "op": op, "shape": f"T{t} H{h} M{m} F'{width} E{e} bf16",
                       "ms": s * 1e3, "tflops": 2 * m * h * width / s / 1e12,
                       "vs_swapped": seconds["swapped"] / s if "swapped" in seconds else None}
                print(row, flush=True)
                rows.append(row)
            del grouped
    write_results(args.out, args.name, environment(), rows, COLUMNS)


if __name__ == "__main__":
    main()
