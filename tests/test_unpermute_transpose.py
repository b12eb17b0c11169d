"""unpermute's gradient in y_sorted for any row_map (rows named several times, or not at
all, entries naming no row), its determinism, the unique_rows fast path, and the same path
through a given inverse (row_pairs) with no scatter."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_xla
from moe_xla import reference
from conftest import normal


def _np_grads(ys, rm, w, ct):
    """float64 numpy gradients of sum(unpermute(ys, rm, w) * ct) in ys and in w."""
    ys, w, ct = (np.asarray(a, np.float64) for a in (ys, w, ct))
    t, k = w.shape
    d_ys, d_w = np.zeros_like(ys), np.zeros_like(w)
    for q, r in enumerate(np.asarray(rm)):
        if 0 <= r < ys.shape[0]:
            d_ys[r] += w[q // k, q % k] * ct[q // k]
            d_w[q // k, q % k] = ct[q // k] @ ys[r]
    return d_ys, d_w


def _messy_row_map(rng, t, k):
    """[T*k] int32 with rows named several times, rows named by no entry, entries outside
    [0, T*k) on both sides."""
    n = t * k
    rm = rng.integers(0, n, size=n)
    rm[: n // 3] = rm[n // 3]                           # one row named by a third of the entries
    rm[rng.choice(n, size=4, replace=False)] = [-1, n, -(2**31), 2**31 - 1]
    return jnp.asarray(rng.permutation(rm).astype(np.int32))


def test_a_row_named_twice_gets_both_terms():
    ys, rm, w = jnp.ones((4, 3)), jnp.asarray([0, 0, 1, 2], jnp.int32), jnp.ones((2, 2))
    d = jax.grad(lambda ys: jnp.sum(moe_xla.unpermute(ys, rm, w)))(ys)
    np.testing.assert_array_equal(d[:, 0], [2.0, 1.0, 1.0, 0.0])


@pytest.mark.parametrize("batched", [False, True])
def test_grads_match_numpy_and_the_reference(rng, batched):
    b, t, k, h = 3, 10, 3, 5
    rm = jnp.stack([_messy_row_map(rng, t, k) for _ in range(b)])
    ys, w, ct = (normal(rng, s, jnp.float32) for s in ((b, t * k, h), (b, t, k), (b, t, h)))
    if not batched:
        rm, ys, w, ct = rm[0], ys[0], w[0], ct[0]

    def grads(unpermute):
        combine = jax.vmap(unpermute) if batched else unpermute
        return jax.grad(lambda ys, w: jnp.sum(combine(ys, rm, w) * ct), (0, 1))

    ours = jax.jit(grads(moe_xla.unpermute))(ys, w)
    ref = grads(reference.unpermute)(ys, w)
    per_batch = zip(ys, rm, w, ct) if batched else [(ys, rm, w, ct)]
    expected = [np.stack(g).reshape(o.shape) for g, o in zip(zip(*(_np_grads(*a) for a in per_batch)), ours)]
    for o, r, e, name in zip(ours, ref, expected, ("y_sorted", "weights")):
        np.testing.assert_allclose(o, e, rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5, err_msg=name)


def test_check_grads_with_repeated_and_out_of_range_entries(rng):
    t, k, h = 6, 2, 3
    rm = _messy_row_map(rng, t, k)
    ys, w = normal(rng, (t * k, h), jnp.float32), normal(rng, (t, k), jnp.float32)
    check_grads(jax.jit(lambda ys, w: moe_xla.unpermute(ys, rm, w)), (ys, w), order=2, modes=("fwd", "rev"), eps=1e-3)


def test_bf16_rows_get_a_bf16_gradient_summed_in_float32(rng):
    t, k, h = 16, 4, 8
    rm = _messy_row_map(rng, t, k)
    ys, w, ct = normal(rng, (t * k, h), jnp.bfloat16), normal(rng, (t, k), jnp.float32), normal(rng, (t, h), jnp.float32)
    d = jax.jit(jax.grad(lambda ys: jnp.sum(moe_xla.unpermute(ys, rm, w).astype(jnp.float32) * ct)))(ys)
    assert d.dtype == jnp.bfloat16
    want = _np_grads(ys, rm, w, ct.astype(jnp.bfloat16))[0]
    np.testing.assert_allclose(np.asarray(d, np.float64), want, rtol=1e-2, atol=1e-2)


def test_unique_rows_path_equals_the_general_path_on_a_permutation(rng):
    t, k, h = 20, 4, 6
    rm = rng.permutation(t * k).astype(np.int32)
    rm[[3, 11]] = [-1, t * k]  # entries naming no row keep the rows unique
    rm = jnp.asarray(rm)
    ys, w, ct = normal(rng, (t * k, h), jnp.float32), normal(rng, (t, k), jnp.float32), normal(rng, (t, h), jnp.float32)

    def grad(unique_rows):
        return jax.jit(jax.grad(lambda ys: jnp.sum(moe_xla.unpermute(ys, rm, w, unique_rows=unique_rows) * ct)))(ys)

    np.testing.assert_array_equal(grad(True), grad(False))


def _grad_jaxpr(unique_rows):
    rm = jnp.asarray([0, 0, 1, 5, 2, -1], jnp.int32)
    f = lambda ys, w: jnp.sum(moe_xla.unpermute(ys, rm, w, unique_rows=unique_rows))  # noqa: E731
    return str(jax.make_jaxpr(jax.grad(f))(jnp.ones((6, 4)), jnp.ones((3, 2))))


@pytest.mark.parametrize("unique_rows", [False, True])
def test_transpose_is_deterministic_by_construction(unique_rows):
    # A float scatter-add runs in an order that varies on GPUs (atomics); loops and
    # conditionals read their predicates back to the host. The transpose has neither.
    text = _grad_jaxpr(unique_rows)
    for banned in ("scatter-add", "scatter_add", "while", "cond"):
        assert not re.search(rf"\b{banned}\[", text), f"{banned} in the transpose of unpermute"
    assert re.search(rf"moe_xla_unpermute\[\s*has_row_pairs=False\s+unique_rows={unique_rows}\s+unit_k=None\s*\]", text)


def test_transpose_repeats_bitwise(rng):
    t, k, h = 64, 8, 16
    rm = jnp.asarray(rng.integers(0, 8, size=t * k).astype(np.int32))  # 8 rows named ~64 times each
    ys, w, ct = normal(rng, (t * k, h), jnp.float32), normal(rng, (t, k), jnp.float32), normal(rng, (t, h), jnp.float32)
    grad = jax.jit(jax.grad(lambda ys: jnp.sum(moe_xla.unpermute(ys, rm, w) * ct)))
    first = np.asarray(grad(ys))
    for _ in range(3):
        np.testing.assert_array_equal(grad(ys), first)


def _inverse(rm, rows):
    """numpy: the entry naming each of `rows` rows, -1 where none does (rm names each once)."""
    pairs = np.full(rows, -1, np.int64)
    for q, r in enumerate(np.asarray(rm)):
        if 0 <= r < rows:
            pairs[r] = q
    return pairs


@pytest.mark.parametrize("rows_vs_entries", [0, 7, -5])
@pytest.mark.parametrize("batched", [False, True])
def test_row_pairs_path_equals_the_computed_inverse(rng, rows_vs_entries, batched):
    # row_pairs, the inverse given, against unique_rows (the inverse computed by a scatter):
    # bitwise, in both gradients, for R = T*k, R > T*k (rows no entry names) and R < T*k
    # (entries past the rows), with entries naming no row and "none" written as -1, R, or
    # INT32 extremes; under vmap as well (its rule folds row_pairs into the stacked entries).
    b, t, k, h = 3, 10, 3, 5
    rows = t * k + rows_vs_entries
    maps, pairs = [], []
    for _ in range(b):
        rm = rng.permutation(max(rows, t * k))[: t * k]
        rm[rng.choice(t * k, 3, replace=False)] = [-1, max(rows, t * k) + 2, 2**31 - 1]
        rp = _inverse(rm, rows)
        rp[rp < 0] = rng.choice([-1, t * k, -(2**31), 2**31 - 1], size=int(np.sum(rp < 0)))
        maps.append(rm)
        pairs.append(rp)
    rm, rp = jnp.asarray(np.stack(maps), jnp.int32), jnp.asarray(np.stack(pairs), jnp.int32)
    ys, w, ct = (normal(rng, s, jnp.float32) for s in ((b, rows, h), (b, t, k), (b, t, h)))
    if not batched:
        rm, rp, ys, w, ct = rm[0], rp[0], ys[0], w[0], ct[0]

    def grads(options):
        combine = lambda ys, rm, w, rp: moe_xla.unpermute(ys, rm, w, **options(rp))  # noqa: E731
        combine = jax.vmap(combine) if batched else combine
        return jax.jit(jax.value_and_grad(lambda ys, w: jnp.sum(combine(ys, rm, w, rp) * ct), (0, 1)))(ys, w)

    given = grads(lambda rp: dict(row_pairs=rp))
    computed = grads(lambda rp: dict(unique_rows=True))
    for a, c, name in zip(jax.tree.leaves(given), jax.tree.leaves(computed), ("y", "y_sorted", "weights")):
        np.testing.assert_array_equal(a, c, err_msg=name)
    per_batch = zip(ys, rm, w, ct) if batched else [(ys, rm, w, ct)]
    d_ys = np.stack([_np_grads(*a)[0] for a in per_batch]).reshape(given[1][0].shape)
    np.testing.assert_allclose(given[1][0], d_ys, rtol=1e-5, atol=1e-5)


def test_row_pairs_transpose_reads_the_inverse_without_a_scatter():
    rm = jnp.asarray([2, 0, 5, -1, 1, 3], jnp.int32)
    rp = jnp.asarray([1, 4, 0, 5, -1, 2], jnp.int32)
    f = lambda ys, w: jnp.sum(moe_xla.unpermute(ys, rm, w, row_pairs=rp))  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(f, (0, 1)))(jnp.ones((6, 4)), jnp.ones((3, 2))))
    assert not re.search(r"\bscatter", text), text
    assert re.search(r"moe_xla_unpermute\[\s*has_row_pairs=True\s+unique_rows=True\s+unit_k=None\s*\]", text), text
    # The forward kernel takes the three operands it reads.
    hlo = jax.jit(f).lower(jnp.ones((6, 4)), jnp.ones((3, 2))).as_text()
    call = re.search(r"stablehlo.custom_call @moe_xla_unpermute_\w+\(([^)]*)\)", hlo)
    assert call and call.group(1).count("%") == 3, hlo


@pytest.mark.parametrize("options", [dict(unique_rows=True), dict(row_pairs=jnp.full((5,), -1, jnp.int32))])
def test_no_entries_give_zero_gradients(options):
    # T*k = 0 entries and R = 5 rows: y is empty, every row's gradient is 0.
    d = jax.grad(lambda ys: jnp.sum(moe_xla.unpermute(ys, jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2)),
                                                      **options)))(jnp.ones((5, 3)))
    np.testing.assert_array_equal(d, np.zeros((5, 3)))


def test_row_pairs_errors_name_the_argument():
    ys, rm, w = jnp.zeros((6, 2)), jnp.zeros((6,), jnp.int32), jnp.zeros((3, 2))
    with pytest.raises(ValueError, match=r"row_pairs.shape\[0\] \(R of y_sorted \[R, H\]\).* = 6, got 5"):
        moe_xla.unpermute(ys, rm, w, row_pairs=jnp.zeros((5,), jnp.int32))
    with pytest.raises(TypeError, match="int32 row_pairs"):
        moe_xla.unpermute(ys, rm, w, row_pairs=jnp.zeros((6,), jnp.float32))
    with pytest.raises(ValueError, match=r"row_pairs of rank 1 \[R\]"):
        moe_xla.unpermute(ys, rm, w, row_pairs=jnp.zeros((6, 1), jnp.int32))


def test_unique_rows_must_be_a_bool():
    with pytest.raises(TypeError, match="unique_rows to be a Python bool"):
        moe_xla.unpermute(jnp.zeros((4, 2)), jnp.zeros((4,), jnp.int32), jnp.zeros((2, 2)), unique_rows=1)


@pytest.mark.parametrize("expert_axis", [None, "ep"])
def test_moe_layers_take_the_one_gather_transpose(rng, expert_axis):
    # moe() and the EP layer combine through permute's row_map, which names each row once
    # (the EP layer without dedup; with dedup it sums the returned slabs by their slots).
    t, h, e, f = 8, 4, 4, 3
    ep = {} if expert_axis is None else dict(mesh=jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",)),
                                             expert_axis=expert_axis, dedup=False)
    args = (normal(rng, (t, h), jnp.float32), normal(rng, (t, e), jnp.float32), normal(rng, (e, h, 2 * f), jnp.float32),
            normal(rng, (e, f, h), jnp.float32))
    loss = lambda x, *w: jnp.sum(moe_xla.moe(x, *w, top_k=2, **ep))  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(loss, (0, 2)))(*args))
    assert "unique_rows=True" in text and "unique_rows=False" not in text
    # Where the row map is permute's, its inverse comes from permute too: no scatter computes it.
    assert re.search(r"moe_xla_unpermute\[\s*has_row_pairs=True", text)
