"""route, permute and unpermute against the reference, with autodiff, vmap and errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_xla
from moe_xla import reference
from conftest import assert_close, normal

ROUTE_CASES = [
    dict(top_k=2, score="softmax"),
    dict(top_k=1, score="softmax", renormalize=False),
    dict(top_k=16, score="softmax"),                       # top_k = E
    dict(top_k=4, score="sigmoid", bias=True, scale=2.5),
    dict(top_k=3, score="sigmoid", renormalize=False),
    dict(top_k=4, score="sigmoid", bias=True, n_groups=4, topk_groups=2),
    dict(top_k=2, score="softmax", n_groups=8, topk_groups=1),
]


def _route_args(rng, case, e=16):
    kw = dict(case)
    if kw.pop("bias", False):
        kw["bias"] = normal(rng, (e,), jnp.float32) * 0.5
    return kw


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_route_matches_reference(rng, case, dtype):
    t, e = 77, 16
    logits = normal(rng, (t, e), dtype)
    kw = _route_args(rng, case, e)
    w, ids = jax.jit(lambda l: moe_xla.route(l, **kw))(logits)
    w_ref, ids_ref = reference.route(logits, **{**kw, "n_groups": kw.get("n_groups", 1),
                                                "topk_groups": kw.get("topk_groups", 1)})
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and ids.shape == (t, case["top_k"])
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-7)
    if case.get("n_groups"):
        group = np.asarray(ids) // (e // case["n_groups"])
        assert all(len(set(row)) <= case["topk_groups"] for row in group)


def test_route_ties_nan_and_inf_rows():
    logits = jnp.array([[1.0, 3.0, 3.0, 1.0], [np.nan] * 4, [-np.inf] * 4, [0.0, np.nan, 5.0, np.nan]])
    w, ids = moe_xla.route(logits, 2)
    np.testing.assert_array_equal(ids[0], [1, 2])          # tie -> lower index first
    assert np.all((np.asarray(ids) >= 0) & (np.asarray(ids) < 4))
    np.testing.assert_array_equal(ids[2], [0, 1])
    np.testing.assert_array_equal(ids[3], [0, 1])          # a NaN logit makes the softmax row NaN
    ws, ids_s = moe_xla.route(logits, 2, score="sigmoid")
    np.testing.assert_array_equal(ids_s[3], [2, 0])        # NaN counts as -inf in selection
    assert np.isnan(np.asarray(w[1])).all()
    np.testing.assert_allclose(w[0], [0.5, 0.5], rtol=1e-6)  # the tied pair, renormalised
    s5, s0 = 1 / (1 + np.exp(-5.0)), 0.5                   # sigmoid of the two picked logits
    np.testing.assert_allclose(ws[3], [s5 / (s5 + s0), s0 / (s5 + s0)], rtol=1e-6)


def test_route_grad_matches_reference(rng):
    logits = normal(rng, (20, 8), jnp.float32)
    bias = normal(rng, (8,), jnp.float32)
    for kw in (dict(top_k=3), dict(top_k=2, score="sigmoid", bias=bias, scale=1.7), dict(top_k=2, renormalize=False)):
        ct = normal(rng, (20, kw["top_k"]), jnp.float32)
        ours = jax.grad(lambda l: jnp.sum(moe_xla.route(l, **kw)[0] * ct))(logits)
        ref = jax.grad(lambda l: jnp.sum(reference.route(l, **kw)[0] * ct))(logits)
        assert_close(ours, ref, jnp.float32)
    # Numerical derivatives need a selection that a step of eps cannot change: logits a
    # permutation of 0..7 (gaps of 1) plus small noise.
    spaced = jnp.asarray(np.stack([rng.permutation(8) for _ in range(20)]), jnp.float32) + logits * 0.01
    for kw in (dict(top_k=3), dict(top_k=2, score="sigmoid", scale=1.7)):
        check_grads(lambda l: moe_xla.route(l, **kw)[0], (spaced,), order=1, modes=("fwd", "rev"), eps=1e-3)


def test_route_vmap(rng):
    logits = normal(rng, (3, 10, 8), jnp.float32)
    w, ids = jax.vmap(lambda l: moe_xla.route(l, 2))(logits)
    w_ref, ids_ref = jax.vmap(lambda l: reference.route(l, top_k=2))(logits)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6)
    bias = normal(rng, (3, 8), jnp.float32)
    w, ids = jax.vmap(lambda l, b: moe_xla.route(l, 2, score="sigmoid", bias=b))(logits, bias)
    _, ids_ref = jax.vmap(lambda l, b: reference.route(l, top_k=2, score="sigmoid", bias=b))(logits, bias)
    np.testing.assert_array_equal(ids, ids_ref)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_without_bias_is_a_zero_bias_and_has_no_bias_operand(rng, score):
    # No bias: the call takes logits alone (no array of zeros is filled); the selection,
    # weights and logits' gradient are bitwise those of a zero bias (sigmoid), or of the
    # biasless softmax, plain and under vmap.
    logits, ct = normal(rng, (3, 37, 16), jnp.float32), normal(rng, (3, 37, 4), jnp.float32)
    zero = dict(bias=jnp.zeros((16,), jnp.float32)) if score == "sigmoid" else {}

    def run(kw):
        f = lambda l: moe_xla.route(l, 4, score=score, **kw)  # noqa: E731
        w, ids = jax.jit(jax.vmap(f))(logits)
        grad = jax.jit(jax.grad(lambda l: jnp.sum(f(l)[0] * ct[0])))(logits[0])
        return np.asarray(w), np.asarray(ids), np.asarray(grad)

    for got, want in zip(run({}), run(zero)):
        np.testing.assert_array_equal(got, want)
    hlo = jax.jit(lambda l: moe_xla.route(l, 4, score=score)).lower(logits[0]).as_text()
    call = re.search(r"stablehlo.custom_call @moe_xla_route_\w+\(([^)]*)\)", hlo)
    assert call and call.group(1).count("%") == 1, hlo
    if score == "sigmoid":
        hlo = jax.jit(lambda l, b: moe_xla.route(l, 4, score=score, bias=b)).lower(logits[0], zero["bias"]).as_text()
        call = re.search(r"stablehlo.custom_call @moe_xla_route_\w+\(([^)]*)\)", hlo)
        assert call and call.group(1).count("%") == 2, hlo


@pytest.mark.parametrize("kw,exc,match", [
    (dict(top_k=0), ValueError, r"top_k in \[1, 8\]"),
    (dict(top_k=9), ValueError, r"top_k in \[1, 8\]"),
    (dict(top_k=2, score="relu"), ValueError, "score in"),
    (dict(top_k=2, n_groups=3, topk_groups=1), ValueError, "n_groups to divide the 8 experts, got 3"),
    (dict(top_k=2, n_groups=4), ValueError, "n_groups and topk_groups go together"),
    (dict(top_k=2, n_groups=4, topk_groups=5), ValueError, "topk_groups <= n_groups"),
    (dict(top_k=5, n_groups=4, topk_groups=2), ValueError, "top_k = 5 needs more"),
    (dict(top_k=2, bias=jnp.zeros(8)), ValueError, "only defined with score='sigmoid'"),
    (dict(top_k=2, score="sigmoid", bias=jnp.zeros(7)), ValueError, r"bias of shape \(8,\) float32"),
])
def test_route_bad_input(kw, exc, match):
    with pytest.raises(exc, match=match):
        moe_xla.route(jnp.zeros((4, 8)), **kw)


@pytest.mark.parametrize("t,h,k,e,invalid", [(50, 12, 2, 8, 0.0), (33, 7, 3, 5, 0.2), (64, 16, 8, 8, 0.0),
                                             (9, 5, 1, 1, 0.0), (0, 4, 2, 4, 0.0)])
def test_permute_matches_reference(rng, t, h, k, e, invalid):
    x = normal(rng, (t, h), jnp.float32)
    ids = rng.integers(0, e, size=(t, k)).astype(np.int32)
    ids[rng.random((t, k)) < invalid] = rng.choice([-1, e, e + 7, -2**31])
    xs, gs, rm, rp = jax.jit(lambda x, i: moe_xla.permute(x, i, e, return_row_pairs=True))(x, jnp.asarray(ids))
    xs_ref, gs_ref, rm_ref, rp_ref = reference.permute(x, jnp.asarray(ids), e, return_row_pairs=True)
    np.testing.assert_array_equal(gs, gs_ref)
    np.testing.assert_array_equal(rm, rm_ref)
    np.testing.assert_array_equal(rp, rp_ref)
    np.testing.assert_array_equal(xs, xs_ref)
    assert sorted(np.asarray(rm).tolist()) == list(range(t * k)), "row_map is a permutation"
    np.testing.assert_array_equal(np.asarray(rp)[np.asarray(rm)], np.arange(t * k), "row_pairs is its inverse")
    assert len(jax.jit(lambda x, i: moe_xla.permute(x, i, e))(x, jnp.asarray(ids))) == 3


def test_unpermute_matches_reference_and_skips_bad_rows(rng):
    t, k, h = 30, 3, 10
    ys = normal(rng, (t * k, h), jnp.float32)
    rm = jnp.asarray(rng.permutation(t * k).astype(np.int32))
    w = normal(rng, (t, k), jnp.float32)
    np.testing.assert_allclose(moe_xla.unpermute(ys, rm, w), reference.unpermute(ys, rm, w), rtol=1e-6, atol=1e-6)
    bad = rm.at[0].set(-5).at[4].set(t * k)
    np.testing.assert_allclose(moe_xla.unpermute(ys, bad, w), reference.unpermute(ys, bad, w), rtol=1e-6, atol=1e-6)


def _unpermute_against_reference(rng, maps, rows: int, t: int, k: int, h: int, batched: bool):
    """unpermute's value and gradients in (y_sorted [rows, h], weights [t, k]) of sum(y * ct),
    jitted, against the reference's jnp gradients, for row maps [B, t*k] (batch element 0
    alone, or all under vmap) -> (ours, the row maps used)."""
    b = maps.shape[0]
    ys, w, ct = (normal(rng, s, jnp.float32) for s in ((b, rows, h), (b, t, k), (b, t, h)))
    rm = jnp.asarray(maps)
    if not batched:
        ys, rm, w, ct = ys[0], rm[0], w[0], ct[0]

    def loss(mod):
        combine = jax.vmap(mod.unpermute) if batched else mod.unpermute
        return lambda ys, w: jnp.sum(combine(ys, rm, w) * ct)

    ours = jax.jit(jax.value_and_grad(loss(moe_xla), (0, 1)))(ys, w)
    ref = jax.value_and_grad(loss(reference), (0, 1))(ys, w)
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    return ours, rm


@pytest.mark.parametrize("batched", [False, True])
def test_unpermute_bad_rows_forward_and_grads(rng, batched):
    # row_map entries outside [0, T*k) name no row: they add nothing to y, their weights get
    # 0 cotangent, and so do the rows no entry names (also under vmap, whose batching rule
    # folds the batch into one row_map).
    b, t, k, h = 3, 12, 2, 5
    maps = np.stack([rng.permutation(t * k) for _ in range(b)]).astype(np.int32)
    maps[:, 0], maps[:, 5], maps[1, 7], maps[2, 9] = -1, t * k, -7, 10**6
    ours, rm = _unpermute_against_reference(rng, maps, t * k, t, k, h, batched)
    for d, m in zip(np.asarray(ours[1][0]).reshape(-1, t * k, h), np.asarray(rm).reshape(-1, t * k)):
        named = np.isin(np.arange(t * k), m)
        assert np.all(d[~named] == 0) and np.all(np.abs(d[named]).sum(-1) > 0)


@pytest.mark.parametrize("rows", [0, 17, 24, 61])
@pytest.mark.parametrize("batched", [False, True])
def test_unpermute_any_number_of_rows(rng, rows, batched):
    # y_sorted of R rows, R != T*k (the EP layer's padded buffers): entries outside [0, R)
    # name no row, rows past T*k that no entry names get 0 cotangent; forward, both
    # gradients and vmap against the reference's jnp gradients.
    b, t, k, h = 2, 12, 2, 5
    maps = rng.integers(-3, max(rows, t * k) + 3, size=(b, t * k)).astype(np.int32)
    maps[:, 1] = rows - 1
    ours, _ = _unpermute_against_reference(rng, maps, rows, t, k, h, batched)
    assert ours[1][0].shape == ((b,) if batched else ()) + (rows, h)


def test_empty_shapes_under_vmap_and_grad():
    # No tokens, or an empty batch: the batching and transpose rules keep their shapes.
    ids = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    assert jax.vmap(lambda x, i: moe_xla.permute(x, i, 3))(jnp.ones((2, 0, 5)), ids(2, 0, 2))[0].shape == (2, 0, 5)
    assert jax.vmap(lambda x, i: moe_xla.permute(x, i, 3))(jnp.ones((0, 4, 5)), ids(0, 4, 2))[0].shape == (0, 8, 5)
    assert jax.vmap(moe_xla.unpermute)(jnp.ones((2, 0, 5)), ids(2, 0), jnp.ones((2, 0, 2))).shape == (2, 0, 5)
    assert jax.vmap(moe_xla.unpermute)(jnp.ones((0, 8, 5)), ids(0, 8), jnp.ones((0, 4, 2))).shape == (0, 4, 5)
    assert jax.vmap(lambda l: moe_xla.route(l, 2))(jnp.ones((2, 0, 6)))[0].shape == (2, 0, 2)
    assert jax.vmap(lambda l: moe_xla.route(l, 2))(jnp.ones((0, 4, 6)))[1].shape == (0, 4, 2)
    d_w = jax.grad(lambda w: moe_xla.unpermute(jnp.ones((0, 5)), ids(0), w).sum())(jnp.ones((0, 2)))
    assert d_w.shape == (0, 2)


def test_unpermute_entries_naming_no_row_take_no_part():
    ys, rm = jnp.ones((4, 2)), jnp.asarray([0, 1, 2, -1], jnp.int32)
    w = jnp.asarray([[1.0, 1.0], [1.0, jnp.inf]])  # the inf weight belongs to the entry -1
    for mod in (moe_xla, reference):
        np.testing.assert_array_equal(mod.unpermute(ys, rm, w), [[2.0, 2.0], [1.0, 1.0]])


def test_dispatch_combine_grads(rng):
    t, k, e, h = 20, 2, 5, 6
    x = normal(rng, (t, h), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, size=(t, k)).astype(np.int32))
    w = normal(rng, (t, k), jnp.float32)
    scale = normal(rng, (t * k, h), jnp.float32)

    def f(mod, x, w):
        xs, _, rm = mod.permute(x, ids, e)
        return mod.unpermute(jnp.sin(xs) * scale, rm, w)

    ours = jax.jit(jax.grad(lambda x, w: jnp.sum(f(moe_xla, x, w) ** 2), (0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(f(reference, x, w) ** 2), (0, 1))(x, w)
    for o, r in zip(ours, ref):
        assert_close(o, r, jnp.float32)
    check_grads(jax.jit(lambda x, w: f(moe_xla, x, w)), (x, w), order=2, modes=("fwd", "rev"), eps=1e-3)


def test_permute_unpermute_vmap(rng):
    b, t, k, e, h = 3, 11, 2, 4, 5
    x = normal(rng, (b, t, h), jnp.float32)
    ids = rng.integers(0, e, size=(b, t, k)).astype(np.int32)
    ids[1, 3, 0] = -1  # an invalid id stays inside its batch element
    ids = jnp.asarray(ids)
    ours = jax.vmap(lambda x, i: moe_xla.permute(x, i, e, return_row_pairs=True))(x, ids)
    ref = jax.vmap(lambda x, i: reference.permute(x, i, e, return_row_pairs=True))(x, ids)
    for o, r in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(o, r)
    w = normal(rng, (b, t, k), jnp.float32)
    np.testing.assert_allclose(jax.vmap(moe_xla.unpermute)(ours[0], ours[2], w),
                               jax.vmap(reference.unpermute)(ref[0], ref[2], w), rtol=1e-6, atol=1e-6)


def test_permute_and_unpermute_bad_input():
    with pytest.raises(TypeError, match="int32 expert_ids, got int16"):
        moe_xla.permute(jnp.zeros((4, 2)), jnp.zeros((4, 2), jnp.int16), 3)
    with pytest.raises(ValueError, match=r"expert_ids.shape\[0\] .* = 4, got 5"):
        moe_xla.permute(jnp.zeros((4, 2)), jnp.zeros((5, 2), jnp.int32), 3)
    with pytest.raises(ValueError, match="positive int num_experts"):
        moe_xla.permute(jnp.zeros((4, 2)), jnp.zeros((4, 2), jnp.int32), 0)
    with pytest.raises(TypeError, match="return_row_pairs to be a Python bool"):
        moe_xla.permute(jnp.zeros((4, 2)), jnp.zeros((4, 2), jnp.int32), 3, return_row_pairs=1)
    with pytest.raises(ValueError, match=r"row_map of shape \(8,\)"):
        moe_xla.unpermute(jnp.zeros((8, 3)), jnp.zeros((7,), jnp.int32), jnp.zeros((4, 2)))
    with pytest.raises(TypeError, match="float32 weights, got bfloat16"):
        moe_xla.unpermute(jnp.zeros((8, 3)), jnp.zeros((8,), jnp.int32), jnp.zeros((4, 2), jnp.bfloat16))


@pytest.mark.parametrize("op, args, results, attrs, message", [
    # unpermute's weights are optional: [T, k], or none (every weight 1, k = row_map's size / T).
    ("unpermute", [((5, 4), jnp.float32), ((6,), jnp.int32), ((3, 2), jnp.float32), ((3, 2), jnp.float32)],
     [((3, 4), jnp.float32)], {}, "at most one operand after row_map"),
    ("unpermute", [((5, 4), jnp.float32), ((7,), jnp.int32), ((3, 2), jnp.float32)], [((3, 4), jnp.float32)], {},
     r"row_map: expected shape \[6\], got \[7\]"),
    ("unpermute", [((5, 4), jnp.float32), ((6,), jnp.int32), ((3, 2), jnp.int32)], [((3, 4), jnp.float32)], {},
     "weights: expected float32, got int32"),
    ("unpermute", [((5, 4), jnp.float32), ((6,), jnp.int32)], [((4, 4), jnp.float32)], {},
     "row_map: expected T\\*k entries, a multiple of y's T = 4, got 6"),
    ("unpermute", [((5, 4), jnp.float32), ((6,), jnp.int32), ((2, 3), jnp.float32)], [((3, 4), jnp.float32)], {},
     r"y: expected shape \[2, 4\], got \[3, 4\]"),
    # route's bias is optional: [E] float32, or none.
    ("route", [((4, 8), jnp.float32), ((8,), jnp.float32), ((8,), jnp.float32)],
     [((4, 2), jnp.float32), ((4, 2), jnp.int32)], dict(top_k=2, score=1, n_groups=1, topk_groups=1,
                                                        renormalize=True, scale=np.float32(1)),
     "at most one operand after logits"),
    ("route", [((4, 8), jnp.float32), ((7,), jnp.float32)], [((4, 2), jnp.float32), ((4, 2), jnp.int32)],
     dict(top_k=2, score=1, n_groups=1, topk_groups=1, renormalize=True, scale=np.float32(1)),
     r"bias: expected shape \[8\], got \[7\]"),
    ("route", [((4, 8), jnp.float32), ((8,), jnp.int32)], [((4, 2), jnp.float32), ((4, 2), jnp.int32)],
     dict(top_k=2, score=1, n_groups=1, topk_groups=1, renormalize=True, scale=np.float32(1)),
     "bias: expected float32, got int32"),
])
def test_handlers_reject_inconsistent_buffers(op, args, results, attrs, message):
    """The FFI handlers check what the primitives' shape rules already guarantee, for
    callers that reach the targets without them (no kernel runs on such buffers)."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel(op, "cpu"), [jax.ShapeDtypeStruct(s, d) for s, d in results])
    operands = [jnp.zeros(s, d) for s, d in args]
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(*operands))
