"""Bad input raises at trace time with a message naming argument, expected and actual."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import moe_xla

F32 = jnp.float32
lhs = jax.ShapeDtypeStruct((16, 8), F32)
rhs = jax.ShapeDtypeStruct((4, 8, 6), F32)
gs = jax.ShapeDtypeStruct((4,), jnp.int32)


def trace(fn, *args, **kw):
    return jax.eval_shape(lambda *a: fn(*a, **kw), *args)


@pytest.mark.parametrize("args,kw,exc,match", [
    ((jax.ShapeDtypeStruct((16,), F32), rhs, gs), {}, ValueError, r"lhs of rank 2 \[M, K\], got shape \(16,\)"),
    ((lhs, jax.ShapeDtypeStruct((8, 6), F32), gs), {}, ValueError, r"rhs of rank 3 \[G, K, N\], got shape \(8, 6\)"),
    ((lhs, jax.ShapeDtypeStruct((4, 7, 6), F32), gs), {}, ValueError, r"rhs.shape\[1\] .* = 8, got 7"),
    ((lhs, rhs, gs), {"transpose_rhs": True}, ValueError, r"rhs.shape\[2\] .* = 8, got 6"),
    ((lhs, rhs, jax.ShapeDtypeStruct((4,), jnp.int16)), {}, TypeError, "expected int32 group_sizes, got int16"),
    ((lhs, rhs, jax.ShapeDtypeStruct((3,), jnp.int32)), {}, ValueError, r"group_sizes of shape \(4,\).*got \(3,\)"),
    ((lhs, rhs, jax.ShapeDtypeStruct((4, 1), jnp.int32)), {}, ValueError, "group_sizes of rank 1"),
    ((lhs, jax.ShapeDtypeStruct((4, 8, 6), jnp.bfloat16), gs), {}, TypeError, "rhs of the dtype of lhs"),
    ((jax.ShapeDtypeStruct((16, 8), jnp.int32), jax.ShapeDtypeStruct((4, 8, 6), jnp.int32), gs), {}, TypeError,
     "lhs of dtype float32, bfloat16, float16, got int32"),
    ((lhs, rhs, gs), {"preferred_element_type": jnp.int8}, TypeError, "preferred_element_type"),
    ((lhs, rhs, gs), {"transpose_rhs": 1}, TypeError, "transpose_rhs to be a Python bool"),
])
def test_gmm_bad_input(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        trace(moe_xla.gmm, *args, **kw)


@pytest.mark.parametrize("args,exc,match", [
    ((lhs, jax.ShapeDtypeStruct((15, 6), F32), gs), ValueError, r"rhs.shape\[0\] .* = 16, got 15"),
    ((lhs, jax.ShapeDtypeStruct((16, 6, 1), F32), gs), ValueError, r"rhs of rank 2 \[M, N\]"),
    ((lhs, jax.ShapeDtypeStruct((16, 6), F32), jax.ShapeDtypeStruct((4,), jnp.uint32)), TypeError, "int32 group_sizes"),
])
def test_tgmm_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        trace(moe_xla.tgmm, *args)


def test_ragged_dot_integer_operands():
    with pytest.raises(TypeError, match="floating operands .* got int32 lhs and int32 rhs"):
        moe_xla.ragged_dot(jnp.ones((4, 2), jnp.int32), jnp.ones((2, 2, 3), jnp.int32), jnp.asarray([2, 2]))


def test_ragged_dot_bad_group_sizes():
    with pytest.raises(TypeError, match="integer group_sizes, got float32"):
        moe_xla.ragged_dot(jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.ones((2,)))
