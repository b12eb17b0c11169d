"""unpermute without weights (top_k=k: every weight 1), the form the transposes of permute,
ep_expand, gather_gmm and the EP exchange take: the same bits as weights of ones, forward
and backward, under vmap and a mesh, with no [T, k] array of ones in the program."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla
from conftest import normal


def _row_map(rng, t, k, rows):
    """[T*k] int32 naming rows of [0, rows) (repeats allowed) and some entries outside it."""
    rm = rng.integers(-2, rows + 2, t * k).astype(np.int32)
    return jnp.asarray(rm)


def _sum_np(ys, rm, t, k):
    """The plain sum of each token's named rows in j order, float32 (numpy, independent)."""
    ys = np.asarray(ys, np.float32)
    out = np.zeros((t, ys.shape[1]), np.float32)
    for i in range(t):
        for j in range(k):
            r = int(rm[i * k + j])
            if 0 <= r < ys.shape[0]:
                out[i] = out[i] + ys[r]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,k,rows,h", [(13, 3, 30, 40), (7, 1, 5, 8), (0, 4, 6, 8), (5, 2, 0, 8), (9, 4, 36, 0)])
def test_unit_weights_are_weights_of_ones_bitwise(rng, dtype, t, k, rows, h):
    ys, rm = normal(rng, (rows, h), dtype), _row_map(rng, t, k, rows)
    unit = jax.jit(lambda ys: moe_xla.unpermute(ys, rm, top_k=k))(ys)
    ones = jax.jit(lambda ys: moe_xla.unpermute(ys, rm, jnp.ones((t, k), jnp.float32)))(ys)
    assert unit.shape == (t, h) and unit.dtype == dtype
    np.testing.assert_array_equal(np.asarray(unit), np.asarray(ones))
    np.testing.assert_allclose(np.asarray(unit, np.float32), _sum_np(ys, np.asarray(rm), t, k).astype(dtype),
                               rtol=1e-2 if dtype != jnp.float32 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["general", "unique", "row_pairs"])
def test_unit_weights_gradient(rng, mode):
    # d y_sorted[r] = sum of ct[t] over the entries naming r: against numpy, and bitwise
    # the gradient of weights of ones (normal values: no product below 2^-126 to flush).
    t, k, rows, h = 11, 3, 40, 6
    if mode == "general":
        rm, kw = _row_map(rng, t, k, rows), {}
    else:
        perm = rng.permutation(rows)[:t * k].astype(np.int32)
        perm[[2, 7]] = [-1, rows]  # entries naming no row keep the rows unique
        rm = jnp.asarray(perm)
        inverse = np.full(rows, -1, np.int32)
        named = (perm >= 0) & (perm < rows)
        inverse[perm[named]] = np.flatnonzero(named)
        kw = dict(unique_rows=True) if mode == "unique" else dict(row_pairs=jnp.asarray(inverse))
    ys, ct = normal(rng, (rows, h), jnp.float32), normal(rng, (t, h), jnp.float32)

    def grad(weights, top_k):
        loss = lambda ys: jnp.sum(moe_xla.unpermute(ys, rm, weights, top_k=top_k, **kw) * ct)  # noqa: E731
        return np.asarray(jax.jit(jax.grad(loss))(ys))

    got = grad(None, k)
    np.testing.assert_array_equal(got, grad(jnp.ones((t, k), jnp.float32), None))
    want = np.zeros((rows, h), np.float32)
    for i, r in enumerate(np.asarray(rm)):
        if 0 <= r < rows:
            want[r] += np.asarray(ct)[i // k]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_unit_weights_jvp_and_vmap(rng):
    b, t, k, rows, h = 3, 6, 2, 10, 5
    ys, d_ys = normal(rng, (b, rows, h), jnp.float32), normal(rng, (b, rows, h), jnp.float32)
    rm = jnp.stack([_row_map(rng, t, k, rows) for _ in range(b)])
    f = lambda ys, rm: moe_xla.unpermute(ys, rm, top_k=k)  # noqa: E731
    out, tangent = jax.jit(jax.vmap(lambda y, d, r: jax.jvp(lambda y: f(y, r), (y,), (d,))))(ys, d_ys, rm)
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(f(ys[i], rm[i])))
        np.testing.assert_array_equal(np.asarray(tangent[i]), np.asarray(f(d_ys[i], rm[i])))
    # vmap of the gradient: each element's rows stay its own.
    ct = normal(rng, (b, t, h), jnp.float32)
    g = jax.jit(jax.vmap(jax.grad(lambda y, r, c: jnp.sum(f(y, r) * c))))(ys, rm, ct)
    for i in range(b):
        want = jax.grad(lambda y: jnp.sum(f(y, rm[i]) * ct[i]))(ys[i])
        np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(want))


