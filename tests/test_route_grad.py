"""route_grad (the kernel of route's backward, common/routing.h) and route_tangent.

The kernels (CPU everywhere, CUDA where there is a GPU) against reference.route_grad, and
the reference against the contract written in float64 numpy loops. Data: softmax and
sigmoid, with and without renormalisation, a scale, k from 1 to E, E below, at and past a
warp's 32 lanes, every dtype, ids outside [0, E) and repeated ids, rows whose weights sum
to 0, no tokens. Then the pair as each other's transposes, route's derivatives (second
order included) against finite differences, vmap, the errors and the one custom call of
route's backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, normal, requires_gpu
from jax.test_util import check_grads

import moe_xla
from moe_xla import reference
from moe_xla.primitives.route_grad import route_grad, route_tangent

PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
# (T, E, k): k = 1, E < 32, E = 32, E not a multiple of 32, k = E, no tokens, many tokens;
# E = 4096 and E + 2k past 4096 (fewer warps per CTA on CUDA); k past 32 (several j per lane).
SHAPES = [(19, 8, 1), (23, 16, 4), (17, 32, 8), (29, 72, 6), (9, 5, 5), (0, 16, 2), (1000, 256, 8), (3, 4096, 8),
          (7, 300, 40), (5, 2048, 2048)]
PARAMS = [("softmax", True, 1.0), ("softmax", False, 2.5), ("sigmoid", True, 1.0), ("sigmoid", False, 0.5)]


def _ids(rng, t, e, k, invalid=True):
    """expert ids [T, k] int32: distinct per row, then (with invalid) some ids outside
    [0, E) and a repeated id."""
    ids = np.array([rng.permutation(e)[:k] for _ in range(t)], np.int64).reshape(t, k)
    if invalid and t > 4 and k > 1:
        ids[0, 0], ids[1, 1], ids[2, 0], ids[3, 0] = -1, e, -(2 ** 31), 2 ** 31 - 1
        ids[4, 1] = ids[4, 0]
    return jnp.asarray(ids, jnp.int32)


def _contract(logits, ids, g, score, renormalize, scale):
    """common/routing.h's route_grad in numpy loops, independent of jax: the sources in
    float32 as the contract says (a sigmoid of -200 is 0 there), the rest in float64."""
    x, ids, g = np.asarray(logits, np.float32), np.asarray(ids), np.asarray(g, np.float64)
    t, e = x.shape
    out = np.zeros((t, e))
    for r in range(t):
        with np.errstate(over="ignore"):
            if score == "softmax":
                p = np.exp(x[r] - x[r].max())
                p = (p / p.sum()).astype(np.float64)
            else:
                p = (np.float32(1) / (np.float32(1) + np.exp(-x[r]))).astype(np.float64)
        valid = (ids[r] >= 0) & (ids[r] < e)
        w = np.where(valid, p[np.where(valid, ids[r], 0)], 0.0)
        gs = scale * g[r]
        total = w.sum()
        u = gs / total - (w @ gs) / total ** 2 if renormalize and total > 0 else gs
        a = w * u if score == "softmax" else w * (1 - w) * u
        out[r] = -p * a.sum() if score == "softmax" else 0.0
        for j in np.nonzero(valid)[0]:
            out[r, ids[r, j]] += a[j]
    return out


@pytest.mark.parametrize("t,e,k", SHAPES)
@pytest.mark.parametrize("score,renormalize,scale", PARAMS)
def test_reference_is_the_contract(rng, t, e, k, score, renormalize, scale):
    if t > 100:
        pytest.skip("the float64 loops are slow; the kernels cover this shape")
    logits, g = normal(rng, (t, e), jnp.float32), normal(rng, (t, k), jnp.float32)
    ids = _ids(rng, t, e, k)
    got = reference.route_grad(logits, ids, g, score=score, renormalize=renormalize, scale=scale)
    np.testing.assert_allclose(np.asarray(got), _contract(logits, ids, g, score, renormalize, scale), rtol=2e-5,
                               atol=2e-6)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,e,k", SHAPES)
@pytest.mark.parametrize("score,renormalize,scale", PARAMS)
def test_kernel_matches_reference(rng, platform, dtype, t, e, k, score, renormalize, scale):
    device = jax.devices(platform)[0]
    logits = jax.device_put(normal(rng, (t, e), jnp.float32).astype(dtype) * 3, device)
    g, ids = jax.device_put(normal(rng, (t, k), jnp.float32), device), jax.device_put(_ids(rng, t, e, k), device)
    kw = dict(score=score, renormalize=renormalize, scale=scale)
    got = jax.jit(lambda *a: route_grad(*a, **kw))(logits, ids, g)
    want = jax.jit(lambda *a: reference.route_grad(*a, **kw))(logits, ids, g)
    assert got.dtype == logits.dtype and got.shape == (t, e)
    # Element-wise, against the size of the terms (scale * g): with k = 1 and
    # renormalisation the derivative is 0 up to their rounding, where a norm-relative error
    # means nothing.
    tol = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    terms = scale * float(np.max(np.abs(np.asarray(g)), initial=0.0))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol * terms)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_zero_weight_sums_and_extreme_logits(platform):
    # Sigmoid rows whose picked weights are all 0 (no renormalisation there), rows of one
    # huge logit (softmax weights 1 and 0), and -inf logits.
    device = jax.devices(platform)[0]
    logits = np.full((4, 40), -200.0, np.float32)
    logits[1, 3], logits[2, :] = 80.0, 0.0
    logits[3, 5:] = -np.inf
    ids = np.tile(np.arange(4, dtype=np.int32), (4, 1))
    g = np.arange(16, dtype=np.float32).reshape(4, 4) - 7
    for score in ("softmax", "sigmoid"):
        kw = dict(score=score, renormalize=True, scale=1.5)
        got = jax.jit(lambda *a: route_grad(*a, **kw))(*(jax.device_put(a, device) for a in (logits, ids, g)))
        np.testing.assert_allclose(np.asarray(got), _contract(logits, ids, g, score, True, 1.5), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_tiny_renormalised_sigmoid_weights(platform):
    # Picked sigmoid weights near e^-60: S * S underflows in float32, the derivative is
    # still of the size of the cotangent.
    device = jax.devices(platform)[0]
    logits = np.full((3, 8), -90.0, np.float32)
    logits[:, :3] = [[-60.0, -61.0, -62.0], [-44.0, -48.0, -55.0], [-70.0, -20.0, -80.0]]
    ids = np.tile(np.arange(3, dtype=np.int32), (3, 1))
    g = np.array([[1.0, -0.5, 0.25]] * 3, np.float32)
    kw = dict(score="sigmoid", renormalize=True, scale=1.0)
    want = _contract(logits, ids, g, "sigmoid", True, 1.0)
    assert np.all(np.isfinite(want)) and np.max(np.abs(want)) > 0.1
    for fn in (route_grad, reference.route_grad):
        got = jax.jit(lambda *a, fn=fn: fn(*a, **kw))(*(jax.device_put(a, device) for a in (logits, ids, g)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_more_slots_than_experts(rng, platform):
    # k > E: ids repeat within a row (and some lie outside [0, E)); every repeat adds its term.
    device = jax.devices(platform)[0]
    t, e, k = 13, 5, 9
    logits, g = normal(rng, (t, e), jnp.float32), normal(rng, (t, k), jnp.float32)
    ids = jnp.asarray(rng.integers(-2, e + 2, (t, k)), jnp.int32)
    for score, renormalize, scale in PARAMS:
        kw = dict(score=score, renormalize=renormalize, scale=scale)
        got = jax.jit(lambda *a: route_grad(*a, **kw))(*(jax.device_put(a, device) for a in (logits, ids, g)))
        np.testing.assert_allclose(np.asarray(got), _contract(logits, ids, g, score, renormalize, scale), rtol=2e-5,
                                   atol=2e-6)


@pytest.mark.parametrize("score,renormalize,scale", PARAMS)
def test_pair_are_each_others_transpose(rng, score, renormalize, scale):
    # <route_tangent(dx), g> = <dx, route_grad(g)>, and linear_transpose of each is the other.
    t, e, k = 31, 24, 5
    logits, ids = normal(rng, (t, e), jnp.float32), _ids(rng, t, e, k)
    dx, g = normal(rng, (t, e), jnp.float32), normal(rng, (t, k), jnp.float32)
    kw = dict(score=score, renormalize=renormalize, scale=scale)
    tangent = lambda d: route_tangent(logits, ids, d, **kw)  # noqa: E731
    grad = lambda c: route_grad(logits, ids, c, **kw)  # noqa: E731
    np.testing.assert_allclose(jnp.vdot(tangent(dx), g), jnp.vdot(dx, grad(g)), rtol=2e-5)
    np.testing.assert_allclose(jax.linear_transpose(tangent, dx)(g)[0], grad(g), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(jax.linear_transpose(grad, g)(dx)[0], tangent(dx), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("score,renormalize", [("softmax", True), ("sigmoid", True), ("sigmoid", False)])
def test_route_derivatives_to_second_order(rng, score, renormalize):
    # Logits spaced apart so that a finite difference does not change the selection.
    t, e, k = 6, 12, 3
    spaced = jnp.asarray(np.stack([rng.permutation(e) for _ in range(t)]) * 0.5, jnp.float32)
    f = jax.jit(lambda l: moe_xla.route(l, k, score=score, renormalize=renormalize, scale=1.3)[0])
    check_grads(f, (spaced,), order=2, modes=("fwd", "rev"), eps=1e-3, atol=2e-2, rtol=2e-2)


def test_vmap(rng):
    b, t, e, k = 3, 11, 20, 4
    logits, g = normal(rng, (b, t, e), jnp.float32), normal(rng, (b, t, k), jnp.float32)
    ids = jnp.stack([_ids(rng, t, e, k) for _ in range(b)])
    kw = dict(score="softmax", renormalize=True, scale=1.0)
    got = jax.jit(jax.vmap(lambda *a: route_grad(*a, **kw)))(logits, ids, g)
    want = jnp.stack([reference.route_grad(logits[i], ids[i], g[i], **kw) for i in range(b)])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    got = jax.vmap(lambda l, i, d: route_tangent(l, i, d, **kw), in_axes=(0, 0, None))(logits, ids, logits[0])
    want = jnp.stack([route_tangent(logits[i], ids[i], logits[0], **kw) for i in range(b)])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_route_backward_is_one_kernel(rng):
    logits, ct = normal(rng, (64, 32), jnp.float32), normal(rng, (64, 4), jnp.float32)
    hlo = jax.jit(jax.grad(lambda l: jnp.sum(moe_xla.route(l, 4)[0] * ct))).lower(logits).as_text()
    platform = "cuda" if ON_GPU else "cpu"
    assert hlo.count(f"moe_xla_route_grad_{platform}_v1") == 1
    assert "scatter" not in hlo  # no jnp transpose of take_along_axis


@pytest.mark.parametrize("shapes,match", [
    (((4, 8), (4, 2), (4, 3)), r"expected d_weights of shape \(4, 2\)"),
    (((4, 8), (5, 2), (5, 2)), r"expert_ids.shape\[0\]"),
    (((8,), (4, 2), (4, 2)), r"expected logits of rank 2"),
])
def test_bad_input(shapes, match):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, (jnp.float32, jnp.int32, jnp.float32))]
    with pytest.raises((TypeError, ValueError), match=match):
        jax.eval_shape(lambda *a: route_grad(*a, score="softmax", renormalize=True, scale=1.0), *args)


def test_bad_dtypes():
    logits, ids = jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4, 2), jnp.int32)
    with pytest.raises(TypeError, match="expected float32 d_weights"):
        jax.eval_shape(lambda *a: route_grad(*a, score="softmax", renormalize=True, scale=1.0), logits, ids,
                       jax.ShapeDtypeStruct((4, 2), jnp.bfloat16))
    with jax.enable_x64(True), pytest.raises(TypeError, match="expected int32 expert_ids"):
        jax.eval_shape(lambda *a: route_grad(*a, score="softmax", renormalize=True, scale=1.0), logits,
                       jax.ShapeDtypeStruct((4, 2), jnp.int64), jax.ShapeDtypeStruct((4, 2), jnp.float32))
