"""The FP8 grouped GEMM kernels of gmm_fp8's (or tgmm_fp8's) paths on one case, a few calls
each on the same pre-quantised operands, for Nsight Compute to compare
(benchmarks/gpu_check.sh, step ncu-fp8):

    ncu -k regex:"fp8_wgmma|GemmUniversal|device_kernel" -c 8 \
        python benchmarks/gmm_fp8_ncu.py --case deepseek-v3.ep8.gate_up --paths auto wgmma128x128
    ncu -k regex:"fp8_wgrad_wgmma" -c 2 \
        python benchmarks/gmm_fp8_ncu.py --product wgrad --case mixtral-8x7b.gate_up --paths auto

--product gmm (the forward): lhs quantised in 1 x 128 tiles and the weights in 128 x 128
blocks. --product wgrad (the weight gradient dW[g] = lhs_g^T dy_g): lhs and a random dy
[M, N] (normal, 0.01 scale) quantised in each group's 128-row column tiles. The quantisation
runs once, outside what ncu profiles as the products; then per path `--calls` jitted calls
and a wait. Under ncu's default clock control every kernel runs at the base clock, so their
times compare per-clock efficiency, which the power cap of back-to-back runs otherwise
mixes in.
"""

from __future__ import annotations

import argparse
import functools

from _timing import grouped_matmul_inputs, normal

import jax
import jax.numpy as jnp

import moe_xla
from moe_xla.primitives import gmm_fp8 as gmm_fp8_module
from moe_xla.primitives import tgmm_fp8 as tgmm_fp8_module


def _gmm_calls(lhs, rhs, gs):
    """(path -> jitted forward, its operands)."""
    weights = moe_xla.quantize_fp8_weights(rhs)
    q, scales = jax.jit(moe_xla.quantize_fp8_rows)(lhs)
    return (lambda path: jax.jit(functools.partial(moe_xla.gmm_fp8, path=path)),
            (q, scales, weights.data_t, weights.scales, gs))


def _wgrad_calls(lhs, rhs, gs):
    """(path -> jitted wgrad, its operands), bf16 out as the layer's weight gradients."""
    dy = normal(jax.random.key(1), (lhs.shape[0], rhs.shape[2]), lhs.dtype, 0.01)
    cols = jax.jit(moe_xla.quantize_fp8_group_cols)
    operands = (*cols(lhs, gs), *cols(dy, gs), gs)
    return (lambda path: jax.jit(functools.partial(moe_xla.tgmm_fp8, rows=lhs.shape[0],
                                                   preferred_element_type=jnp.bfloat16, path=path)),
            operands)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--product", choices=("gmm", "wgrad"), default="gmm")
    parser.add_argument("--case", default="deepseek-v3.ep8.gate_up")
    parser.add_argument("--groups", default="uniform")
    parser.add_argument("--paths", nargs="+", default=["auto"],
                        help=f"gmm: {gmm_fp8_module.PATHS}; wgrad: {tgmm_fp8_module.PATHS}")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    valid = gmm_fp8_module.PATHS if args.product == "gmm" else tgmm_fp8_module.PATHS
    if not set(args.paths) <= set(valid):
        parser.error(f"--paths for --product {args.product}: expected some of {valid}, got {args.paths}")
    (case, kind, lhs, rhs, gs), = grouped_matmul_inputs([args.case], [args.groups])
    make, operands = (_gmm_calls if args.product == "gmm" else _wgrad_calls)(lhs, rhs, gs)
    for path in args.paths:
        compiled = make(path).lower(*operands).compile()
        for _ in range(args.calls):
            out = compiled(*operands)
        out.block_until_ready()
        print(f"gmm_fp8_ncu: {args.product} {case['name']} {kind} path {path}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
