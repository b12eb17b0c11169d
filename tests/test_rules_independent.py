"""The runtime rules (route's JVP, the batching rules, group-size clamping) and the
reference itself, each checked against something that shares no code with it: finite
differences, numpy, or the unbatched primitive in a Python loop."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_xla
from moe_xla import reference
from moe_xla.primitives import _batching
from conftest import normal

PACKAGE = Path(moe_xla.__file__).parent


def _imports_reference(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_xla"):
            if node.module == "moe_xla.reference" or any(a.name == "reference" for a in node.names):
                return True
        if isinstance(node, ast.Import) and any(a.name == "moe_xla.reference" for a in node.names):
            return True
    return False


def test_only_the_opt_in_lowering_uses_the_reference():
    users = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _imports_reference(p)}
    assert users == {"primitives/_lowering.py"}, users


# --- the reference against numpy -----------------------------------------------------------

def _np_silu(v):
    return v / (1.0 + np.exp(-v))


def _np_gelu(v):
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


NP_ACTIVATIONS = {
    "swiglu": lambda gate, up: _np_silu(gate) * up,
    "geglu": lambda gate, up: _np_gelu(gate) * up,
    "gelu": _np_gelu,
    "silu": _np_silu,
    "relu": lambda v: np.maximum(v, 0.0),
}


@pytest.mark.parametrize("name", sorted(NP_ACTIVATIONS))
def test_reference_activations(rng, name):
    h = rng.standard_normal((7, 10)) * 3
    got = np.asarray(reference.expert_activation(jnp.asarray(h, jnp.float32), name), np.float64)
    want = NP_ACTIVATIONS[name](h[:, :5], h[:, 5:]) if name in ("swiglu", "geglu") else NP_ACTIVATIONS[name](h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_reference_moe_against_numpy(rng, activation):
    t, h, e, f, k = 9, 6, 4, 5, 2
    x, logits = rng.standard_normal((t, h)), rng.standard_normal((t, e))
    width = 2 * f if activation == "swiglu" else f
    w_in, w_out = rng.standard_normal((e, h, width)) * 0.5, rng.standard_normal((e, f, h)) * 0.5
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = np.zeros((t, h))
    for i in range(t):
        picked = np.argsort(-p[i], kind="stable")[:k]
        for j in picked:
            a = x[i] @ w_in[j]
            act = NP_ACTIVATIONS[activation](a[:f], a[f:]) if activation == "swiglu" else NP_ACTIVATIONS[activation](a)
            want[i] += p[i, j] / p[i, picked].sum() * (act @ w_out[j])
    got = reference.moe(*(jnp.asarray(a, jnp.float32) for a in (x, logits, w_in, w_out)), top_k=k,
                        activation=activation)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5)


def test_reference_unpermute_against_numpy(rng):
    t, k, h = 6, 3, 4
    ys, w = rng.standard_normal((t * k, h)), rng.standard_normal((t, k))
    rm = rng.integers(-2, t * k + 2, size=t * k).astype(np.int32)
    rm[:4] = 5  # a row named four times
    want = np.zeros((t, h))
    for q, r in enumerate(rm):
        if 0 <= r < t * k:
            want[q // k] += w[q // k, q % k] * ys[r]
    got = reference.unpermute(jnp.asarray(ys, jnp.float32), jnp.asarray(rm), jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


# --- route's JVP against finite differences ------------------------------------------------

ROUTE_CASES = [
    dict(top_k=3),
    dict(top_k=2, renormalize=False, scale=1.5),
    dict(top_k=8),                                       # every expert: renormalised to a constant sum
    dict(top_k=2, score="sigmoid", bias=True, scale=1.7),
    dict(top_k=3, score="sigmoid", renormalize=False),
    dict(top_k=2, score="sigmoid", bias=True, n_groups=4, topk_groups=2),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_route_weights_check_grads(rng, case):
    t, e = 10, 8
    kw = dict(case)
    if kw.pop("bias", False):
        kw["bias"] = jnp.asarray(rng.permutation(e) * 0.1, jnp.float32)
    # Logits a permutation of 0..E-1 plus small noise: a step of eps changes no selection.
    logits = jnp.asarray(np.stack([rng.permutation(e) for _ in range(t)]) + 0.01 * rng.standard_normal((t, e)),
                         jnp.float32)
    check_grads(lambda l: moe_xla.route(l, **kw)[0], (logits,), order=1, modes=("fwd", "rev"), eps=1e-3,
                atol=2e-3, rtol=2e-3)


def test_route_weights_grad_keeps_the_logits_dtype(rng):
    logits = normal(rng, (6, 8), jnp.bfloat16)
    d = jax.grad(lambda l: jnp.sum(moe_xla.route(l, 2)[0] ** 2))(logits)
    assert d.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(d, np.float32)))


# --- batching rules against a loop over the batch ------------------------------------------

def _loop(fn, in_axes, *args):
    """fn over the batch, one unbatched call per element (in_axes as in jax.vmap)."""
    size = next(a.shape[ax] for a, ax in zip(args, in_axes) if ax is not None)
    outs = [fn(*(a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes))) for i in range(size)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _check_vmap(fn, in_axes, *args, exact=False):
    got, want = jax.jit(jax.vmap(fn, in_axes))(*args), _loop(jax.jit(fn), in_axes, *args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# Per batch element: sizes summing below M, above M, with negatives, huge, all zero.
SIZES = np.array([[3, 0, 5, 2], [9, 9, 9, 9], [-4, 7, -1, 20], [2**30, 2**30, 1, 0], [0, 0, 0, 0]], np.int32)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, 0), (None, 0, 0), (1, 0, None)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_vmap(rng, in_axes, transpose_rhs):
    b, m, k, n, g = 5, 16, 6, 7, 4
    lhs = normal(rng, (b, m, k) if in_axes[0] == 0 else (m, b, k) if in_axes[0] == 1 else (m, k), jnp.float32)
    rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = normal(rng, ((b,) if in_axes[1] == 0 else ()) + rhs_shape, jnp.float32)
    sizes = jnp.asarray(SIZES if in_axes[2] == 0 else SIZES[2])
    _check_vmap(lambda a, w, s: moe_xla.gmm(a, w, s, transpose_rhs=transpose_rhs), in_axes, lhs, rhs, sizes)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (None, 0, None), (0, 0, None)])
def test_tgmm_vmap(rng, in_axes):
    b, m, k, n = 5, 16, 6, 7
    lhs = normal(rng, ((b,) if in_axes[0] == 0 else ()) + (m, k), jnp.float32)
    rhs = normal(rng, ((b,) if in_axes[1] == 0 else ()) + (m, n), jnp.float32)
    sizes = jnp.asarray(SIZES if in_axes[2] == 0 else SIZES[2])
    _check_vmap(moe_xla.tgmm, in_axes, lhs, rhs, sizes)


@pytest.mark.parametrize("bias_axis", [None, 0])
def test_route_vmap(rng, bias_axis):
    logits = normal(rng, (3, 10, 8), jnp.float32)
    bias = normal(rng, (3, 8) if bias_axis == 0 else (8,), jnp.float32)
    _check_vmap(lambda l, b: moe_xla.route(l, 3, score="sigmoid", bias=b), (0, bias_axis), logits, bias, exact=True)


def test_permute_vmap(rng):
    b, t, k, e, h = 3, 9, 2, 4, 5
    ids = rng.integers(-1, e + 1, size=(b, t, k)).astype(np.int32)  # invalid ids on both sides
    _check_vmap(lambda x, i: moe_xla.permute(x, i, e), (0, 0), normal(rng, (b, t, h), jnp.float32), jnp.asarray(ids),
                exact=True)


@pytest.mark.parametrize("unique_rows", [False, True])
def test_unpermute_vmap(rng, unique_rows):
    b, t, k, h = 3, 8, 2, 5
    maps = np.stack([rng.permutation(t * k) for _ in range(b)]).astype(np.int32)
    maps[:, 1], maps[2, 4] = -1, t * k
    if not unique_rows:
        maps[0, 5:9] = maps[0, 2]
    ys, w = normal(rng, (b, t * k, h), jnp.float32), normal(rng, (b, t, k), jnp.float32)
    fn = lambda y, r, w: moe_xla.unpermute(y, r, w, unique_rows=unique_rows)  # noqa: E731
    _check_vmap(fn, (0, 0, 0), ys, jnp.asarray(maps), w)
    _check_vmap(jax.grad(lambda y, r, w: jnp.sum(fn(y, r, w) ** 2), (0, 2)), (0, 0, 0), ys, jnp.asarray(maps), w)


def test_clamped_group_sizes_follow_the_kernel_recurrence():
    # common/grouped_gemm.h: size'_g = clamp(size_g, 0, M - start_g), start_{g+1} = start_g + size'_g.
    m = 16
    want = []
    for sizes in SIZES:
        start, row = 0, []
        for s in sizes.tolist():
            row.append(min(max(s, 0), m - start))
            start += row[-1]
        want.append(row)
    np.testing.assert_array_equal(_batching.clamped_group_sizes(jnp.asarray(SIZES), m), want)
