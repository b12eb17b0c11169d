"""The public grouped matmul: moe_xla.gmm, in the compute precision asked for.

    gmm(lhs, rhs, group_sizes, quantization=None)             bf16 / f16 / f32 (primitives/gmm.py)
    gmm(lhs, rhs, group_sizes, quantization="fp8_blockwise")  FP8 1 x 128 / 128 x 128 (fp8.py)
    quantization="fp8_blockwise_fp8_wgrad"                      the same with an FP8 weight gradient
Both: out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g]^T with transpose_rhs); rows past the
groups are 0; differentiable w.r.t. lhs and rhs.
"""

from __future__ import annotations

import moe_xla.fp8 as fp8
from moe_xla.primitives import gmm as gmm_lib

QUANTIZATIONS = (None, *fp8.QUANTIZATION_WGRAD)


def check_quantization(op: str, quantization):
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"{op}: expected quantization in {QUANTIZATIONS}, got {quantization!r}")


def is_fp8(quantization) -> bool:
    """Whether `quantization` (a value of QUANTIZATIONS) runs the products in FP8."""
    return quantization in fp8.QUANTIZATION_WGRAD


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None, quantization=None,
        quantized_rhs=None):
    """Grouped matmul: out[rows of g] = lhs[rows of g] @ rhs[g]. See the module docstring;
    with quantization="fp8_blockwise", rhs may be an fp8.Fp8Weights (pre-quantised weights,
    no gradient), or an array with quantized_rhs its Fp8Weights (quantised once elsewhere;
    rhs gets the gradient, fp8.gmm_fp8_blockwise's rhs_quantized)."""
    check_quantization("gmm", quantization)
    if is_fp8(quantization):
        return fp8.gmm_fp8_blockwise(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                                     preferred_element_type=preferred_element_type,
                                     rhs_quantized=quantized_rhs, wgrad=fp8.QUANTIZATION_WGRAD[quantization])
    if quantized_rhs is not None:
        raise TypeError("gmm: quantized_rhs needs an FP8 quantization ('fp8_blockwise')")
    if isinstance(rhs, fp8.Fp8Weights):
        raise TypeError("gmm: rhs is an Fp8Weights (pre-quantised weights); pass an FP8 quantization "
                        "('fp8_blockwise')")
    return gmm_lib.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=preferred_element_type)