def test_unit_weights_call_takes_two_operands_and_no_ones():
    # The kernel reads y_sorted and row_map alone: no [T, k] array of ones is built.
    t, k, rows, h = 6, 2, 12, 4
    rm = jnp.arange(t * k, dtype=jnp.int32)
    hlo = jax.jit(lambda ys: moe_xla.unpermute(ys, rm, top_k=k)).lower(jnp.ones((rows, h))).as_text()
    call = re.search(r"stablehlo.custom_call @moe_xla_unpermute_\w+\(([^)]*)\)", hlo)
    assert call and call.group(1).count("%") == 2, hlo
    # permute's transpose is this form: its gradient builds no broadcast of ones for the weights.
    ids = jnp.asarray(np.arange(t * k).reshape(t, k) % 5, jnp.int32)
    grad_hlo = jax.jit(jax.grad(lambda x: jnp.sum(moe_xla.permute(x, ids, 5)[0]))).lower(jnp.ones((t, h))).as_text()
    calls = re.findall(r"stablehlo.custom_call @moe_xla_unpermute_\w+\(([^)]*)\)", grad_hlo)
    assert calls and all(c.count("%") == 2 for c in calls), grad_hlo


@pytest.mark.parametrize("kw,exc,match", [
    (dict(), ValueError, r"either weights \[T, k\] or top_k"),
    (dict(weights=jnp.ones((3, 2)), top_k=2), ValueError, r"either weights \[T, k\] or top_k"),
    (dict(top_k=4), ValueError, r"a multiple of top_k=4, got \(6,\)"),
    (dict(top_k=0), ValueError, r"top_k to be an int >= 1, got 0"),
    (dict(top_k=2.0), TypeError, r"top_k to be an int >= 1, got 2.0"),
    (dict(top_k=True), TypeError, r"top_k to be an int >= 1, got True"),
])
def test_unit_weights_bad_input(kw, exc, match):
    with pytest.raises(exc, match=match):
        moe_xla.unpermute(jnp.zeros((6, 4)), jnp.zeros((6,), jnp.int32), **kw)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_unit_weights_on_a_mesh_split_along_h(rng):
    mesh = jax.make_mesh((2,), ("h",), axis_types=(jax.sharding.AxisType.Explicit,))
    t, k, rows, h = 8, 2, 20, 16
    ys, rm = normal(rng, (rows, h), jnp.float32), _row_map(rng, t, k, rows)
    want = moe_xla.unpermute(ys, rm, top_k=k)
    with jax.set_mesh(mesh):
        ys_h = jax.device_put(ys, NamedSharding(mesh, P(None, "h")))
        got = jax.jit(lambda ys: moe_xla.unpermute(ys, rm, top_k=k))(ys_h)
        assert jax.typeof(got).sharding.spec == P(None, "h")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _unique_map(rng, t, k, rows):
    """A row map naming each row at most once (two entries name none) and its inverse."""
    perm = rng.permutation(rows)[:t * k].astype(np.int32)
    perm[[1, 4]] = [-1, rows]
    inverse = np.full(rows, -1, np.int32)
    named = (perm >= 0) & (perm < rows)
    inverse[perm[named]] = np.flatnonzero(named)
    return jnp.asarray(perm), jnp.asarray(inverse)


