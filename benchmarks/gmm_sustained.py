"""gmm forward against torch._grouped_mm under sustained load, with the GPU's clock and
power: is the gap in short back-to-back runs a power (clock) effect?

    python benchmarks/gmm_sustained.py [--cases NAME ...] [--groups uniform zipf1.2]
                                       [--seconds 2] [--rounds 3] [--out DIR]

Per case, three implementations take turns, each for `--seconds` of back-to-back calls
per turn, after one untimed turn each, `--rounds` timed turns each (the order rotates
every round, so none always runs on a hotter GPU): moe_xla.gmm with weights [G, K, N],
moe_xla.gmm with transpose_rhs on the K-major copy [G, N, K] that torch gets, and
torch._grouped_mm. Time per call is the wall
time of batches of 20 calls ended by a device sync (the first batch of each turn is
dropped); a thread samples NVML's SM clock, power, temperature and clock-throttle reasons
every 10 ms (NVML's power reading averages over about a second, so a turn's mean power
also holds some of the turn before it). Reported per implementation: median ms per call, TFLOP/s (2 M K N), mean SM
clock (MHz), power (W) and temperature over its turns, the share of samples with the
power cap (or a thermal slowdown) holding the clock down, and its speed relative to
torch's (torch ms / ms).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _gpu_samples import Sampler
from _timing import (CASES, alternating_times, environment, grouped_matmul_inputs, torch_grouped_mm, torch_sync,
                     write_results)

import jax
import jax.numpy as jnp

import moe_xla

BATCH = 20


def _impls(lhs, rhs, gs):
    torch_call = torch_grouped_mm(lhs, rhs, gs)
    if torch_call is None:
        raise SystemExit("gmm_sustained: torch._grouped_mm is not available (needs torch with CUDA)")
    rhs_t = jnp.swapaxes(rhs, 1, 2).copy()
    fwd = jax.jit(moe_xla.gmm)
    fwd_t = jax.jit(lambda a, b, g: moe_xla.gmm(a, b, g, transpose_rhs=True))
    jax_sync = jax.block_until_ready
    return {"moe_xla": (lambda: fwd(lhs, rhs, gs), jax_sync),
            "moe_xla_t": (lambda: fwd_t(lhs, rhs_t, gs), jax_sync),
            "torch": (torch_call, torch_sync)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*")
    parser.add_argument("--groups", nargs="*", default=CASES["group_sizes"])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sampler = Sampler()
    sampler.start()
    rows = []
    for case, kind, lhs, rhs, gs in grouped_matmul_inputs(args.cases, args.groups):
        times, spans = alternating_times(_impls(lhs, rhs, gs), args.seconds, args.rounds, BATCH)
        flops = 2 * lhs.shape[0] * lhs.shape[1] * rhs.shape[2]
        torch_ms = statistics.median(times["torch"]) * 1e3
        for name in times:
            ms = statistics.median(times[name]) * 1e3
            row = {"case": case["name"], "groups": kind, "impl": name, "ms": ms, "tflops": flops / ms / 1e9,
                   "vs_torch": torch_ms / ms, **sampler.summary(spans[name])}
            rows.append(row)
            print(row, flush=True)
    sampler.stop()
    write_results(args.out, "gmm_sustained", environment(), rows,
                  ["case", "groups", "impl", "ms", "tflops", "vs_torch", "sm_mhz", "watts", "temp_c", "power_capped",
                   "thermal"])


if __name__ == "__main__":
    main()
