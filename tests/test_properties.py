"""Property-based tests (hypothesis) of gmm, tgmm, route, permute and unpermute against
moe_xla.reference, over the cases the contracts in common/grouped_gemm.h and
common/routing.h spell out: group sizes that are zero, negative, huge, summing above or
below M; expert ids that are negative, >= E or repeated; routing ties, NaN and inf
logits; row maps that repeat rows or name none (forward and gradients); float32,
bfloat16 and float16.

Every new shape or static parameter compiles the primitive (and the reference) again, so
shapes come from a few fixed buckets and the example counts are small: the values inside
a bucket (group sizes, ids, logits, row maps) are what hypothesis varies. Functions are
jitted once at module level so that their compilations are cached across examples.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_xla
from moe_xla import reference

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Relative tolerance per output dtype: both sides accumulate in float32 and round once to
# the output dtype, so they may differ by one unit in the last place of that dtype.
ULP = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 2.0**-7, jnp.dtype(jnp.float16): 2.0**-10}
INT32_EXTREMES = (-(2**31), -1, 2**31 - 1)

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

_gmm = jax.jit(moe_xla.gmm, static_argnames=("transpose_rhs",))
_gmm_ref = jax.jit(reference.gmm, static_argnames=("transpose_rhs",))
_tgmm = jax.jit(moe_xla.tgmm)
_tgmm_ref = jax.jit(reference.tgmm)


def _data(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def _close(out, ref, dtype, what):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    tol = ULP[jnp.dtype(dtype)]
    scale = np.abs(ref).max() if ref.size else 0.0
    np.testing.assert_allclose(out, ref, rtol=tol, atol=4 * tol * scale + 1e-30, err_msg=what)


def _clamped(sizes, m):
    """Group sizes after common/grouped_gemm.h's clamping, written out as a loop."""
    out, start = [], 0
    for s in sizes:
        s = min(max(int(s), 0), m - start)
        out.append(s)
        start += s
    return np.asarray(out)


# (M, K, N, G): M = 0, unaligned sizes, one group, more groups than rows.
GEMM_SHAPES = [(0, 4, 3, 2), (13, 7, 5, 4), (40, 16, 9, 6), (24, 8, 12, 1), (5, 6, 4, 9)]


