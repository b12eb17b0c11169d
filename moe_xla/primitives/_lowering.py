"""Per-platform lowering registration shared by every moe_xla primitive.

Kernels exist for cpu and cuda. Every other platform gets the pure-JAX definitions of
reference.py when MOE_XLA_IMPL=reference asks for them, and a clear error otherwise.
This module is the only place runtime code uses reference.py.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.interpreters import mlir

import moe_xla._lib as _lib
import moe_xla.reference as reference
from moe_xla.primitives import _sharding

KERNEL_PLATFORMS = ("cpu", "cuda")


def _route(logits, bias, *, has_bias, **params):
    return list(reference.route(logits, bias=bias if has_bias else None, **params))


# Each op's definition in reference.py, called with the primitive's operands and params.
_REFERENCE = {
    "gmm": reference.gmm,
    "tgmm": reference.tgmm,
    "route": _route,
    "permute": lambda x, expert_ids, *, num_experts: list(reference.permute(x, expert_ids, num_experts)),
    "unpermute": lambda y_sorted, row_map, weights, *, unique_rows: reference.unpermute(y_sorted, row_map, weights),
    "quantize_fp8_rows": lambda x, *, pow2_scale: list(reference.quantize_fp8_rows(x, pow2_scale=pow2_scale)),
    "quantize_fp8_blocks": lambda w, *, pow2_scale: list(reference.quantize_fp8_blocks(w, pow2_scale=pow2_scale)),
    "quantize_fp8_weights": lambda w, *, pow2_scale: list(
        reference.quantize_fp8_weight_layouts(w, pow2_scale=pow2_scale)),
    "quantize_fp8_group_cols": lambda x, group_sizes, *, pow2_scale: list(
        reference.quantize_fp8_group_cols(x, group_sizes, pow2_scale=pow2_scale)),
    "activate_quantize_fp8": lambda h, **params: list(reference.activate_quantize_fp8(h, **params)),
    "activate_grad_quantize_fp8": lambda h, da, **params: list(reference.activate_grad_quantize_fp8(h, da, **params)),
    "gmm_fp8": reference.gmm_fp8,
    "tgmm_fp8": reference.tgmm_fp8,
}


def register(prim, op: str, attributes: Callable[..., dict], cuda_workspace: Callable[..., int] | None = None,
             sharding=None) -> None:
    """Lowers `prim` to the FFI target of `op` on cpu and cuda, and to its reference on
    every platform when MOE_XLA_IMPL=reference.

    `attributes(**params)` maps the primitive's params to the typed FFI attributes of the
    call. `cuda_workspace(*avals_in, **params)`, if given, is the byte size of the uint8
    workspace result the CUDA handler takes last (ffi/workspace.h); it is dropped from
    the primitive's outputs. `sharding`, a `_sharding.Rule`, partitions the call over a
    mesh without gathering (see _sharding).
    """
    reference_lowering = mlir.lower_fun(_REFERENCE[op], multiple_results=prim.multiple_results)
    partitioned_lowering = None if sharding is None else _sharding.lowering(prim, sharding)

    for platform in KERNEL_PLATFORMS:

        def lowering(ctx, *args, _platform=platform, **params):
            if _lib.use_reference():
                return reference_lowering(ctx, *args, **params)
            if partitioned_lowering is not None and _sharding.needs_partitioning(ctx):
                return partitioned_lowering(ctx, *args, **params)
            target = _lib.require_kernel(op, _platform)
            call = jax.ffi.ffi_lowering(target)
            if _platform != "cuda" or cuda_workspace is None:
                return call(ctx, *args, **attributes(**params))
            nbytes = max(1, cuda_workspace(*ctx.avals_in, **params))
            workspace = jax.core.ShapedArray((nbytes,), np.uint8)
            results = call(ctx.replace(avals_out=[*ctx.avals_out, workspace]), *args, **attributes(**params))
            return results[:-1]

        mlir.register_lowering(prim, lowering, platform=platform)

    def no_kernel_lowering(ctx, *args, **params):
        if _lib.use_reference():
            return reference_lowering(ctx, *args, **params)
        platforms = ", ".join(ctx.platforms or ctx.module_context.platforms)
        raise NotImplementedError(
            f"moe_xla: no {op} kernel for platform {platforms} (kernels exist for "
            f"{', '.join(KERNEL_PLATFORMS)}). Set MOE_XLA_IMPL=reference to lower the slow pure-JAX "
            f"reference there.")

    mlir.register_lowering(prim, no_kernel_lowering)  # platform=None: every platform without its own


def grouped_gemm_workspace(lhs, rhs, group_sizes, **_) -> int:
    """Workspace bytes of the CUDA gmm / tgmm handlers: a bound that depends on G only."""
    return _lib.cuda_workspace_bytes("MoeXlaGmmWorkspaceBytes", group_sizes.shape[0])


def fp8_gemm_workspace(lhs, lhs_scales, rhs, rhs_scales, group_sizes, **_) -> int:
    """Workspace bytes of the CUDA gmm_fp8 handler: a bound that depends on G only."""
    return _lib.cuda_workspace_bytes("MoeXlaGmmFp8WorkspaceBytes", group_sizes.shape[0])


def fp8_wgrad_workspace(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, **_) -> int:
    """Workspace bytes of the CUDA tgmm_fp8 handler: a bound that depends on G only."""
    return _lib.cuda_workspace_bytes("MoeXlaTgmmFp8WorkspaceBytes", group_sizes.shape[0])
