"""Per-platform lowering registration shared by every moe_xla primitive."""

from __future__ import annotations

from typing import Callable

import jax
from jax.interpreters import mlir

from moe_xla import _lib


def register(prim, op: str, reference: Callable, attributes: Callable[..., dict]) -> None:
    """Lowers `prim` to the FFI target of `op` on cpu and cuda.

    `reference(*args, **params)` is the pure-JAX definition, lowered instead when
    MOE_XLA_IMPL=reference; `attributes(**params)` maps the primitive's params to the
    typed FFI attributes of the call.
    """
    reference_lowering = mlir.lower_fun(reference, multiple_results=prim.multiple_results)

    for platform in ("cpu", "cuda"):

        def lowering(ctx, *args, _platform=platform, **params):
            if _lib.use_reference():
                return reference_lowering(ctx, *args, **params)
            target = _lib.require_kernel(op, _platform)
            return jax.ffi.ffi_lowering(target)(ctx, *args, **attributes(**params))

        mlir.register_lowering(prim, lowering, platform=platform)