@st.composite
def gemm_case(draw):
    m, k, n, g = draw(st.sampled_from(GEMM_SHAPES))
    size = st.one_of(st.integers(-3, m + 3), st.integers(0, max(1, m // g + 1)), st.sampled_from(INT32_EXTREMES))
    sizes = draw(st.lists(size, min_size=g, max_size=g))
    return m, k, n, g, np.asarray(sizes, np.int32), draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=40, **SETTINGS)
@given(case=gemm_case(), transpose_rhs=st.booleans())
def test_gmm_property(case, transpose_rhs):
    m, k, n, g, sizes, dtype, seed = case
    lhs = _data(seed, (m, k), dtype)
    rhs = _data(seed + 1, (g, n, k) if transpose_rhs else (g, k, n), dtype)
    out = _gmm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, _gmm_ref(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs), dtype, "gmm")
    # Rows past the clamped groups are exactly zero; each row block is its group's product.
    clamped = _clamped(sizes, m)
    end = int(clamped.sum())
    assert np.all(np.asarray(out[end:], np.float32) == 0)
    start = 0
    for grp, size in enumerate(clamped):
        w = np.asarray(rhs[grp], np.float64)
        block = np.asarray(lhs[start:start + size], np.float64) @ (w.T if transpose_rhs else w)
        _close(out[start:start + size], block, dtype, f"gmm rows of group {grp}")
        start += size


@settings(max_examples=30, **SETTINGS)
@given(case=gemm_case())
def test_tgmm_property(case):
    m, k, n, g, sizes, dtype, seed = case
    lhs, rhs = _data(seed, (m, k), dtype), _data(seed + 1, (m, n), dtype)
    out = _tgmm(lhs, rhs, jnp.asarray(sizes))
    assert out.dtype == dtype and out.shape == (g, k, n)
    _close(out, _tgmm_ref(lhs, rhs, jnp.asarray(sizes)), dtype, "tgmm")
    start = 0
    for grp, size in enumerate(_clamped(sizes, m)):
        a, b = (np.asarray(v[start:start + size], np.float64) for v in (lhs, rhs))
        if size == 0:
            assert np.all(np.asarray(out[grp], np.float32) == 0), f"empty group {grp} must give a zero block"
        _close(out[grp], a.T @ b, dtype, f"tgmm block {grp}")
        start += size


# (T, E) buckets for route; the routing options are static and drawn per example.
ROUTE_SHAPES = [(1, 4), (9, 8), (20, 12)]


@st.composite
def route_case(draw):
    t, e = draw(st.sampled_from(ROUTE_SHAPES))
    score = draw(st.sampled_from(("softmax", "sigmoid")))
    divisors = [d for d in range(2, e + 1) if e % d == 0]
    n_groups = draw(st.sampled_from([None] + divisors))
    topk_groups = None if n_groups is None else draw(st.integers(1, n_groups))
    most = e if n_groups is None else topk_groups * (e // n_groups)
    top_k = draw(st.integers(1, most))
    # Logits on an integer grid, so that ties are frequent and exact on both sides. Sigmoid
    # logits stay >= 0: sigmoid(x) + sigmoid(-x) = 1 would make group scores that tie in
    # exact arithmetic and not in float32 (two implementations may round them apart).
    low = -3 if score == "softmax" else 0
    special = st.sampled_from([np.nan, -np.inf] + ([np.inf] if score == "softmax" else []))
    value = st.one_of(st.integers(low, 4).map(float), special) if draw(st.booleans()) else st.integers(low, 4).map(
        float)
    logits = np.asarray(draw(st.lists(value, min_size=t * e, max_size=t * e)), np.float32).reshape(t, e)
    bias = None
    if score == "sigmoid" and draw(st.booleans()):
        bias = np.asarray(draw(st.lists(st.integers(-4, 4), min_size=e, max_size=e)), np.float32) / 4
    opts = dict(top_k=top_k, score=score, n_groups=n_groups, topk_groups=topk_groups,
                renormalize=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 0.5, 2.5])))
    return logits, bias, opts, draw(st.sampled_from(DTYPES))


@partial(jax.jit, static_argnames=("top_k", "score", "n_groups", "topk_groups", "renormalize", "scale"))
def _route(logits, bias, **opts):
    return moe_xla.route(logits, bias=bias, **opts)


@settings(max_examples=40, **SETTINGS)
@given(case=route_case())
def test_route_property(case):
    logits, bias, opts, dtype = case
    x = jnp.asarray(logits, dtype)
    b = None if bias is None else jnp.asarray(bias)
    w, ids = _route(x, b, **opts)
    ref_opts = dict(opts, n_groups=opts["n_groups"] or 1, topk_groups=opts["topk_groups"] or 1)
    w_ref, ids_ref = reference.route(x, bias=b, **ref_opts)
    t, e = logits.shape
    assert ids.shape == (t, opts["top_k"]) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
    ids = np.asarray(ids)
    assert np.all((ids >= 0) & (ids < e)), "expert ids stay in [0, E) whatever the logits"
    assert all(len(set(row)) == len(row) for row in ids.tolist()), "a token picks distinct experts"
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-7, equal_nan=True)


# (T, H, k, E) buckets for permute and unpermute.
PERMUTE_SHAPES = [(0, 3, 2, 3), (1, 2, 1, 1), (11, 4, 2, 5), (17, 3, 3, 8)]


@partial(jax.jit, static_argnames="num_experts")
def _permute(x, ids, num_experts):
    return moe_xla.permute(x, ids, num_experts, return_row_pairs=True)


@st.composite
def permute_case(draw):
    t, h, k, e = draw(st.sampled_from(PERMUTE_SHAPES))
    expert = st.one_of(st.integers(0, e - 1), st.integers(-2, e + 1), st.sampled_from(INT32_EXTREMES))
    ids = np.asarray(draw(st.lists(expert, min_size=t * k, max_size=t * k)), np.int32).reshape(t, k)
    return t, h, e, ids, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=40, **SETTINGS)
