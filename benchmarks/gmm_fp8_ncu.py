"""The FP8 grouped GEMM kernels of gmm_fp8's paths on one case, a few calls each on the same
pre-quantised operands, for Nsight Compute to compare (benchmarks/gpu_check.sh, step ncu-fp8):

    ncu -k regex:"fp8_wgmma|GemmUniversal|device_kernel" -c 8 \
        python benchmarks/gmm_fp8_ncu.py --case deepseek-v3.ep8.gate_up --paths auto wgmma128x128

Quantises lhs in 1 x 128 tiles and the weights in 128 x 128 blocks once (outside what ncu
profiles as the products), then per path runs `--calls` jitted gmm_fp8 calls and waits.
Under ncu's default clock control every kernel runs at the base clock, so their times
compare per-clock efficiency, which the power cap of back-to-back runs otherwise mixes in.
"""

from __future__ import annotations

import argparse

from _timing import grouped_matmul_inputs

import jax

import moe_xla
from moe_xla.primitives import gmm_fp8 as gmm_fp8_module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="deepseek-v3.ep8.gate_up")
    parser.add_argument("--groups", default="uniform")
    parser.add_argument("--paths", nargs="+", default=["auto", "wgmma128x128"], choices=gmm_fp8_module.PATHS)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    (case, kind, lhs, rhs, gs), = grouped_matmul_inputs([args.case], [args.groups])
    weights = moe_xla.quantize_fp8_weights(rhs)
    q, scales = jax.jit(moe_xla.quantize_fp8_rows)(lhs)
    for path in args.paths:
        fwd = jax.jit(lambda *a, path=path: moe_xla.gmm_fp8(*a, path=path))
        compiled = fwd.lower(q, scales, weights.data_t, weights.scales, gs).compile()
        for _ in range(args.calls):
            out = compiled(q, scales, weights.data_t, weights.scales, gs)
        out.block_until_ready()
        print(f"gmm_fp8_ncu: {case['name']} {kind} path {path}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
