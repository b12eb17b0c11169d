"""What the FP8 quantisation primitives share: their outputs' avals, the error raised when
one is differentiated, and the typed FFI attribute.

Quantisation is not differentiable here, by choice: q is piecewise constant in x (zero
derivative almost everywhere) and a straight-through estimate is a modelling decision
that belongs to the FP8 GEMMs, whose rules are to be written in terms of the unquantised
inputs. Differentiating a quantize_fp8_* call directly raises; a caller that wants no
gradient through it applies jax.lax.stop_gradient to its input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
TILE = 128


def tiles(n: int) -> int:
    """Number of tiles of 128 covering n elements (a tail is a partial tile)."""
    return -(-n // TILE)


def outputs(x_shape, scales_shape):
    """(q of x's shape in float8_e4m3fn, float32 scales)."""
    return [jax.core.ShapedArray(tuple(x_shape), FP8_DTYPE), jax.core.ShapedArray(tuple(scales_shape), jnp.float32)]


def not_differentiable(op: str, why: str = ""):
    """A JVP rule that raises: `op` has no derivative (see the module docstring)."""
    why = why or ("FP8 quantisation has zero derivative almost everywhere. Differentiate the FP8 gmm, "
                  f"whose rules see the unquantised inputs, or apply jax.lax.stop_gradient to the input of {op}")

    def jvp(primals, tangents, **params):
        raise TypeError(f"{op} is not differentiable: {why}.")

    return jvp


def attributes(*, pow2_scale):
    return dict(pow2_scale=pow2_scale)
