"""Autodiff and batching of gmm / tgmm / ragged_dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_xla
from moe_xla import reference
from conftest import assert_close, normal

GS = jnp.array([5, 0, 9, 3], jnp.int32)  # sum 17 < M = 20


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_check_grads(rng, transpose_rhs):
    lhs = normal(rng, (20, 6), jnp.float32)
    rhs = normal(rng, (4, 7, 6) if transpose_rhs else (4, 6, 7), jnp.float32)
    f = lambda a, b: moe_xla.gmm(a, b, GS, transpose_rhs=transpose_rhs)
    check_grads(f, (lhs, rhs), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_tgmm_check_grads(rng):
    lhs, rhs = normal(rng, (20, 6), jnp.float32), normal(rng, (20, 5), jnp.float32)
    check_grads(lambda a, b: moe_xla.tgmm(a, b, GS), (lhs, rhs), order=2, modes=("fwd", "rev"),
                atol=2e-2, rtol=2e-2, eps=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_matches_reference_grad(rng, dtype):
    lhs, rhs = normal(rng, (20, 16), dtype), normal(rng, (4, 16, 8), dtype)
    w = normal(rng, (20, 8), jnp.float32)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b, GS).astype(jnp.float32) * w)

    ours = jax.jit(jax.grad(lambda a, b: loss(moe_xla.gmm, a, b), (0, 1)))(lhs, rhs)
    ref = jax.jit(jax.grad(lambda a, b: loss(reference.gmm, a, b), (0, 1)))(lhs.astype(jnp.float32),
                                                                           rhs.astype(jnp.float32))
    for o, r in zip(ours, ref):
        assert o.dtype == dtype
        assert_close(o, r, dtype)


def test_grad_under_checkpoint_and_scan(rng):
    """A stack of grouped layers under lax.scan with rematerialisation."""
    x = normal(rng, (20, 8), jnp.float32)
    ws = normal(rng, (3, 4, 8, 8), jnp.float32) * 0.3

    def model(ws, x, gmm):
        @jax.checkpoint
        def layer(h, w):
            return jnp.tanh(gmm(h, w, GS)), None

        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h**2)

    ours = jax.jit(jax.grad(lambda w: model(w, x, moe_xla.gmm)))(ws)
    ref = jax.jit(jax.grad(lambda w: model(w, x, reference.gmm)))(ws)
    assert_close(ours, ref, jnp.float32, scale=10)


def test_ragged_dot_grad_matches_lax(rng):
    lhs, rhs = normal(rng, (20, 6), jnp.float32), normal(rng, (4, 6, 7), jnp.float32)
    f = lambda fn: jax.grad(lambda a, b: jnp.sum(jnp.sin(fn(a, b, GS))), (0, 1))(lhs, rhs)
    ours = jax.jit(lambda: f(moe_xla.ragged_dot))()
    theirs = jax.jit(lambda: f(lambda a, b, g: jax.lax.ragged_dot(a, b, g, precision=jax.lax.Precision.HIGHEST)))()
    for o, t in zip(ours, theirs):
        assert_close(o, t, jnp.float32, scale=10)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, 0), (None, 0, 0), (0, 0, None), (1, 0, 0)])
def test_gmm_vmap(rng, in_axes):
    b, m, k, n, g = 3, 12, 5, 4, 3
    lhs = normal(rng, (b, m, k) if in_axes[0] == 0 else (m, b, k) if in_axes[0] == 1 else (m, k), jnp.float32)
    rhs = normal(rng, (b, g, k, n) if in_axes[1] == 0 else (g, k, n), jnp.float32)
    gs = jnp.array([[4, 0, 6], [12, 3, 1], [0, 0, 2]] if in_axes[2] == 0 else [5, 2, 3], jnp.int32)
    ours = jax.jit(jax.vmap(moe_xla.gmm, in_axes))(lhs, rhs, gs)
    ref = jax.jit(jax.vmap(reference.gmm, in_axes))(lhs, rhs, gs)
    assert_close(ours, ref, jnp.float32)


def test_tgmm_vmap_and_grad_of_vmap(rng):
    b, m, k, n = 2, 10, 4, 3
    lhs, rhs = normal(rng, (b, m, k), jnp.float32), normal(rng, (b, m, n), jnp.float32)
    gs = jnp.array([[3, 0, 4], [10, 0, 0]], jnp.int32)
    assert_close(jax.vmap(moe_xla.tgmm)(lhs, rhs, gs), jax.jit(jax.vmap(reference.tgmm))(lhs, rhs, gs), jnp.float32)
    w = normal(rng, (b, 3, k, 2), jnp.float32)
    loss = lambda fn, w: jnp.sum(jax.vmap(fn)(lhs, w, gs) ** 2)
    assert_close(jax.grad(lambda w: loss(moe_xla.gmm, w))(w), jax.jit(jax.grad(lambda w: loss(reference.gmm, w)))(w),
                 jnp.float32)


def test_mixed_precision_grads_keep_primal_dtypes(rng):
    lhs, rhs = normal(rng, (20, 8), jnp.bfloat16), normal(rng, (4, 8, 8), jnp.bfloat16)
    f = lambda a, b: jnp.sum(moe_xla.gmm(a, b, GS, preferred_element_type=jnp.float32))
    da, db = jax.grad(f, (0, 1))(lhs, rhs)
    assert da.dtype == jnp.bfloat16 and db.dtype == jnp.bfloat16
    # ... and their values: those of the float32 reference on the same inputs.
    ref = jax.grad(lambda a, b: jnp.sum(reference.gmm(a, b, GS)), (0, 1))(lhs.astype(jnp.float32),
                                                                       rhs.astype(jnp.float32))
    for g, r in zip((da, db), ref):
        assert_close(g, r, jnp.bfloat16)
