"""How the grouped GEMM's speed depends on the number of groups, at a fixed total shape:
is a case with many small groups (qwen3 down: 128 groups of ~1024 rows, K = 768) slower per
FLOP because of the groups themselves?

    python benchmarks/gmm_groups.py [--case qwen3-30b-a3b.down] [--groups 1 8 32 128]
                                    [--turn-seconds 0.5] [--rounds 3] [--out DIR]

For each G, lhs [M, K] and rhs [G, K, N] of the case's M, K, N, with equal group sizes M / G
(whole 128-row tiles when G divides M / 128: no padded rows) and, for the case's own G, the
multinomial 'uniform' sizes of cases.json too (whose groups end mid-tile). moe_xla.gmm
and torch._grouped_mm (weights K-major, its fastest layout; skipped without torch) take
turns as in benchmarks/gmm.py (_timing.alternating_times), on the same bf16 inputs, lhs ~ N(0, 1)
and rhs ~ N(0, 1/K) as in the other benchmarks (torch gets copies, _timing.torch_grouped_mm).
Reported: ms per call, TFLOP/s (2 M K N), and moe_xla / torch.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import numpy as np
from _timing import (CASES, alternating_times, environment, group_sizes, normal, torch_grouped_mm, torch_sync,
                     write_results)

import jax
import jax.numpy as jnp

import moe_xla


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="qwen3-30b-a3b.down", choices=[c["name"] for c in CASES["grouped_matmul"]])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--turn-seconds", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    case = next(c for c in CASES["grouped_matmul"] if c["name"] == args.case)
    m, k, n = case["M"], case["K"], case["N"]
    for g in args.groups:
        if g <= 0 or m % g:
            parser.error(f"--groups: every G must divide M = {m}, got {g}")

    variants = [(g, "equal", np.full(g, m // g, np.int64)) for g in args.groups]
    variants.append((case["G"], "uniform", group_sizes(m, case["G"], "uniform")))
    fwd = jax.jit(moe_xla.gmm)
    rows = []
    for g, kind, sizes in variants:
        key = jax.random.key(g)
        lhs = normal(jax.random.fold_in(key, 0), (m, k), jnp.bfloat16)
        rhs = normal(jax.random.fold_in(key, 1), (g, k, n), jnp.bfloat16, 1.0 / math.sqrt(k))
        gs = jnp.asarray(sizes, jnp.int32)
        impls = {"moe_xla": (lambda: fwd(lhs, rhs, gs), jax.block_until_ready)}
        torch_call = torch_grouped_mm(lhs, rhs, sizes)
        if torch_call is not None:
            impls["torch"] = (torch_call, torch_sync)
        times, _ = alternating_times(impls, args.turn_seconds, args.rounds)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        row = {"case": case["name"], "G": g, "sizes": kind, "rows_per_group": m / g, "moe_xla_ms": ms["moe_xla"],
               "moe_xla_tflops": 2 * m * k * n / ms["moe_xla"] / 1e9}
        if "torch" in ms:
            row.update(torch_ms=ms["torch"], torch_tflops=2 * m * k * n / ms["torch"] / 1e9,
                       vs_torch=ms["torch"] / ms["moe_xla"])
        rows.append(row)
        print(row, flush=True)

    columns = ["case", "G", "sizes", "rows_per_group", "moe_xla_ms", "moe_xla_tflops", "torch_ms", "torch_tflops",
               "vs_torch"]
    write_results(args.out, "gmm_groups", environment(), rows, columns)


if __name__ == "__main__":
    main()
