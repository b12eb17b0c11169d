"""What the FP8 primitives share: the avals of the quantisations' outputs, the checks of
quantised operands, their scales and the products' options, the error raised when one is
differentiated, and the typed FFI attribute.

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
PRODUCT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # the FP8 products' outputs


def tiles(n: int) -> int:
    """Number of tiles of 128 covering n elements (a tail is a partial tile)."""
    return -(-n // TILE)


def outputs(q_shape, scales_shape):
    """(float8_e4m3fn q, float32 scales) of the given shapes."""
    return [jax.core.ShapedArray(tuple(q_shape), FP8_DTYPE), jax.core.ShapedArray(tuple(scales_shape), jnp.float32)]


def product_dtype(op: str, preferred_element_type):
    """The output dtype of an FP8 product: bfloat16 or float32."""
    dt = jnp.dtype(preferred_element_type)
    if dt not in PRODUCT_DTYPES:
        raise TypeError(f"{op}: expected preferred_element_type bfloat16 or float32, got {dt}")
    return dt


def check_path(op: str, paths: tuple, path) -> None:
    """An FP8 product's CUDA kernel choice: one of `paths`."""
    if path not in paths:
        raise ValueError(f"{op}: expected path in {paths}, got {path!r}")


def check_operand(op: str, name: str, x) -> None:
    """A quantised operand: float8_e4m3fn."""
    if jnp.dtype(x.dtype) != FP8_DTYPE:
        raise TypeError(f"{op}: expected {name} of dtype float8_e4m3fn, got {x.dtype}")


def check_scales(op: str, name: str, s, shape) -> None:
    """The scales of a quantised operand: float32 of `shape`."""
    if jnp.dtype(s.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{op}: expected float32 {name}, got {s.dtype}")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{op}: expected {name} of shape {tuple(shape)}, got {tuple(s.shape)}")


def not_differentiable(op: str, why: str = ""):
    """A JVP rule that raises: `op` has no derivative (see the module docstring)."""
    why = why or ("FP8 quantisation has zero derivative almost everywhere. Differentiate the FP8 gmm, "
                  f"whose rules see the unquantised inputs, or apply jax.lax.stop_gradient to the input of {op}")

    def jvp(primals, tangents, **params):
        raise TypeError(f"{op} is not differentiable: {why}.")

    return jvp


def attributes(*, pow2_scale):
    return dict(pow2_scale=pow2_scale)