@given(case=permute_case())
def test_permute_property(case):
    t, h, e, ids, dtype, seed = case
    x = _data(seed, (t, h), dtype)
    xs, gs, rm, rp = _permute(x, jnp.asarray(ids), e)
    xs_ref, gs_ref, rm_ref = reference.permute(x, jnp.asarray(ids), e)
    np.testing.assert_array_equal(gs, gs_ref)
    np.testing.assert_array_equal(rm, rm_ref)
    np.testing.assert_array_equal(np.asarray(xs, np.float32), np.asarray(xs_ref, np.float32))
    assert xs.dtype == dtype
    # The contract, directly: counts of valid ids, a permutation, rows that carry their token.
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    np.testing.assert_array_equal(gs, np.bincount(flat[valid], minlength=e)[:e])
    rm = np.asarray(rm)
    assert sorted(rm.tolist()) == list(range(flat.size))
    np.testing.assert_array_equal(np.asarray(rp)[rm], np.arange(flat.size))  # row_pairs: row_map's inverse
    k = ids.shape[1]
    for i in range(flat.size):
        np.testing.assert_array_equal(np.asarray(xs[rm[i]], np.float32), np.asarray(x[i // k], np.float32))
    slots_valid = np.sort(rm[valid])
    assert np.array_equal(slots_valid, np.arange(valid.sum())), "valid assignments come first, invalid ones after"


UNPERMUTE_SHAPES = [(1, 1, 3), (6, 2, 4), (13, 3, 5)]  # (T, k, H)


@st.composite
def unpermute_case(draw):
    t, k, h = draw(st.sampled_from(UNPERMUTE_SHAPES))
    n = t * k
    entry = st.one_of(st.integers(0, n - 1), st.integers(-2, n + 1), st.sampled_from(INT32_EXTREMES))
    if draw(st.booleans()):  # a permutation, the way permute makes them
        row_map = np.asarray(draw(st.permutations(range(n))), np.int32)
    else:  # repeats and entries naming no row
        row_map = np.asarray(draw(st.lists(entry, min_size=n, max_size=n)), np.int32)
    return t, k, h, row_map, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=40, **SETTINGS)
@given(case=unpermute_case())
def test_unpermute_property(case):
    t, k, h, row_map, dtype, seed = case
    ys = _data(seed, (t * k, h), dtype)
    w = _data(seed + 1, (t, k), jnp.float32)
    y = jax.jit(moe_xla.unpermute)(ys, jnp.asarray(row_map), w)
    assert y.dtype == dtype and y.shape == (t, h)
    _close(y, reference.unpermute(ys, jnp.asarray(row_map), w), dtype, "unpermute")
    # The contract in float64: sum_j w[t, j] y_sorted[row_map[t k + j]], entries outside [0, T k) add 0.
    rows = np.asarray(ys, np.float64)
    slots = row_map.reshape(t, k)
    named = (slots >= 0) & (slots < t * k)
    expect = np.einsum("tj,tjh->th", np.where(named, np.asarray(w, np.float64), 0.0),
                       rows[np.clip(slots, 0, t * k - 1)])
    _close(y, expect, dtype, "unpermute against the contract")
    # Gradients in float64 from the same sum: a row named n times gets all n terms.
    ct = _data(seed + 2, (t, h), dtype)
    d_ys, d_w = _unpermute_vjp(ys, jnp.asarray(row_map), w, ct)
    c = np.asarray(ct, np.float64)
    expect_ys = np.zeros_like(rows)
    for (tok, j), r in np.ndenumerate(slots):
        if named[tok, j]:
            expect_ys[r] += float(w[tok, j]) * c[tok]
    _close(d_ys, expect_ys, dtype, "d y_sorted")
    expect_w = np.where(named, np.einsum("th,tjh->tj", c, rows[np.clip(slots, 0, t * k - 1)]), 0.0)
    _close(d_w, expect_w, dtype, "d weights")


@jax.jit
def _unpermute_vjp(ys, row_map, w, ct):
    return jax.vjp(lambda a, b: moe_xla.unpermute(a, row_map, b), ys, w)[1](ct)
