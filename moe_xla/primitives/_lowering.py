"""Per-platform lowering registration shared by every moe_xla primitive.

Kernels exist for cpu and cuda. Every other platform gets the pure-JAX definitions of
reference.py when MOE_XLA_IMPL=reference asks for them, and a clear error otherwise. A
primitive with a CUDA kernel for some cases only (gather_gmm) lowers everywhere else to
its decomposition into other primitives (register_decomposed).
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


def _route(logits, *bias, has_bias, **params):
    return list(reference.route(logits, bias=bias[0] if has_bias else None, **params))


# Each op's definition in reference.py, called with the primitive's operands and params.
_REFERENCE = {
    "after": lambda x, dep, **_: x,
    "gmm": reference.gmm,
    "tgmm": reference.tgmm,
    "gather_gmm": lambda x, src, w, group_sizes, *token_slots, transpose_rhs, preferred_element_type, **_: (
        reference.gather_gmm(x, src, w, group_sizes, transpose_rhs=transpose_rhs,
                             preferred_element_type=preferred_element_type)),
    "gather_gmm_activate": reference.gather_gmm_activate,
    "gather_tgmm": reference.gather_tgmm,
    "route": _route,
    "route_grad": reference.route_grad,
    "permute": lambda x, expert_ids, *, num_experts: list(reference.permute(x, expert_ids, num_experts,
                                                                            return_row_pairs=True)),
    "unpermute": lambda y_sorted, row_map, *rest, unit_k, **_: reference.unpermute(
        y_sorted, row_map,
        rest[0] if unit_k is None else jax.numpy.ones((row_map.shape[0] // unit_k, unit_k), np.float32)),
    "quantize_fp8_rows": lambda x, *, pow2_scale: list(reference.quantize_fp8_rows(x, pow2_scale=pow2_scale)),
    "quantize_fp8_blocks": lambda w, *, pow2_scale: list(reference.quantize_fp8_blocks(w, pow2_scale=pow2_scale)),
    "quantize_fp8_weights": lambda w, *, pow2_scale: list(
        reference.quantize_fp8_weight_layouts(w, pow2_scale=pow2_scale)),
    "quantize_fp8_group_cols": lambda x, group_sizes, *, pow2_scale: list(
        reference.quantize_fp8_group_cols(x, group_sizes, pow2_scale=pow2_scale)),
    "quantize_fp8_rows_group_cols": lambda x, group_sizes, *, pow2_scale: list(
        reference.quantize_fp8_rows_group_cols(x, group_sizes, pow2_scale=pow2_scale)),
    "gather_quantize_fp8_group_cols": lambda values, sources, group_sizes, *factor, pow2_scale, has_factor: list(
        reference.gather_quantize_fp8_group_cols(values, sources, factor[0] if has_factor else None, group_sizes,
                                                 pow2_scale=pow2_scale)),
    "activate_quantize_fp8": lambda h, **params: list(reference.activate_quantize_fp8(h, **params)),
    "activate_quantize_fp8_group_cols": lambda h, group_sizes, *, activation, pow2_scale: list(
        reference.activate_quantize_fp8_group_cols(h, group_sizes, activation, pow2_scale=pow2_scale)),
    "activate_grad_quantize_fp8": lambda h, g, omega, **params: list(
        reference.activate_grad_quantize_fp8(h, g, omega, **params)),
    "activate_weighted_grad": lambda h, g, omega, **params: list(reference.activate_weighted_grad(h, g, omega, **params)),
    "gather_rows": lambda values, src, *factor, has_factor, unique_sources: reference.gather_rows(
        values, src, *factor),
    "expand_quantize_fp8_rows": lambda values, slots, *factor, num_rows, pow2_scale, has_factor: list(
        reference.expand_quantize_fp8_rows(values, slots, factor[0] if has_factor else None, num_rows,
                                           pow2_scale=pow2_scale)),
    "ep_dedup_rows": lambda dest, lid, **params: list(reference.ep_dedup_rows(dest, lid, **params)),
    "ep_row_places": lambda row_dest, row_map, lids, **params: list(
        reference.ep_row_places(row_dest, row_map, lids, **params)),
    "gmm_fp8": reference.gmm_fp8,
    "tgmm_fp8": reference.tgmm_fp8,
}


def register(prim, op: str, attributes: Callable[..., dict], cuda_workspace: Callable[..., int] | None = None,
             sharding=None, kernel_operands: Callable[..., int] | None = None,
             output_aliases: dict[int, int] | None = None) -> None:
    """Lowers `prim` to the FFI target of `op` on cpu and cuda, and to its reference on
    every platform when MOE_XLA_IMPL=reference.

    `attributes(**params)` maps the primitive's params to the typed FFI attributes of the
    call. `cuda_workspace(*avals_in, **params)`, if given, is the byte size of the uint8
    workspace result the CUDA handler takes last (ffi/workspace.h); it is dropped from
    the primitive's outputs. `sharding`, a `_sharding.Rule`, partitions the call over a
    mesh without gathering (see _sharding). `kernel_operands(**params)`, if given, is the
    number of leading operands the kernel takes; the others serve the primitive's AD rules.
    `output_aliases` {operand: result}: results written into an operand's buffer (XLA
    copies the operand first where something else still reads it).
    """
    reference_lowering = mlir.lower_fun(_REFERENCE[op], multiple_results=prim.multiple_results)
    partitioned_lowering = None if sharding is None else _sharding.lowering(prim, sharding)

    for platform in KERNEL_PLATFORMS:

        def lowering(ctx, *args, _platform=platform, **params):
            if _lib.use_reference():
                return reference_lowering(ctx, *args, **params)
            if partitioned_lowering is not None and _sharding.needs_partitioning(ctx):
                return partitioned_lowering(ctx, *args, **params)
            if kernel_operands is not None:
                n = kernel_operands(**params)
                ctx, args = ctx.replace(avals_in=ctx.avals_in[:n]), args[:n]
            workspace = None if _platform != "cuda" or cuda_workspace is None else cuda_workspace(*ctx.avals_in,
                                                                                                   **params)
            return kernel_call(ctx, op, _platform, args, attributes(**params), workspace, output_aliases)

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


def kernel_call(ctx, op: str, platform: str, args, attributes: dict, cuda_workspace_bytes: int | None = None,
                output_aliases: dict[int, int] | None = None):
    """The FFI call of `op`'s kernel on `platform` with operands `args` (avals ctx.avals_in)
    and typed attributes; on cuda with cuda_workspace_bytes, the handler's uint8 workspace
    result of that size (ffi/workspace.h) is added last and dropped from the results.
    output_aliases as `register`'s."""
    call = jax.ffi.ffi_lowering(_lib.require_kernel(op, platform), operand_output_aliases=output_aliases)
    if platform != "cuda" or cuda_workspace_bytes is None:
        return call(ctx, *args, **attributes)
    workspace = jax.core.ShapedArray((max(1, cuda_workspace_bytes),), np.uint8)
    return call(ctx.replace(avals_out=[*ctx.avals_out, workspace]), *args, **attributes)[:-1]


