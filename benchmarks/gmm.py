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

from _timing import (CASES, compiled_memory_bytes, environment, group_sizes, is_oom, time_jax, time_torch,
                     write_results)

import jax
import jax.numpy as jnp
import numpy as np

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
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return None
    a = torch.from_numpy(np.asarray(lhs.astype(jnp.float32))).to("cuda", torch.bfloat16)
    # _grouped_mm wants the second operand column-major per group: [G, K, N] with stride (.., 1, K).
    b = torch.from_numpy(np.asarray(rhs.astype(jnp.float32))).to("cuda", torch.bfloat16)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)
    offs = torch.from_numpy(np.cumsum(np.asarray(gs)).astype(np.int32)).to("cuda")
    return time_torch(lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16))


def _gib(nbytes):
    return None if nbytes is None else nbytes / 2**30


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--m-scale", type=float, default=1.0, help="scale M (for quick runs)")
    parser.add_argument("--skip-ragged-dot", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    rows = []
    for case in CASES["grouped_matmul"]:
        if args.cases and case["name"] not in args.cases:
            continue
        m, g, k, n = int(case["M"] * args.m_scale), case["G"], case["K"], case["N"]
        lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
        for kind in CASES["group_sizes"]:
            gs = jnp.asarray(group_sizes(m, g, kind))
            flops = 2.0 * m * k * n
            ours = _bench_moe_xla(lhs, rhs, gs)
            fwd, bwd = ours["fwd"], ours["bwd"]
            row = {"case": case["name"], "groups": kind, "M": m, "K": k, "N": n, "G": g,
                   "gmm_fwd_ms": fwd * 1e3, "gmm_fwd_tflops": flops / fwd / 1e12,
                   "gmm_bwd_ms": bwd * 1e3, "gmm_bwd_tflops": 2 * flops / bwd / 1e12,
                   "gmm_fwd_mem_gib": _gib(ours["fwd_mem"]), "gmm_bwd_mem_gib": _gib(ours["bwd_mem"])}
            torch_t = _bench_torch(lhs, rhs, gs)
            if torch_t is not None:
                row.update(torch_fwd_ms=torch_t * 1e3, torch_fwd_tflops=flops / torch_t / 1e12,
                           fwd_vs_torch=torch_t / fwd)
            if not args.skip_ragged_dot:
                rd = _bench_ragged_dot(lhs, rhs, gs)
                for name in ("fwd", "bwd"):
                    t = rd[name]
                    row[f"ragged_dot_{name}_mem_gib"] = _gib(rd.get(f"{name}_mem"))
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
