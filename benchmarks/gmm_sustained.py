"""gmm forward against torch._grouped_mm under sustained load, with the GPU's clock and
power: is the gap in short back-to-back runs a power (clock) effect?

    python benchmarks/gmm_sustained.py [--cases NAME ...] [--groups uniform zipf1.2] [--seconds 2] [--rounds 3] [--out DIR]

Per case, three implementations take turns, each for `--seconds` of back-to-back calls
per turn, `--rounds` turns each (the order rotates every round, so none always runs on a
hotter GPU): moe_xla.gmm with weights [G, K, N], moe_xla.gmm with transpose_rhs on the
K-major copy [G, N, K] that torch gets, and torch._grouped_mm. Time per call is the wall
time of batches of 20 calls ended by a device sync (the first batch of each turn is
dropped); a thread samples NVML's SM clock and power every 10 ms. Reported per
implementation: median ms per call, TFLOP/s (2 M K N), mean SM clock (MHz) and power (W)
over its turns, and each one's time relative to torch's.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from _timing import CASES, batch_times, environment, grouped_matmul_inputs, torch_grouped_mm, write_results

import jax
import jax.numpy as jnp

import moe_xla

BATCH = 20


class Sampler(threading.Thread):
    """(time, SM MHz, W) every `period` s from NVML, device 0, until stop()."""

    def __init__(self, period=0.01):
        super().__init__(daemon=True)
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), period
        self.samples, self.done = [], threading.Event()

    def run(self):
        while not self.done.is_set():
            clock = self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)
            watts = self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3
            self.samples.append((time.perf_counter(), clock, watts))
            time.sleep(self.period)

    def stop(self):
        self.done.set()
        self.join()

    def between(self, t0, t1):
        return [(c, w) for t, c, w in self.samples if t0 <= t < t1]


def _turn(call, sync, seconds):
    """Per-call seconds of each batch after the first, and the turn's (start, end)."""
    start = time.perf_counter()
    times = batch_times(call, sync, BATCH, reps=3, seconds=seconds)
    return times[1:], (start, time.perf_counter())


def _impls(lhs, rhs, gs):
    import torch

    rhs_t = jnp.swapaxes(rhs, 1, 2).copy()
    fwd = jax.jit(moe_xla.gmm)
    fwd_t = jax.jit(lambda a, b, g: moe_xla.gmm(a, b, g, transpose_rhs=True))
    jax_sync = jax.block_until_ready
    return {"moe_xla": (lambda: fwd(lhs, rhs, gs), jax_sync),
            "moe_xla_t": (lambda: fwd_t(lhs, rhs_t, gs), jax_sync),
            "torch": (torch_grouped_mm(lhs, rhs, gs), lambda _: torch.cuda.synchronize())}


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
        impls = _impls(lhs, rhs, gs)
        names = list(impls)
        times = {n: [] for n in names}
        spans = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t, span = _turn(*impls[name], args.seconds)
                times[name] += t
                spans[name].append(span)
        flops = 2 * lhs.shape[0] * lhs.shape[1] * rhs.shape[2]
        torch_ms = statistics.median(times["torch"]) * 1e3
        for name in names:
            samples = [s for t0, t1 in spans[name] for s in sampler.between(t0, t1)]
            ms = statistics.median(times[name]) * 1e3
            row = {"case": case["name"], "groups": kind, "impl": name, "ms": ms, "tflops": flops / ms / 1e9,
                   "vs_torch": torch_ms / ms, "sm_mhz": statistics.fmean(c for c, _ in samples) if samples else None,
                   "watts": statistics.fmean(w for _, w in samples) if samples else None}
            rows.append(row)
            print(row, flush=True)
    sampler.stop()
    write_results(args.out, "gmm_sustained", environment(), rows,
                  ["case", "groups", "impl", "ms", "tflops", "vs_torch", "sm_mhz", "watts"])


if __name__ == "__main__":
    main()
