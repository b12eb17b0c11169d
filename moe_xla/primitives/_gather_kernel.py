"""The cases the gather products' CUDA kernels (gather_gmm, gather_tgmm) compute: bf16
operands, bf16 or float32 output, K and N multiples of 8 (16-byte rows) and every size at
most 2^31 - 256 (cuda/gather_checks.h)."""

from __future__ import annotations

import jax.numpy as jnp

# Largest T, M, K, N and G the kernels take.
KERNEL_MAX_DIM = 2**31 - 256
KERNEL_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def supports(t: int, m: int, k: int, n: int, g: int, in_dtype, out_dtype) -> bool:
    """Whether a gather kernel computes T tokens, M rows, K and N columns and G groups with
    these input and output dtypes."""
    return (jnp.dtype(in_dtype) == jnp.bfloat16 and jnp.dtype(out_dtype) in KERNEL_OUT_DTYPES
            and k % 8 == 0 and n % 8 == 0 and max(t, m, k, n, g) <= KERNEL_MAX_DIM)
