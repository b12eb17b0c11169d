"""gmm_unpermute: a grouped product summed back to the tokens, against a dense formula of
one-hot matrices (shares nothing with it); its transposes (gather_gmm with transpose_rhs
for d a, gather_tgmm for d w: the CUDA kernels on the H200 in bf16), forward mode, vmap,
and its errors at trace time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, normal

import moe_xla._rows as _rows
from moe_xla.primitives.gmm_unpermute import gmm_unpermute

# (T, k, F, H, group sizes): sizes summing below T*k (rows past the groups), an empty
# group, sizes summing above T*k (clamped: the last groups lose rows); kernel-shaped (F, H
# multiples of 8, groups of 64 rows and more: the gather kernels' full steps) and not.
CASES = [(24, 3, 8, 16, [20, 0, 31, 9]), (40, 2, 64, 136, [30, 50]), (9, 4, 12, 20, [36]),
         (300, 2, 72, 264, [100, 0, 250, 150, 50]), (100, 2, 64, 128, [90, 0, 150, 40])]
DTYPES = [jnp.float32, jnp.bfloat16]


def _slots(rng, t: int, k: int, holes: bool):
    """[T, k] int32: a permutation of the rows, or with entries naming no row (which leaves
    as many rows unnamed), and src, its inverse (-1 for rows no slot names)."""
    rm = rng.permutation(t * k)
    if holes:
        rm[rng.choice(t * k, 3, replace=False)] = [-1, t * k, 2**31 - 1]
    row_map = jnp.asarray(rm.astype(np.int32))
    pair, named = _rows.inverse_rows(row_map, t * k)
    return row_map.reshape(t, k), jnp.where(named, pair // k, -1)


def _dense(a, w, slots, sizes):
    """y = P @ (a @ W[group of row]) in float32: P[t, r] = 1 where a slot of t names r, rows
    past the groups 0."""
    m = a.shape[0]
    group = np.repeat(np.arange(len(sizes)), sizes)[:m]  # clamped to the M rows
    member = jnp.asarray(np.arange(len(sizes))[None, :] == np.pad(group, (0, m - len(group)),
                                                                  constant_values=-1)[:, None], jnp.float32)
    out = jnp.einsum("rf,rg,gfh->rh", a.astype(jnp.float32), member, w.astype(jnp.float32), precision="highest")
    picks = (slots.reshape(-1)[:, None] == jnp.arange(m)[None, :]).astype(jnp.float32)
    return jnp.einsum("tr,rh->th", picks.reshape(slots.shape[0], -1, m).sum(1), out, precision="highest")


def _inputs(rng, case, dtype, holes=True):
    t, k, f, h, sizes = case
    a = normal(rng, (t * k, f), dtype)
    w = (normal(rng, (len(sizes), f, h), jnp.float32) / np.sqrt(f)).astype(dtype)
    slots, src = _slots(rng, t, k, holes)
    return a, w, jnp.asarray(sizes, jnp.int32), slots, src


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_forward_and_transposes_match_the_dense_formula(rng, case, dtype, holes):
    a, w, gs, slots, src = _inputs(rng, case, dtype, holes)
    sizes = case[4]
    y = jax.jit(gmm_unpermute)(a, w, gs, slots, src)
    assert y.dtype == dtype and y.shape == (case[0], case[3])
    assert_close(y, _dense(a, w, slots, sizes), dtype)
    ct = normal(rng, y.shape, dtype)
    _, vjp = jax.vjp(lambda a, w: gmm_unpermute(a, w, gs, slots, src), a, w)
    d_a, d_w = jax.jit(vjp)(ct)
    _, vjp_ref = jax.vjp(lambda a, w: _dense(a, w, slots, sizes), a.astype(jnp.float32), w.astype(jnp.float32))
    want_a, want_w = vjp_ref(ct.astype(jnp.float32))
    assert d_a.dtype == dtype and d_w.dtype == dtype
    assert_close(d_a, want_a, dtype)
    assert_close(d_w, want_w, dtype)
    # Rows no slot names and rows past the groups get no gradient.
    dead = np.asarray(src) < 0
    dead[min(sum(sizes), len(dead)):] = True
    assert np.all(np.asarray(d_a, np.float32)[dead] == 0)


def test_forward_mode(rng):
    case = CASES[0]
    a, w, gs, slots, src = _inputs(rng, case, jnp.float32)
    t_a, t_w = normal(rng, a.shape, jnp.float32), normal(rng, w.shape, jnp.float32)
    _, dy = jax.jit(lambda p, t: jax.jvp(lambda a, w: gmm_unpermute(a, w, gs, slots, src), p, t))((a, w), (t_a, t_w))
    _, dy_ref = jax.jvp(lambda a, w: _dense(a, w, slots, case[4]), (a, w), (t_a, t_w))
    assert_close(dy, dy_ref, jnp.float32)


# Which operands carry the batch (a, w, group sizes, token_slots with src), on which axis.
BATCHED = [(0, None, None, None), (None, 1, None, None), (0, 0, 0, None), (1, None, None, 0), (0, 2, None, 0)]


@pytest.mark.parametrize("dims", BATCHED)
def test_vmap_and_its_gradient(rng, dims):
    """Each batch element equals its own call, forward and gradients, whichever operands
    are batched and on which axis."""
    case, b = CASES[0], 3
    elements = [_inputs(rng, case, jnp.float32) for _ in range(b)]
    sizes = [np.array(el[2]) for el in elements]
    for el, s in zip(elements, sizes):
        s[:] = rng.permutation(s)  # distinct group sizes per element, same sum
    elements = [(a, w, jnp.asarray(s), slots, src) for (a, w, _, slots, src), s in zip(elements, sizes)]
    a_d, w_d, gs_d, slot_d = dims
    axes = (a_d, w_d, gs_d, slot_d, slot_d)
    args = [jnp.stack([el[i] for el in elements], d) if d is not None else elements[0][i]
            for i, d in enumerate(axes)]
    per = [tuple(el[i] if d is not None else elements[0][i] for i, d in enumerate(axes)) for el in elements]
    got = jax.jit(jax.vmap(gmm_unpermute, in_axes=axes))(*args)
    cts = normal(rng, (b, case[0], case[3]), jnp.float32)
    grads = jax.jit(jax.vmap(lambda ct, *x: jax.grad(lambda a, w: jnp.sum(gmm_unpermute(a, w, *x[2:]) * ct),
                                                     argnums=(0, 1))(*x[:2]), in_axes=(0, *axes)))(cts, *args)
    for i in range(b):
        a, w, gs, slots, src = per[i]
        want = _dense(a, w, slots, list(np.asarray(gs)))
        assert_close(got[i], want, jnp.float32)
        want_grads = jax.grad(lambda a, w: jnp.sum(_dense(a, w, slots, list(np.asarray(gs))) * cts[i]),
                              argnums=(0, 1))(a, w)
        for x, y_ in zip(grads, want_grads):
            assert_close(x[i], y_, jnp.float32)


@pytest.mark.parametrize("change,match", [
    (lambda a, w, gs, s, src: (a, w[:, :-1], gs, s, src), r"w\.shape\[1\] \(F of a \[M, F\]\)"),
    (lambda a, w, gs, s, src: (a, w.astype(jnp.float16), gs, s, src), "dtype"),
    (lambda a, w, gs, s, src: (a, w, gs, s.astype(jnp.int16), src), "int32 token_slots"),
    (lambda a, w, gs, s, src: (a, w, gs, s, src[:-1]), r"src\.shape\[0\] \(M of a \[M, F\]\)"),
    (lambda a, w, gs, s, src: (a, w, gs, s.reshape(-1), src), "token_slots"),
    (lambda a, w, gs, s, src: (a, w, gs[:-1], s, src), "group_sizes"),
    (lambda a, w, gs, s, src: (a, w, gs, s[:-1], src), r"token_slots\.shape\[0\] \* token_slots\.shape\[1\]"),
])
def test_bad_inputs_are_named_at_trace_time(rng, change, match):
    args = change(*_inputs(rng, CASES[0], jnp.float32))
    with pytest.raises((ValueError, TypeError), match=match):
        jax.eval_shape(gmm_unpermute, *args)
