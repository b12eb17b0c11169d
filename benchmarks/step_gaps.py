"""Benchmark: how busy the GPU is through the layer's forward+backward step, with and
without XLA's command buffers: the timed step (time_jax) beside a profiler trace of
--steps back-to-back steps, from which per step: the span (first kernel start to last
kernel end, / steps), busy time (the union of kernel and memset/memcpy intervals), the
idle gaps between them, and the largest gaps with the kernels on either side.

    python benchmarks/step_gaps.py [--out benchmarks/results] [--name step_gaps] [--cases qwen3-30b-a3b ...] [--steps 3]

Cases are moe_layer / sonicmoe entries of benchmarks/cases.json (bf16, moe()'s defaults).
A traced span much shorter than the timed step says the difference is not idle GPU time
between kernels (the traced steps are few, so the GPU runs them before its clock settles at
the power cap).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _timing import CASES, environment, fwd_bwd, gpu_kernels, moe_inputs, time_jax, trace_events, write_results
from moe_layer import moe_xla_layer

import jax

DEFAULT_CASES = ["qwen3-30b-a3b", "sonicmoe-30b-n256-e256-k16"]
OPTIONS = {"command_buffers": {}, "no_command_buffers": {"xla_gpu_enable_command_buffer": ""}}


def busy_and_gaps(kernels: list[dict]) -> tuple[float, list[tuple[float, str, str]]]:
    """(us covered by the union of the kernels' intervals, [(idle us, name before, name
    after) for every gap between them], largest first) of trace events sorted by start."""
    busy, end, gaps = 0.0, None, []
    for i, e in enumerate(kernels):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start >= end:
            if end is not None:
                gaps.append((start - end, kernels[i - 1]["name"], e["name"]))
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, sorted(gaps, reverse=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="step_gaps")
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--steps", type=int, default=3, help="steps in the trace")
    args = parser.parse_args()
    cases = {c["name"]: c for group in ("moe_layer", "sonicmoe") for c in CASES[group]}
    rows = []
    for name in args.cases:
        case = cases[name]
        inputs, ct = moe_inputs(jax.random.key(0), case["T"], case["H"], case["F"], case["E"])
        layer = moe_xla_layer(case)
        for label, options in OPTIONS.items():
            step = jax.jit(fwd_bwd(layer, len(inputs))).lower(*inputs, ct).compile(compiler_options=options)
            timed = time_jax(step, *inputs, ct, reps=5, inner=5) * 1e3
            kernels = sorted((e for ks in gpu_kernels(trace_events(step, inputs + (ct,), args.steps)).values()
                              for e in ks), key=lambda e: e["ts"])
            if not kernels:
                raise SystemExit("step_gaps: the trace holds no GPU kernels (run it on a GPU)")
            span = max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]
            busy, gaps = busy_and_gaps(kernels)
            largest = gaps[0] if gaps else (0.0, "", "")
            row = {"case": name, "xla": label, "timed_step_ms": timed, "traced_step_ms": span / args.steps / 1e3,
                   "busy_ms": busy / args.steps / 1e3, "gaps_ms": sum(g[0] for g in gaps) / args.steps / 1e3,
                   "gaps_per_step": len(gaps) / args.steps, "largest_gap_us": largest[0],
                   "largest_gap_between": f"{largest[1][:50]} / {largest[2][:50]}"}
            print(row, flush=True)
            rows.append(row)
    write_results(args.out, args.name, environment(), rows,
                  ["case", "xla", "timed_step_ms", "traced_step_ms", "busy_ms", "gaps_ms", "gaps_per_step",
                   "largest_gap_us", "largest_gap_between"])


if __name__ == "__main__":
    main()