def register_decomposed(prim, op: str, decomposition: Callable, kernel: Callable, attributes: Callable[..., dict],
                        cuda_workspace: Callable[..., int], sharding=None) -> None:
    """Lowers `prim`, which has a CUDA kernel for some of its cases only, to that kernel where
    it applies and to `decomposition` everywhere else (cpu, other platforms, other cases),
    or to its reference on every platform when MOE_XLA_IMPL=reference.

    `decomposition(*args, **params)` computes the primitive's contract from other moe_xla
    primitives (lowered through mlir.lower_fun, so each keeps its own lowering and sharding
    rule). `kernel(*avals_in, **params)` is None where the CUDA kernel does not apply, else
    the indices of the operands it takes. `attributes` and `cuda_workspace` (of the
    kernel's operands' avals) and `sharding` are as in `register`.
    """
    reference_lowering = mlir.lower_fun(_REFERENCE[op], multiple_results=prim.multiple_results)
    decomposed_lowering = mlir.lower_fun(decomposition, multiple_results=prim.multiple_results)
    partitioned_lowering = None if sharding is None else _sharding.lowering(prim, sharding)

    def cuda_lowering(ctx, *args, **params):
        if _lib.use_reference():
            return reference_lowering(ctx, *args, **params)
        operands = kernel(*ctx.avals_in, **params)
        if operands is None:
            return decomposed_lowering(ctx, *args, **params)
        if partitioned_lowering is not None and _sharding.needs_partitioning(ctx):
            return partitioned_lowering(ctx, *args, **params)
        avals = [ctx.avals_in[i] for i in operands]
        return kernel_call(ctx.replace(avals_in=avals), op, "cuda", [args[i] for i in operands],
                           attributes(**params), cuda_workspace(*avals, **params))

    def other_lowering(ctx, *args, **params):
        if _lib.use_reference():
            return reference_lowering(ctx, *args, **params)
        return decomposed_lowering(ctx, *args, **params)

    mlir.register_lowering(prim, cuda_lowering, platform="cuda")
    mlir.register_lowering(prim, other_lowering)  # platform=None: cpu and every other platform


def grouped_gemm_workspace(lhs, rhs, group_sizes, **_) -> int:
    """Workspace bytes of the CUDA gmm / tgmm handlers: a bound that depends on M and G only."""
    return _lib.cuda_workspace_bytes("MoeXlaGmmWorkspaceBytes", lhs.shape[0], group_sizes.shape[0])


def fp8_gemm_workspace(lhs, lhs_scales, rhs, rhs_scales, group_sizes, **_) -> int:
    """Workspace bytes of the CUDA gmm_fp8 handler: a bound that depends on M and G only."""
    return _lib.cuda_workspace_bytes("MoeXlaGmmFp8WorkspaceBytes", lhs.shape[0], group_sizes.shape[0])


def fp8_wgrad_workspace(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, **_) -> int:
    """Workspace bytes of the CUDA tgmm_fp8 handler: a bound that depends on G only."""
    return _lib.cuda_workspace_bytes("MoeXlaTgmmFp8WorkspaceBytes", group_sizes.shape[0])
