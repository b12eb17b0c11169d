"""Sharding rules of the primitives: jit over NamedSharding'd inputs,
no shard_map. gmm along N needs no communication, along K one all-reduce; tgmm follows
K / N; route splits along tokens; permute and unpermute along the hidden dimension
(along tokens they gather, and still give the exact result)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla
from moe_xla import reference
from moe_xla.inspect import COLLECTIVES, inspect_hlo
from conftest import requires_8_devices

pytestmark = requires_8_devices

M, K, N, G = 64, 32, 48, 4


def collectives(hlo: str) -> dict:
    """{kind: count} of every collective kind (moe_xla.inspect.COLLECTIVES) in a compiled HLO text."""
    report = inspect_hlo(hlo)
    return {kind: report.count(kind) for kind in COLLECTIVES}


def custom_call_shapes(hlo: str, op: str) -> list[str]:
    return re.findall(rf"= (\([^)]*\)|\S+) custom-call\([^\n]*custom_call_target=\"moe_xla_{op}_", hlo)


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k[0], (M, K), jnp.float32)
    rhs = jax.random.normal(k[1], (G, K, N), jnp.float32)
    gs = jnp.array([10, 0, 30, 20], jnp.int32)  # an empty group and 4 trailing zero rows
    return lhs, rhs, gs


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def compiled(f, *args):
    c = jax.jit(f).lower(*args).compile()
    return c, c.as_text()


@pytest.mark.parametrize("shape", [(4,), (2, 4)])
def test_gmm_column_parallel_no_communication(data, shape):
    lhs, rhs, gs = data
    mesh = jax.make_mesh(shape, ("d", "x")[-len(shape):])
    args = put(lhs, mesh, P()), put(rhs, mesh, P(None, None, "x")), put(gs, mesh, P())
    c, hlo = compiled(lambda a, b, g: moe_xla.gmm(a, b, g), *args)
    out = c(*args)
    np.testing.assert_allclose(out, reference.gmm(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
    assert collectives(hlo) == dict.fromkeys(COLLECTIVES, 0), hlo
    assert custom_call_shapes(hlo, "gmm") == [f"f32[{M},{N // 4}]{{1,0}}"], hlo
    assert out.sharding.spec == P(None, "x")


def test_gmm_transpose_rhs_column_parallel(data):
    lhs, rhs, gs = data
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    mesh = jax.make_mesh((4,), ("x",))
    args = put(lhs, mesh, P()), put(rhs_t, mesh, P(None, "x", None)), put(gs, mesh, P())
    c, hlo = compiled(lambda a, b, g: moe_xla.gmm(a, b, g, transpose_rhs=True), *args)
    np.testing.assert_allclose(c(*args), reference.gmm(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
    assert collectives(hlo) == dict.fromkeys(COLLECTIVES, 0), hlo


def test_gmm_row_parallel_one_all_reduce(data):
    lhs, rhs, gs = data
    mesh = jax.make_mesh((4,), ("x",))
    args = put(lhs, mesh, P(None, "x")), put(rhs, mesh, P(None, "x", None)), put(gs, mesh, P())
    c, hlo = compiled(lambda a, b, g: moe_xla.gmm(a, b, g), *args)
    np.testing.assert_allclose(c(*args), reference.gmm(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
    counts = collectives(hlo)
    assert counts["all-reduce"] == 1 and counts["all-gather"] == 0, counts
    assert sum(counts.values()) == 1, counts
    assert custom_call_shapes(hlo, "gmm") == [f"f32[{M},{N}]{{1,0}}"], hlo


def test_tgmm_follows_k_and_n(data):
    lhs, rhs, gs = data
    ct = jax.random.normal(jax.random.key(1), (M, N), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("k", "n"))
    args = put(lhs, mesh, P(None, "k")), put(ct, mesh, P(None, "n")), put(gs, mesh, P())
    c, hlo = compiled(lambda a, b, g: moe_xla.tgmm(a, b, g), *args)
    out = c(*args)
    np.testing.assert_allclose(out, reference.tgmm(lhs, ct, gs), rtol=1e-5, atol=1e-5)
    assert collectives(hlo) == dict.fromkeys(COLLECTIVES, 0), hlo
    assert custom_call_shapes(hlo, "tgmm") == [f"f32[{G},{K // 2},{N // 4}]{{2,1,0}}"], hlo
    assert out.sharding.spec == P(None, "k", "n")


def test_route_splits_tokens():
    t, e = 64, 8
    logits = jax.random.normal(jax.random.key(2), (t, e), jnp.float32)
    mesh = jax.make_mesh((4,), ("x",))
    x = put(logits, mesh, P("x", None))
    c, hlo = compiled(lambda l: moe_xla.route(l, 2), x)
    w, ids = c(x)
    w_ref, ids_ref = reference.route(logits, top_k=2)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-6)
    assert collectives(hlo) == dict.fromkeys(COLLECTIVES, 0), hlo
    assert custom_call_shapes(hlo, "route")[0].startswith(f"(f32[{t // 4},2]"), hlo
    assert w.sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)


@pytest.fixture(scope="module")
def dispatch():
    t, h, e, k = 24, 16, 4, 2
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (t, h), jnp.float32)
    ids = jax.random.randint(keys[1], (t, k), 0, e, jnp.int32)
    weights = jax.random.uniform(keys[2], (t, k), jnp.float32)
    return x, ids, weights, e


def _permute_combine(x, ids, weights, e):
    x_sorted, group_sizes, row_map, row_pairs = moe_xla.permute(x, ids, e, return_row_pairs=True)
    return x_sorted, group_sizes, row_map, moe_xla.unpermute(jnp.sin(x_sorted), row_map, weights, row_pairs=row_pairs)


def test_permute_unpermute_grads_split_hidden(dispatch):
    # The derivative through permute's row_pairs (the combine's transpose gathers through
    # them): split along H like the forward, no collective, the unsplit gradients exactly.
    x, ids, weights, e = dispatch
    mesh = jax.make_mesh((4,), ("x",))
    args = put(x, mesh, P(None, "x")), put(ids, mesh, P()), put(weights, mesh, P())
    grad = jax.jit(jax.grad(lambda a, i, w: jnp.sum(_permute_combine(a, i, w, e)[3] ** 2), argnums=(0, 2)))
    d_x, d_w = grad(*args)
    r_x, r_w = jax.jit(jax.grad(lambda a, i, w: jnp.sum(_permute_combine(a, i, w, e)[3] ** 2), argnums=(0, 2)))(
        x, ids, weights)
    np.testing.assert_allclose(d_x, r_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d_w, r_w, rtol=1e-5, atol=1e-5)
    hlo = grad.lower(*args).compile().as_text()
    assert collectives(hlo)["all-gather"] == 0 and collectives(hlo)["all-to-all"] == 0, hlo
    assert d_x.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 2)


def test_permute_unpermute_split_hidden(dispatch):
    x, ids, weights, e = dispatch
    mesh = jax.make_mesh((4,), ("x",))
    args = put(x, mesh, P(None, "x")), put(ids, mesh, P()), put(weights, mesh, P())
    c, hlo = compiled(lambda a, i, w: _permute_combine(a, i, w, e), *args)
    x_sorted, group_sizes, row_map, y = c(*args)
    r_sorted, r_sizes, r_map = reference.permute(x, ids, e)
    np.testing.assert_array_equal(x_sorted, r_sorted)
    np.testing.assert_array_equal(group_sizes, r_sizes)
    np.testing.assert_array_equal(row_map, r_map)
    np.testing.assert_allclose(y, reference.unpermute(jnp.sin(r_sorted), r_map, weights), rtol=1e-6, atol=1e-6)
    assert collectives(hlo) == dict.fromkeys(COLLECTIVES, 0), hlo
    t, h = x.shape
    assert custom_call_shapes(hlo, "permute")[0].startswith(f"(f32[{t * ids.shape[1]},{h // 4}]"), hlo
    assert custom_call_shapes(hlo, "unpermute") == [f"f32[{t},{h // 4}]{{1,0}}"], hlo
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 2)


def test_permute_unpermute_token_sharded_inputs_exact(dispatch):
    x, ids, weights, e = dispatch
    mesh = jax.make_mesh((4,), ("x",))
    args = put(x, mesh, P("x", None)), put(ids, mesh, P("x", None)), put(weights, mesh, P("x", None))
    outs = jax.jit(lambda a, i, w: _permute_combine(a, i, w, e))(*args)
    refs = jax.jit(lambda a, i, w: _permute_combine(a, i, w, e))(x, ids, weights)
    for out, ref in zip(outs, refs):
        np.testing.assert_array_equal(out, ref)


def test_grad_column_parallel(data):
    lhs, rhs, gs = data
    mesh = jax.make_mesh((4,), ("x",))
    args = put(lhs, mesh, P()), put(rhs, mesh, P(None, None, "x")), put(gs, mesh, P())

    def loss(gmm):
        return lambda a, b, g: jnp.sum(jnp.sin(gmm(a, b, g)))

    grad = jax.jit(jax.grad(loss(moe_xla.gmm), argnums=(0, 1)))
    d_lhs, d_rhs = grad(*args)
    r_lhs, r_rhs = jax.grad(loss(reference.gmm), argnums=(0, 1))(lhs, rhs, gs)
    np.testing.assert_allclose(d_lhs, r_lhs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d_rhs, r_rhs, rtol=1e-4, atol=1e-4)
    hlo = grad.lower(*args).compile().as_text()
    counts = collectives(hlo)
    # d lhs = gmm(ct, rhs^T) contracts over the sharded N: one all-reduce; nothing gathered.
    assert counts["all-gather"] == 0 and counts["all-reduce"] == 1, counts
    assert custom_call_shapes(hlo, "tgmm") == [f"f32[{G},{K},{N // 4}]{{2,1,0}}"], hlo
