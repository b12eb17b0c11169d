"""Where the time of one gmm forward goes: device kernels from a profiler trace, for
moe_xla.gmm through JAX and for torch._grouped_mm, on the grouped_matmul cases.

    python benchmarks/gmm_trace.py [--out DIR] [--cases NAME ...] [--groups uniform zipf1.2] [--calls 20] [--m-scale 1.0]

Per case it reports, per call (ms): the wall time of back-to-back jitted calls
(benchmarks/_timing.time_jax), the span on the device from the first kernel start to
the last kernel end divided by the calls, the summed kernel time, the largest kernel
(the grouped GEMM) and the rest (offset scan, metadata, zeroing), and for torch the
CUDA-event time and its kernels' time from torch.profiler. The gap between span and
kernel time is the device idling between kernels (launch latency, host work). The JSON
keeps the kernels' full (mangled) names, for cuobjdump / ncu on the same kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from _timing import CASES, device_kernels, environment, group_sizes, time_jax, time_torch, write_results

import jax
import jax.numpy as jnp
import numpy as np

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


def _inputs(args):
    """(case, kind, lhs, rhs, group_sizes) as benchmarks/gmm.py draws them; the same on every pass."""
    rng = np.random.default_rng(0)
    for case in CASES["grouped_matmul"]:
        if args.cases and case["name"] not in args.cases:
            continue
        m, g, k, n = int(case["M"] * args.m_scale), case["G"], case["K"], case["N"]
        lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
        for kind in args.groups:
            yield case, kind, lhs, rhs, jnp.asarray(group_sizes(m, g, kind))


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


def _torch_row(lhs, rhs, gs, calls):
    import torch

    a = torch.from_numpy(np.array(lhs.astype(jnp.float32))).to("cuda", torch.bfloat16)
    # K-major weights per group, the layout torch._grouped_mm runs fastest (as in gmm.py).
    b = torch.from_numpy(np.array(rhs.astype(jnp.float32))).to("cuda", torch.bfloat16)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)
    offs = torch.from_numpy(np.cumsum(np.asarray(gs)).astype(np.int32)).to("cuda")
    call = lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
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
    # Every JAX trace first: once torch.profiler has subscribed to CUPTI, JAX's profiler cannot.
    rows = [_jax_row(case, kind, lhs, rhs, gs, args.calls) for case, kind, lhs, rhs, gs in _inputs(args)]
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    for row, (_, _, lhs, rhs, gs) in zip(rows, _inputs(args) if have_torch else ()):
        row.update(_torch_row(lhs, rhs, gs, args.calls))
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
