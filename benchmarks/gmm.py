"""Benchmark: moe_xla.gmm forward and the gmm + tgmm backward pair on the grouped_matmul
cases of cases.json, against jax.lax.ragged_dot (forward and backward) and
torch._grouped_mm (when torch imports), in the same run on the same device.

    python benchmarks/gmm.py [--out benchmarks/results] [--cases NAME ...] [--m-scale 1.0]

TFLOP/s count 2*M*K*N per product (forward one product, backward two). Memory is the
compiled program's memory_analysis() estimate (temp + arguments + outputs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _timing import (compiled_memory_bytes, environment, gib, grouped_matmul_inputs, is_oom, time_jax, time_torch,
                     torch_grouped_mm, write_results)

import jax
import jax.numpy as jnp

import moe_xla


def _bench_moe_xla(lhs, rhs, gs):
    fwd = jax.jit(moe_xla.gmm)

    @jax.jit
    def bwd(lhs, rhs, gs, ct):  # exactly what jax.grad of gmm runs: d lhs and d rhs
        return (moe_xla.gmm(ct, rhs, gs, transpose_rhs=True), moe_xla.tgmm(lhs, ct, gs))

    ct = jnp.ones((lhs.shape[0], rhs.shape[2]), lhs.dtype) * 0.01
    fwd_c, bwd_c = fwd.lower(lhs, rhs, gs).compile(), bwd.lower(lhs, rhs, gs, ct).compile()
    return {"fwd": time_jax(fwd_c, lhs, rhs, gs), "bwd": time_jax(bwd_c, lhs, rhs, gs, ct),
            "fwd_mem": compiled_memory_bytes(fwd_c), "bwd_mem": compiled_memory_bytes(bwd_c)}


def _bench_ragged_dot(lhs, rhs, gs):
    fwd = jax.jit(jax.lax.ragged_dot)
    bwd = jax.jit(jax.grad(lambda a, b, g: jnp.sum(jax.lax.ragged_dot(a, b, g).astype(jnp.float32)), (0, 1)))
    out = {}
    for name, fn in (("fwd", fwd), ("bwd", bwd)):
        try:
            compiled = fn.lower(lhs, rhs, gs).compile()
            out[f"{name}_mem"] = compiled_memory_bytes(compiled)
            out[name] = time_jax(compiled, lhs, rhs, gs, reps=5, inner=1)
        except Exception as err:  # noqa: BLE001 - OOM is a result, anything else is re-raised
            if not is_oom(err):
                raise
            out[name] = "OOM"
    return out


def _bench_torch(lhs, rhs, gs):
    call = torch_grouped_mm(lhs, rhs, gs)
    return None if call is None else time_torch(call)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--m-scale", type=float, default=1.0, help="scale M (for quick runs)")
    parser.add_argument("--skip-ragged-dot", action="store_true")
    args = parser.parse_args()

    rows = []
    for case, kind, lhs, rhs, gs in grouped_matmul_inputs(args.cases, m_scale=args.m_scale):
        (m, k), n, g = lhs.shape, rhs.shape[2], rhs.shape[0]
        flops = 2.0 * m * k * n
        ours = _bench_moe_xla(lhs, rhs, gs)
        fwd, bwd = ours["fwd"], ours["bwd"]
        row = {"case": case["name"], "groups": kind, "M": m, "K": k, "N": n, "G": g,
               "gmm_fwd_ms": fwd * 1e3, "gmm_fwd_tflops": flops / fwd / 1e12,
               "gmm_bwd_ms": bwd * 1e3, "gmm_bwd_tflops": 2 * flops / bwd / 1e12,
               "gmm_fwd_mem_gib": gib(ours["fwd_mem"]), "gmm_bwd_mem_gib": gib(ours["bwd_mem"])}
        torch_t = _bench_torch(lhs, rhs, gs)
        if torch_t is not None:
            row.update(torch_fwd_ms=torch_t * 1e3, torch_fwd_tflops=flops / torch_t / 1e12,
                       fwd_vs_torch=torch_t / fwd)
        if not args.skip_ragged_dot:
            rd = _bench_ragged_dot(lhs, rhs, gs)
            for name in ("fwd", "bwd"):
                t = rd[name]
                row[f"ragged_dot_{name}_mem_gib"] = gib(rd.get(f"{name}_mem"))
                row[f"ragged_dot_{name}_ms"] = t if isinstance(t, str) else t * 1e3
                mine = fwd if name == "fwd" else bwd
                row[f"{name}_vs_ragged_dot"] = "OOM" if isinstance(t, str) else t / mine
        rows.append(row)
        print(row, flush=True)
    columns = ["case", "groups", "gmm_fwd_tflops", "torch_fwd_tflops", "fwd_vs_torch", "gmm_bwd_tflops",
               "gmm_bwd_mem_gib", "ragged_dot_fwd_ms", "fwd_vs_ragged_dot", "ragged_dot_bwd_ms", "bwd_vs_ragged_dot",
               "ragged_dot_bwd_mem_gib"]
    write_results(args.out, "gmm", environment(), rows, columns)


if __name__ == "__main__":
    main()
