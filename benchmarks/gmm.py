"""Benchmark: moe_xla.gmm forward and the gmm + tgmm backward pair on the grouped_matmul
cases of cases.json, against jax.lax.ragged_dot (forward and backward) and
torch._grouped_mm (when torch imports), in the same run on the same device.

    python benchmarks/gmm.py [--out benchmarks/results] [--cases NAME ...] [--m-scale 1.0]
                             [--skip-ragged-dot] [--turn-seconds 0.5] [--rounds 4]

TFLOP/s count 2*M*K*N per product (forward one product, backward two). Memory is the
compiled program's memory_analysis() estimate (temp + arguments + outputs).

Where torch runs, the forward and torch._grouped_mm take turns (_timing.alternating_times:
--turn-seconds per turn, --rounds rounds, the order rotating), both timed the same way
(wall time of batches of calls ended by a device sync), so neither profits from running on
a cooler GPU: at the H200's 700 W cap these GEMMs run at 1.3-1.6 GHz, not the 1.98 GHz of
a short burst.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _timing import (alternating_times, compiled_memory_bytes, environment, gib, grouped_matmul_inputs, is_oom,
                     time_jax, torch_grouped_mm, torch_sync, write_results)

import jax
import jax.numpy as jnp

import moe_xla


def _bench_moe_xla(lhs, rhs, gs, turn_seconds, rounds):
    """Forward (taking turns with torch._grouped_mm where it runs) and backward seconds per
    call, compiled memory; torch's forward seconds per call or None."""
    fwd = jax.jit(moe_xla.gmm)

    @jax.jit
    def bwd(lhs, rhs, gs, ct):  # exactly what jax.grad of gmm runs: d lhs and d rhs
        return (moe_xla.gmm(ct, rhs, gs, transpose_rhs=True), moe_xla.tgmm(lhs, ct, gs))

    ct = jnp.ones((lhs.shape[0], rhs.shape[2]), lhs.dtype) * 0.01
    fwd_c, bwd_c = fwd.lower(lhs, rhs, gs).compile(), bwd.lower(lhs, rhs, gs, ct).compile()
    torch_call = torch_grouped_mm(lhs, rhs, gs)
    if torch_call is None:
        fwd_t, torch_t = time_jax(fwd_c, lhs, rhs, gs), None
    else:
        times, _ = alternating_times({"moe_xla": (lambda: fwd_c(lhs, rhs, gs), jax.block_until_ready),
                                      "torch": (torch_call, torch_sync)}, turn_seconds, rounds)
        fwd_t, torch_t = statistics.median(times["moe_xla"]), statistics.median(times["torch"])
    return {"fwd": fwd_t, "bwd": time_jax(bwd_c, lhs, rhs, gs, ct), "torch_fwd": torch_t,
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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--m-scale", type=float, default=1.0, help="scale M (for quick runs)")
    parser.add_argument("--skip-ragged-dot", action="store_true")
    parser.add_argument("--turn-seconds", type=float, default=0.5, help="forward vs torch: seconds per turn")
    parser.add_argument("--rounds", type=int, default=4, help="forward vs torch: turns each")
    args = parser.parse_args()

    rows = []
    for case, kind, lhs, rhs, gs in grouped_matmul_inputs(args.cases, m_scale=args.m_scale):
        (m, k), n, g = lhs.shape, rhs.shape[2], rhs.shape[0]
        flops = 2.0 * m * k * n
        ours = _bench_moe_xla(lhs, rhs, gs, args.turn_seconds, args.rounds)
        fwd, bwd, torch_t = ours["fwd"], ours["bwd"], ours["torch_fwd"]
        row = {"case": case["name"], "groups": kind, "M": m, "K": k, "N": n, "G": g,
               "gmm_fwd_ms": fwd * 1e3, "gmm_fwd_tflops": flops / fwd / 1e12,
               "gmm_bwd_ms": bwd * 1e3, "gmm_bwd_tflops": 2 * flops / bwd / 1e12,
               "gmm_fwd_mem_gib": gib(ours["fwd_mem"]), "gmm_bwd_mem_gib": gib(ours["bwd_mem"])}
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
