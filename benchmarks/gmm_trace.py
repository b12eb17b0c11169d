"""Where the time of one gmm forward goes: device kernels from a profiler trace, for
moe_xla.gmm through JAX and for torch._grouped_mm, on the grouped_matmul cases.

    python benchmarks/gmm_trace.py [--out DIR] [--cases NAME ...] [--groups uniform zipf1.2] [--calls 20] [--m-scale 1.0]

Per case it reports, per call (ms): the wall time of back-to-back jitted calls
(benchmarks/_timing.time_jax), the span on the device from the first kernel start to
the last kernel end divided by the calls, the summed kernel time, the largest kernel
(the grouped GEMM) and the rest (the prep kernel: offsets, metadata, zeroing), and for torch the
CUDA-event time and its kernels' time from torch.profiler. The gap between span and
kernel time is the device idling between kernels (launch latency, host work). The JSON
keeps the kernels' full (mangled) names, for cuobjdump / ncu on the same kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from _timing import (CASES, device_kernels, environment, grouped_matmul_inputs, time_jax, time_torch, torch_grouped_mm,
                     write_results)

import jax

import moe_xla


def _torch_kernels(fn, calls):
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name] += e.device_time
    return totals


def _jax_row(case, kind, lhs, rhs, gs, calls):
    fwd = jax.jit(moe_xla.gmm).lower(lhs, rhs, gs).compile()
    wall = time_jax(fwd, lhs, rhs, gs)
    span, kernels = device_kernels(fwd, (lhs, rhs, gs), calls)
    main_name, main_us = kernels.most_common(1)[0] if kernels else ("", 0.0)
    total = sum(kernels.values())
    return {"case": case["name"], "groups": kind, "jax_wall_ms": wall * 1e3, "jax_span_ms": span / calls / 1e3,
            "jax_kernels_ms": total / calls / 1e3, "jax_gemm_ms": main_us / calls / 1e3,
            "jax_other_ms": (total - main_us) / calls / 1e3, "jax_gemm_kernel": main_name,
            "jax_kernel_list": {k: v / calls for k, v in kernels.items()}}


def _torch_row(call, calls):
    kernels = _torch_kernels(call, calls)
    name, us = kernels.most_common(1)[0]
    return {"torch_event_ms": time_torch(call) * 1e3, "torch_kernels_ms": sum(kernels.values()) / calls / 1e3,
            "torch_gemm_ms": us / calls / 1e3, "torch_gemm_kernel": name}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*")
    parser.add_argument("--groups", nargs="*", default=CASES["group_sizes"])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--m-scale", type=float, default=1.0, help="scale M (for quick runs)")
    args = parser.parse_args()
    inputs = lambda: grouped_matmul_inputs(args.cases, args.groups, args.m_scale)  # noqa: E731
    # Every JAX trace first: once torch.profiler has subscribed to CUPTI, JAX's profiler cannot.
    rows = [_jax_row(case, kind, lhs, rhs, gs, args.calls) for case, kind, lhs, rhs, gs in inputs()]
    for row, (_, _, lhs, rhs, gs) in zip(rows, inputs()):
        call = torch_grouped_mm(lhs, rhs, gs)
        if call is None:
            break
        row.update(_torch_row(call, args.calls))
        if row["jax_gemm_ms"]:
            row["gemm_kernel_vs_torch"] = row["torch_gemm_ms"] / row["jax_gemm_ms"]
        row["wall_vs_torch_event"] = row["torch_event_ms"] / row["jax_wall_ms"]
    for row in rows:
        print(json.dumps(row), flush=True)
    columns = ["case", "groups", "jax_wall_ms", "jax_span_ms", "jax_kernels_ms", "jax_gemm_ms", "jax_other_ms",
               "torch_event_ms", "torch_kernels_ms", "torch_gemm_ms", "gemm_kernel_vs_torch", "wall_vs_torch_event"]
    write_results(args.out, "gmm_trace", environment(), rows, columns)


if __name__ == "__main__":
    main()