def test_unit_weights_gradient_under_vmap_with_row_pairs(rng):
    # The batching rule folds row_pairs with the rows: each element's gradient is its own,
    # and the transpose stays a gather (no scatter).
    b, t, k, rows, h = 3, 5, 2, 14, 4
    maps = [_unique_map(rng, t, k, rows) for _ in range(b)]
    rm, rp = (jnp.stack(a) for a in zip(*maps))
    ys, ct = normal(rng, (b, rows, h), jnp.float32), normal(rng, (b, t, h), jnp.float32)
    loss = lambda y, r, p, c: jnp.sum(moe_xla.unpermute(y, r, top_k=k, row_pairs=p) * c)  # noqa: E731
    # The gradient of the batched call: its transpose reads the folded row_pairs.
    batched = lambda ys: jnp.sum(jax.vmap(loss)(ys, rm, rp, ct))  # noqa: E731
    got = jax.jit(jax.grad(batched))(ys)
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(jax.grad(loss)(ys[i], rm[i], rp[i], ct[i])))
    text = str(jax.make_jaxpr(jax.grad(batched))(ys))
    assert not re.search(r"\bscatter", text), text


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
@pytest.mark.parametrize("mode", ["unique", "row_pairs"])
def test_unit_weights_gradient_on_a_mesh_split_along_h(rng, mode):
    mesh = jax.make_mesh((2,), ("h",), axis_types=(jax.sharding.AxisType.Explicit,))
    t, k, rows, h = 6, 2, 16, 8
    rm, rp = _unique_map(rng, t, k, rows)
    kw = dict(unique_rows=True) if mode == "unique" else dict(row_pairs=rp)
    ys, ct = normal(rng, (rows, h), jnp.float32), normal(rng, (t, h), jnp.float32)
    loss = lambda y, c: jnp.sum(moe_xla.unpermute(y, rm, top_k=k, **kw) * c)  # noqa: E731
    want = jax.grad(loss)(ys, ct)
    with jax.set_mesh(mesh):
        split = NamedSharding(mesh, P(None, "h"))
        got = jax.jit(jax.grad(loss))(jax.device_put(ys, split), jax.device_put(ct, split))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unit_weights_reference_lowering(monkeypatch, rng):
    # MOE_XLA_IMPL=reference lowers the unit form to the reference with weights of ones:
    # values and gradients equal the kernel's, with and without row_pairs.
    t, k, rows, h = 7, 3, 24, 5
    rm, rp = _unique_map(rng, t, k, rows)
    ys, ct = normal(rng, (rows, h), jnp.float32), normal(rng, (t, h), jnp.float32)

    def run():
        out = []
        for kw in ({}, dict(row_pairs=rp)):
            f = lambda y: moe_xla.unpermute(y, rm, top_k=k, **kw)  # noqa: E731
            out += [jax.jit(f)(ys), jax.jit(jax.grad(lambda y: jnp.sum(f(y) * ct)))(ys)]
        return out

    kernel = run()
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    reference = run()  # fresh jits: the variable is read while lowering
    for a, b in zip(kernel, reference):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_unit_weights_transpose_copies_tiny_cotangents():
    # The one-gather transpose without weights copies the cotangent's rows as they are;
    # with weights of ones it multiplies, and gather_rows makes products of magnitude at
    # most 2^-126 signed zeros (its rule on every platform).
    t, k, rows = 2, 2, 4
    rm = jnp.asarray([2, 0, 3, 1], jnp.int32)
    ct = jnp.asarray([[1e-39, -1e-39], [1.0, -2.0]], jnp.float32)
    ys = jnp.zeros((rows, 2), jnp.float32)

    def grad(weights, top_k):
        loss = lambda y: jnp.sum(moe_xla.unpermute(y, rm, weights, top_k=top_k, unique_rows=True) * ct)  # noqa: E731
        return np.asarray(jax.jit(jax.grad(loss))(ys))

    unit, ones = grad(None, k), grad(jnp.ones((t, k), jnp.float32), None)
    np.testing.assert_array_equal(unit[[2, 0]], np.asarray(ct)[[0, 0]])  # token 0's rows: bitwise its cotangent
    np.testing.assert_array_equal(ones[[2, 0]], 0.0)
    assert np.all(np.signbit(ones[[2, 0]]) == np.signbit(np.asarray(ct)[[0, 0]]))
    np.testing.assert_array_equal(unit[[3, 1]], ones[[3, 1]])
