"""gmm and tgmm against the reference on the default backend (CPU in CI, CUDA on a GPU)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla
from moe_xla import reference
from conftest import assert_close, group_sizes_cases, normal

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (M, K, N, G): odd K and N, tile-unaligned sizes, G = 1, aligned shapes that take the
# CUTLASS path on the GPU, and a short K (not a multiple of 64) with long groups and N past
# a 256-column tile, which bf16 gmm with rhs [G, K, N] computes with the resident-B kernel
# on the GPU.
SHAPES = [(37, 13, 11, 5), (64, 16, 24, 1), (200, 64, 72, 7), (129, 128, 136, 4), (300, 9, 256, 3),
          (2100, 136, 1032, 2)]


def _cases():
    for (m, k, n, g), dtype in itertools.product(SHAPES, DTYPES):
        for name in ("random", "zeros", "one_giant", "sum_below_m"):
            yield pytest.param(m, k, n, g, dtype, name, id=f"{m}x{k}x{n}g{g}-{jnp.dtype(dtype).name}-{name}")


@pytest.mark.parametrize("m,k,n,g,dtype,sizes", list(_cases()))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_reference(rng, m, k, n, g, dtype, sizes, transpose_rhs):
    lhs = normal(rng, (m, k), dtype)
    rhs = normal(rng, (g, n, k) if transpose_rhs else (g, k, n), dtype)
    gs = jnp.asarray(group_sizes_cases(m, g, rng)[sizes])
    out = jax.jit(moe_xla.gmm, static_argnames="transpose_rhs")(lhs, rhs, gs, transpose_rhs=transpose_rhs)
    ref = reference.gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, transpose_rhs=transpose_rhs)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, ref, dtype)
    tail = int(reference.group_ends(gs, m)[-1])
    assert np.all(np.asarray(out[tail:], np.float32) == 0), "rows past sum(group_sizes) must be zero"


@pytest.mark.parametrize("m,k,n,g,dtype,sizes", list(_cases()))
def test_tgmm_matches_reference(rng, m, k, n, g, dtype, sizes):
    lhs, rhs = normal(rng, (m, k), dtype), normal(rng, (m, n), dtype)
    gs = jnp.asarray(group_sizes_cases(m, g, rng)[sizes])
    out = jax.jit(moe_xla.tgmm)(lhs, rhs, gs)
    ref = reference.tgmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
    assert out.dtype == dtype and out.shape == (g, k, n)
    assert_close(out, ref, dtype)
    empty = np.asarray(gs) == 0
    assert np.all(np.asarray(out, np.float32)[empty] == 0), "empty groups must give zero blocks"


@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                                                (jnp.float16, jnp.float32)])
def test_preferred_element_type(rng, in_dtype, out_dtype):
    lhs, rhs = normal(rng, (50, 32), in_dtype), normal(rng, (3, 32, 40), in_dtype)
    gs = jnp.array([10, 0, 35], jnp.int32)
    # The reference takes the same (low-precision) inputs in float32, so the only error
    # left is the output's rounding: float32 outputs are held to float32's tolerance.
    out = jax.jit(lambda a, b, c: moe_xla.gmm(a, b, c, preferred_element_type=out_dtype))(lhs, rhs, gs)
    assert out.dtype == out_dtype
    assert_close(out, reference.gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs), out_dtype)
    t = jax.jit(lambda a, b, c: moe_xla.tgmm(a, b, c, preferred_element_type=out_dtype))(lhs, lhs, gs)
    assert t.dtype == out_dtype
    assert_close(t, reference.tgmm(lhs.astype(jnp.float32), lhs.astype(jnp.float32), gs), out_dtype)


def test_empty_and_degenerate(rng):
    # M = 0, all groups empty, G = 1 holding every row.
    lhs0, rhs = jnp.zeros((0, 8), jnp.float32), normal(rng, (2, 8, 8), jnp.float32)
    assert moe_xla.gmm(lhs0, rhs, jnp.array([0, 0], jnp.int32)).shape == (0, 8)
    assert np.all(np.asarray(moe_xla.tgmm(lhs0, lhs0, jnp.array([0, 0], jnp.int32))) == 0)
    lhs = normal(rng, (24, 8), jnp.float32)
    assert np.all(np.asarray(moe_xla.gmm(lhs, rhs, jnp.array([0, 0], jnp.int32))) == 0)
    one = moe_xla.gmm(lhs, rhs[:1], jnp.array([24], jnp.int32))
    assert_close(one, jnp.dot(lhs, rhs[0], precision="highest"), jnp.float32)


@pytest.mark.parametrize("sizes", [[30, -4, 25, 100], [2**31 - 1, 5, 3, 1], [-7, -1, 0, 0]])
def test_group_sizes_out_of_range_are_clamped(rng, sizes):
    """Negative sizes count as 0 and a sum past M is cut at M: never an out-of-bounds access."""
    lhs, rhs = normal(rng, (40, 16), jnp.float32), normal(rng, (4, 16, 8), jnp.float32)
    gs = jnp.array(sizes, jnp.int32)
    assert_close(moe_xla.gmm(lhs, rhs, gs), reference.gmm(lhs, rhs, gs), jnp.float32)
    assert_close(moe_xla.tgmm(lhs, lhs, gs), reference.tgmm(lhs, lhs, gs), jnp.float32)


def test_rows_outside_the_groups_take_no_part(rng):
    # Rows past sum(group_sizes) give exactly 0 in gmm, also under vmap (whose batching rule
    # folds them into a spacer group), and rows outside a group add nothing to its tgmm block,
    # even where those rows hold inf.
    lhs = normal(rng, (2, 6, 4), jnp.float32).at[:, 4:].set(jnp.inf)
    rhs = normal(rng, (2, 3, 4, 5), jnp.float32)
    sizes = jnp.asarray([[1, 0, 3], [2, 2, 0]], jnp.int32)
    out = jax.vmap(moe_xla.gmm)(lhs, rhs, sizes)
    assert np.all(out[:, 4:] == 0)
    np.testing.assert_allclose(out, jax.vmap(reference.gmm)(lhs, rhs, sizes), rtol=1e-6, atol=1e-6)
    other = normal(rng, (6, 5), jnp.float32).at[5].set(jnp.inf)
    t = moe_xla.tgmm(lhs[0, :, :].at[4:].set(1.0), other, sizes[0])
    assert np.all(np.isfinite(t))
    np.testing.assert_allclose(t, reference.tgmm(lhs[0].at[4:].set(1.0), other, sizes[0]), rtol=1e-6, atol=1e-6)


def test_ragged_dot_is_a_drop_in(rng):
    lhs, rhs = normal(rng, (64, 24), jnp.float32), normal(rng, (4, 24, 16), jnp.float32)
    gs = jnp.array([10, 0, 30, 20], jnp.int32)
    ours = jax.jit(moe_xla.ragged_dot)(lhs, rhs, gs)
    theirs = jax.lax.ragged_dot(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST)
    assert_close(ours, theirs, jnp.float32)
    # Mixed operand dtypes promote like lax.ragged_dot; int64-like group sizes are accepted.
    mixed = moe_xla.ragged_dot(lhs.astype(jnp.bfloat16), rhs, gs.astype(jnp.int16))
    assert mixed.dtype == jnp.float32
    assert_close(mixed, jax.lax.ragged_dot(lhs.astype(jnp.bfloat16), rhs, gs, precision=jax.lax.Precision.HIGHEST),
                 jnp.float32)
    narrow = moe_xla.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.bfloat16)
    assert narrow.dtype == jnp.bfloat16
    assert_close(narrow, theirs, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="group_offset"):
        moe_xla.ragged_dot(lhs, rhs, gs, group_offset=jnp.array([0]))
