"""Expert parallelism (moe_xla/ep/) on 8 CPU devices against the single-device moe().

Without dedup the EP forward pass sums exactly as moe() does and must match it bitwise;
with dedup (per-rank partial sums) and in every backward pass it must match to f32 rounding.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla
from moe_xla import product_combine, reference
from moe_xla._lib import target_name
from moe_xla.ep import rounds, sizing, transports
from moe_xla.primitives import ep_expand
from conftest import ON_GPU, assert_close, normal, requires_8_devices

pytestmark = requires_8_devices

T, H, F, E = 64, 16, 8, 8  # 64 tokens: 8 per device on 8 devices, two chunks of 4 where chunks=2


def _mesh(peers, data=1):
    """A (data x) ep mesh; 1-D meshes use Auto axes, 2-D meshes jax.make_mesh's Explicit ones."""
    devices = jax.devices()[: peers * data]
    if data == 1:
        return Mesh(np.array(devices), ("ep",))
    return jax.make_mesh((data, peers), ("data", "ep"), devices=devices)


def _routing(rng, case, top_k):
    logits = normal(rng, (T, E), jnp.float32)
    if case == "balanced":  # token t picks t, t+1, ..., t+k-1 (mod E): every expert gets T k / E
        rank = (jnp.arange(E)[None, :] - jnp.arange(T)[:, None]) % E
        logits = -rank.astype(jnp.float32) + 0.3 * jax.nn.sigmoid(logits)
    elif case == "one_expert":  # every token picks expert 5 first
        logits = logits.at[:, 5].add(100.0)
    return logits


def _weights(rng, shared=False):
    w_in = normal(rng, (E, H, 2 * F), jnp.float32) / np.sqrt(H)
    w_out = normal(rng, (E, F, H), jnp.float32) / np.sqrt(F)
    if not shared:
        return w_in, w_out, {}
    return w_in, w_out, {"shared_experts": (normal(rng, (H, 24), jnp.float32) / 4,
                                            normal(rng, (12, H), jnp.float32) / 4)}


def _distinct_destinations(logits, top_k, peers):
    """Distinct (token, destination rank) pairs of the routing: dedup's dispatched rows."""
    _, ids = reference.route(logits, top_k=top_k)
    dest = np.asarray(ids) // (E // peers)
    return sum(len(set(row)) for row in dest)


def test_eight_cpu_devices():
    assert jax.device_count() == 8


FORWARD = [(1, "balanced", 2), (2, "balanced", 2), (4, "balanced", 2), (8, "balanced", 2),
           (2, "one_expert", 2), (8, "one_expert", 2), (4, "top_k_is_E", E), (8, "top_k_is_E", E)]


@pytest.mark.parametrize("peers,case,top_k", FORWARD, ids=[f"ep{p}-{c}" for p, c, _ in FORWARD])
def test_ep_forward_matches_one_device(rng, peers, case, top_k):
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, case, top_k)
    w_in, w_out, _ = _weights(rng)
    mesh = _mesh(peers)

    @jax.jit
    def run(*args):
        plain = moe_xla.moe(*args, top_k=top_k, mesh=mesh, expert_axis="ep", dedup=False, return_aux=True, chunks=2)
        dedup = moe_xla.moe(*args, top_k=top_k, mesh=mesh, expert_axis="ep", dedup=True, return_aux=True, chunks=2)
        return plain, dedup

    first = run(x, logits, w_in, w_out)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(run(x, logits, w_in, w_out))):
        np.testing.assert_array_equal(a, b)  # bitwise run to run
    (y, aux), (y_dedup, aux_dedup) = first
    y_one, aux_one = jax.jit(lambda *a: moe_xla.moe(*a, top_k=top_k, return_aux=True))(x, logits, w_in, w_out)
    np.testing.assert_array_equal(y, y_one)
    assert_close(y_dedup, y_one, jnp.float32)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_one.tokens_per_expert)
    np.testing.assert_allclose(aux.load_balance_loss, aux_one.load_balance_loss, rtol=1e-6)
    assert int(aux.dispatched_rows) == T * top_k
    assert int(aux_dedup.dispatched_rows) == _distinct_destinations(logits, top_k, peers)


def _grads(fn, args, ct):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3)))(*args)


@pytest.mark.parametrize("peers,data,dedup", [(2, 1, True), (8, 1, False), (4, 2, True)])
def test_ep_gradients_and_shared_experts(rng, peers, data, dedup):
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "random", 3)
    w_in, w_out, shared = _weights(rng, shared=True)
    ct = normal(rng, (T, H), jnp.float32)
    args = (x, logits, w_in, w_out)
    mesh = _mesh(peers, data)
    ep = lambda *a: moe_xla.moe(*a, top_k=3, mesh=mesh, expert_axis="ep", dedup=dedup, chunks=2, **shared)  # noqa: E731
    one = lambda *a: moe_xla.moe(*a, top_k=3, **shared)  # noqa: E731
    # The shared expert is an XLA dot, whose CPU kernel rounds differently for other row
    # counts: to f32 rounding even without dedup.
    assert_close(jax.jit(ep)(*args), jax.jit(one)(*args), jnp.float32)
    for name, g, g_one in zip(("x", "router_logits", "w_in", "w_out"), _grads(ep, args, ct), _grads(one, args, ct)):
        assert g.shape == g_one.shape, name
        assert_close(g, g_one, jnp.float32, scale=10)


def test_forward_mode_through_capacity_rounds(rng):
    peers, top_k = 4, 2
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "one_expert", top_k)  # overflows capacity_factor 1.0: further rounds run
    w_in, w_out, _ = _weights(rng)
    primals = (x, logits, w_in, w_out)
    tangents = tuple(normal(rng, a.shape, jnp.float32) for a in primals)
    mesh = _mesh(peers)
    ep = lambda *a: moe_xla.moe(*a, top_k=top_k, mesh=mesh, expert_axis="ep", capacity_factor=1.0)  # noqa: E731
    one = lambda *a: moe_xla.moe(*a, top_k=top_k)  # noqa: E731
    y, dy = jax.jit(lambda p, t: jax.jvp(ep, p, t))(primals, tangents)
    y_one, dy_one = jax.jit(lambda p, t: jax.jvp(one, p, t))(primals, tangents)
    assert_close(y, y_one, jnp.float32)
    assert_close(dy, dy_one, jnp.float32, scale=10)
    # vmap of the tangent map (jax.linearize's linear function over a batch of tangents)
    lin = jax.linearize(ep, *primals)[1]
    batch = tuple(jnp.stack([t, 2 * t]) for t in tangents)
    dys = jax.jit(jax.vmap(lin))(*batch)
    assert_close(dys[1], 2 * dy_one, jnp.float32, scale=10)
    # ... in which the rounds take the tangents batched and the primals (weights) as they are
    levels = [e.params["levels"] for e in _eqns(jax.make_jaxpr(jax.vmap(lin))(*batch).jaxpr)
              if e.primitive.name == "moe_xla_ep_rounds_tangent"]
    assert levels and all(len(lv) == 1 and lv[0][0] == 2 and None in lv[0][1] and 0 in lv[0][1] for lv in levels)
    # Nested: an outer batch of x and w_in tangents around an inner batch of x and logits tangents.
    tx, tl = normal(rng, (3, 2, T, H), jnp.float32), normal(rng, (2,) + logits.shape, jnp.float32)
    twi = normal(rng, (3,) + w_in.shape, jnp.float32)
    nested = jax.jit(jax.vmap(jax.vmap(lin, (0, 0, None, None)), (0, None, 0, None)))(tx, tl, twi, tangents[3])
    lin_one = jax.jit(lin)
    for a in range(3):
        for b in range(2):
            assert_close(nested[a, b], lin_one(tx[a, b], tl[b], twi[a], tangents[3]), jnp.float32)


def _eqns(jaxpr):
    """Every equation of jaxpr and of the jaxprs inside its equations' parameters."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    yield from _eqns(sub)


def test_ep_layer_under_vmap_and_its_gradient(rng):
    x = normal(rng, (2, T, H), jnp.float32)
    logits = _routing(rng, "one_expert", 2)[None].repeat(2, 0).at[1].multiply(-1.0)  # overflow rounds in one
    w_in, w_out, _ = _weights(rng)
    mesh = _mesh(4)
    ep = lambda x, l, wi: moe_xla.moe(x, l, wi, w_out, top_k=2, mesh=mesh, expert_axis="ep",  # noqa: E731
                                      capacity_factor=1.0)
    one = lambda x, l, wi: moe_xla.moe(x, l, wi, w_out, top_k=2)  # noqa: E731
    batched = (0, 0, None)
    assert_close(jax.jit(jax.vmap(ep, batched))(x, logits, w_in), jax.jit(jax.vmap(one, batched))(x, logits, w_in),
                 jnp.float32)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(jax.vmap(fn, batched)(*a)))  # noqa: E731
    grads = jax.jit(jax.grad(loss(ep), argnums=(0, 2)))(x, logits, w_in)
    for g, g_one in zip(grads, jax.jit(jax.grad(loss(one), argnums=(0, 2)))(x, logits, w_in)):
        assert_close(g, g_one, jnp.float32, scale=10)


def test_ep_routing_options_and_batched_input(rng):
    x = normal(rng, (4, 16, H), jnp.float32)
    logits = normal(rng, (4, 16, E), jnp.float32)
    w_in, w_out, _ = _weights(rng)
    kw = dict(top_k=3, score="sigmoid", bias=normal(rng, (E,), jnp.float32), n_groups=4, topk_groups=2, scale=2.0)
    mesh = _mesh(4, 2)
    ep = jax.jit(lambda *a: moe_xla.moe(*a, mesh=mesh, expert_axis="ep", dedup=False, chunks=3, **kw))
    y = ep(x, logits, w_in, w_out)
    assert y.shape == x.shape
    np.testing.assert_array_equal(y, jax.jit(lambda *a: moe_xla.moe(*a, **kw))(x, logits, w_in, w_out))


def test_capacity_overflow_is_sent_in_further_rounds(rng):
    peers, top_k = 4, 2
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "one_expert", top_k)  # rank 2 gets every token: 4x its balanced load
    w_in, w_out, _ = _weights(rng)
    tokens = T // peers // 2  # a chunk: each of its tokens sends rank 2 a row
    for dedup in (False, True):
        sizes = sizing.exchange_sizes(tokens, top_k, E, peers, dedup=dedup, capacity_factor=1.25)
        assert sizes.rows < tokens and sizes.rounds > 1
    mesh = _mesh(peers)
    args = (x, logits, w_in, w_out)
    ct = normal(rng, (T, H), jnp.float32)
    one = lambda *a: moe_xla.moe(*a, top_k=top_k)  # noqa: E731

    def ep(*a, dedup=True):
        return moe_xla.moe(*a, top_k=top_k, mesh=mesh, expert_axis="ep", dedup=dedup, capacity_factor=1.25, chunks=2)

    y_one = jax.jit(one)(*args)
    np.testing.assert_array_equal(jax.jit(partial(ep, dedup=False))(*args), y_one)
    assert_close(jax.jit(ep)(*args), y_one, jnp.float32)
    grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(ep(*a) * ct), argnums=(0, 1, 2, 3)))
    first = grads(*args)
    for g, g_one in zip(first[1], _grads(one, args, ct)):
        assert_close(g, g_one, jnp.float32, scale=10)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(grads(*args))):
        np.testing.assert_array_equal(a, b)  # bitwise run to run, overflow rounds included


def test_padded_and_ragged_transports_agree(rng):
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "one_expert", 3)
    w_in, w_out, _ = _weights(rng)
    mesh = _mesh(8)

    @jax.jit
    def run(*args):
        return [moe_xla.moe(*args, top_k=3, mesh=mesh, expert_axis="ep", transport=t, capacity_factor=cf)
                for t in ("padded", "ragged") for cf in (None, 0.5)]

    padded, *others = run(x, logits, w_in, w_out)
    for y in others:
        np.testing.assert_array_equal(y, padded)


def test_ragged_stand_in_has_ragged_all_to_all_semantics():
    # The example of jax.lax.ragged_all_to_all's docstring, on two devices.
    operand = jnp.array([1, 2, 2, 3, 4, 0], jnp.float32)
    per_device = dict(input_offsets=[[0, 1], [0, 1]], send_sizes=[[1, 2], [1, 1]], output_offsets=[[0, 0], [1, 2]],
                      recv_sizes=[[1, 1], [2, 1]])
    args = [jnp.array(v, jnp.int32).reshape(-1) for v in per_device.values()]

    def one(op, *offsets_and_sizes):
        return transports.ragged_all_to_all_by_all_to_all(op, jnp.zeros((4,), op.dtype), *offsets_and_sizes,
                                                          axis_name="ep", block=2)

    spec = jax.sharding.PartitionSpec("ep")
    out = jax.jit(jax.shard_map(one, mesh=_mesh(2), in_specs=spec, out_specs=spec))(operand, *args)
    np.testing.assert_array_equal(out, [1, 3, 0, 0, 2, 2, 4, 0])


@pytest.mark.parametrize("dedup", [True, False])
def test_ep_hlo_has_all_to_all_and_kernels_and_no_gather(rng, dedup):
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "random", 2)
    w_in, w_out, _ = _weights(rng)
    mesh = _mesh(4, 2)
    fn = jax.value_and_grad(lambda *a: jnp.sum(moe_xla.moe(*a, top_k=2, mesh=mesh, expert_axis="ep",
                                                           capacity_factor=2.0, dedup=dedup)), argnums=(0, 2, 3))
    hlo = jax.jit(fn).lower(x, logits, w_in, w_out).compile().as_text()
    assert re.search(r"\ball-to-all\(", hlo)
    # ep_expand and the sums over slots run as the gather_rows and unpermute kernels; the expert
    # rank's weighted sum is unpermute's (expert_mlp's combine).
    for op in ("route", "permute", "gmm", "tgmm", "unpermute", "gather_rows", "activate_weighted_grad"):
        assert f'custom_call_target="{target_name(op, "cpu")}"' in hlo, op
    for stage in ("route", "dispatch", "gmm_in", "act", "gmm_out", "combine"):
        assert f"moe_xla/{stage}" in hlo, stage
    assert "all-gather" not in hlo and "collective-permute" not in hlo


@pytest.mark.parametrize("dedup", [True, False])
def test_ep_combine_backward_modes_agree(rng, dedup):
    # The expert ranks' weighted sum goes through expert_mlp's combine (product_combine):
    # its backward reading the cotangent through the row map ("gather": gmm_unpermute) or
    # from a gathered copy ("copy") gives the one-device layer's gradients, for the pair
    # rows of a padded exchange (more rows than pairs) as for permute's.
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "balanced", 2)
    w_in, w_out, _ = _weights(rng)
    ct = normal(rng, (T, H), jnp.float32)
    mesh = _mesh(4)

    def grads(**kw):
        loss = lambda *a: jnp.sum(moe_xla.moe(*a, top_k=2, **kw) * ct)  # noqa: E731
        fn = jax.grad(loss, argnums=(0, 1, 2, 3))
        return jax.jit(fn)(x, logits, w_in, w_out), str(jax.make_jaxpr(fn)(x, logits, w_in, w_out))

    one, _ = grads()
    for mode in ("gather", "copy"):
        with product_combine.forced(mode):
            ep, jaxpr = grads(mesh=mesh, expert_axis="ep", dedup=dedup)
        assert ("moe_xla_gather_tgmm" in jaxpr) == (mode == "gather")  # gmm_unpermute's transpose in w_out
        for g, g_one in zip(ep, one):
            assert_close(g, g_one, jnp.float32, scale=10)


def test_ep_forward_mode(rng):
    x = normal(rng, (T, H), jnp.float32)
    logits = _routing(rng, "random", 3)
    w_in, w_out, _ = _weights(rng)
    d_x, d_w = normal(rng, x.shape, jnp.float32), normal(rng, w_in.shape, jnp.float32)
    mesh = _mesh(4)

    def tangent(**kw):
        f = lambda x, w: moe_xla.moe(x, logits, w, w_out, top_k=3, **kw)  # noqa: E731
        return jax.jit(lambda *a: jax.jvp(f, a, (d_x, d_w))[1])(x, w_in)

    assert_close(tangent(mesh=mesh, expert_axis="ep", chunks=1), tangent(), jnp.float32)


def _pair_slots(rng, n, mult, local):
    """Slots of n rows asking for mult local experts each (local: none), as the EP layer's
    receiving rank makes them: permute's row map of the (row, expert) pairs -> (slots, pairs)."""
    lids = jnp.asarray(rng.integers(0, local + 1, (n, mult)), jnp.int32)
    slots = moe_xla.permute(jnp.zeros((n, 0), jnp.float32), lids, local)[2].reshape(n, mult)
    return slots, int(jnp.sum(lids < local))


def test_expansion_and_slot_sum_are_each_others_transpose(rng):
    # ep_expand's transpose is unpermute over its slots with weights 1, and back.
    slots, pairs = _pair_slots(rng, 7, 3, 4)
    pairs += 2
    rows, values = normal(rng, (7, 5), jnp.float32), normal(rng, (pairs, 5), jnp.float32)
    expand = lambda r: ep_expand.expand(r, slots, num_pairs=pairs)  # noqa: E731
    ones = jnp.ones(slots.shape, jnp.float32)
    slot_sum = lambda v: moe_xla.unpermute(v, slots.reshape(-1), ones, unique_rows=True)  # noqa: E731
    np.testing.assert_allclose(jnp.vdot(expand(rows), values), jnp.vdot(rows, slot_sum(values)), rtol=1e-5)
    for fn, arg in ((expand, rows), (slot_sum, values)):
        jax.test_util.check_grads(fn, (arg,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("extra", [-4, 0, 9])
def test_pair_sums_are_the_row_kernels(rng, dtype, extra):
    # The layer's sums over its slots (unpermute with the slots as row map, any number of
    # rows) and ep_expand lower to the unpermute and gather_rows kernels and equal the
    # reference's sum and a numpy expansion, values and gradients, for buffers with fewer
    # (extra < 0: some slots name no row) and more rows than the pairs.
    n, mult = 9, 3
    slots, pairs = _pair_slots(rng, n, mult, 4)
    pairs += extra
    rows, values = (normal(rng, shape, dtype) for shape in ((n, 16), (pairs, 16)))
    w = normal(rng, (n, mult), jnp.float32)
    expand = lambda r: ep_expand.expand(r, slots, num_pairs=pairs)  # noqa: E731
    slot_sum = lambda v, w: moe_xla.unpermute(v, slots.reshape(-1), w, unique_rows=True)  # noqa: E731
    platform = "cuda" if ON_GPU else "cpu"
    for prim, args, target in ((expand, (rows,), "gather_rows"), (slot_sum, (values, w), "unpermute")):
        assert target_name(target, platform) in jax.jit(prim).lower(*args).as_text()
    out, vjp = jax.vjp(jax.jit(slot_sum), values, w)
    want, vjp_want = jax.vjp(lambda v, w: reference.unpermute(v, slots.reshape(-1), w), values, w)
    assert_close(out, want, dtype)
    ct = normal(rng, out.shape, dtype)
    for got, exp in zip(vjp(ct), vjp_want(ct)):
        assert_close(got, exp, got.dtype)
    named = np.asarray((slots >= 0) & (slots < pairs))
    want = np.zeros((pairs, 16), np.float32)
    want[np.asarray(slots)[named]] = np.asarray(rows, np.float32)[np.nonzero(named)[0]]
    np.testing.assert_array_equal(np.asarray(jax.jit(expand)(rows), np.float32), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expand_is_a_bitwise_copy(rng, dtype):
    # ep_expand (the layer's dispatch) copies rows bitwise, subnormals, NaN and signed
    # zeros included; rows no slot names are +0; its transpose sums with weight 1.
    n, mult, pairs = 6, 2, 15
    slots = np.full((n, mult), -1, np.int32)
    slots.reshape(-1)[:11] = rng.permutation(pairs)[:11]
    slots[5, 1] = pairs + 3  # names no row
    rows = normal(rng, (n, 8), jnp.float32).astype(dtype)
    rows = rows.at[0, :3].set(jnp.asarray([1e-39, -1e-39, -0.0], dtype)).at[1, 0].set(jnp.nan)
    got = np.asarray(jax.jit(lambda r: ep_expand.expand(r, jnp.asarray(slots), num_pairs=pairs))(rows))
    want = np.zeros((pairs, 8), got.dtype)
    for q, j in zip(*np.nonzero((slots >= 0) & (slots < pairs))):
        want[slots[q, j]] = np.asarray(rows)[q]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    ct = normal(rng, (pairs, 8), jnp.float32).astype(dtype)
    (d_rows,) = jax.vjp(lambda r: ep_expand.expand(r, jnp.asarray(slots), num_pairs=pairs), rows)[1](ct)
    ones = jnp.ones((n, mult), jnp.float32)
    assert_close(d_rows, reference.unpermute(ct, jnp.asarray(slots).reshape(-1), ones), dtype)


@pytest.mark.parametrize("rows,slots,match", [
    (np.zeros((4, 8), np.float64), np.zeros((4, 2), np.int32), "expected rows of dtype"),
    (np.zeros((4,), np.float32), np.zeros((4, 2), np.int32), r"expected rows of rank 2 \[N, H\]"),
    (np.zeros((4, 8), np.float32), np.zeros((4, 2), np.int64), "expected int32 slots"),
    (np.zeros((4, 8), np.float32), np.zeros((5, 2), np.int32), r"slots.shape\[0\]"),
])
def test_expand_rejects_bad_input(rows, slots, match):
    with jax.enable_x64(True), pytest.raises((TypeError, ValueError), match=match):
        jax.eval_shape(lambda r, s: ep_expand.expand(r, s, num_pairs=3), rows, slots)


@pytest.mark.parametrize("tokens,top_k,experts,peers,dedup,cf", [
    (24, 6, 16, 4, False, None), (24, 6, 16, 4, False, 0.5), (24, 6, 16, 4, True, None), (24, 6, 16, 4, True, 0.3),
    (24, 6, 16, 4, True, 1.25),
    # One pair per row, where the row and pair budgets round apart (7 ranks: rows = C - 1).
    (25, 2, 7, 7, True, 0.14), (7, 15, 21, 7, False, 0.2), (30, 3, 10, 5, False, 0.3)])
def test_rounds_cover_any_routing_within_budgets(rng, tokens, top_k, experts, peers, dedup, cf):
    sizes = sizing.exchange_sizes(tokens, top_k, experts, peers, dedup=dedup, capacity_factor=cf)
    assert (sizes.rounds == 1) == (cf is None)
    # Destination 0 gets the most rows it can (every token, with all its pairs), the others less.
    most = tokens if dedup else sizes.worst
    counts = np.zeros(peers, np.int32)
    counts[0], counts[1] = most, 5
    if dedup:
        counts[-1] = 3
    else:
        rest = tokens * top_k - most - 5
        for d in range(2, peers):
            counts[d] = min(rest, sizes.worst)
            rest -= counts[d]
    n = int(counts.sum())
    pairs = rng.integers(1, sizes.mult + 1, n).astype(np.int32)
    pairs[: tokens // 2] = sizes.mult  # the heaviest rows first
    starts = np.asarray(jax.jit(rounds.round_starts, static_argnums=2)(counts, pairs, sizes))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    np.testing.assert_array_equal(starts[0], offsets[:-1])
    np.testing.assert_array_equal(starts[-1], offsets[1:])  # every row sent
    before = np.concatenate([[0], np.cumsum(pairs)])
    rows = np.diff(starts, axis=0)
    assert rows.min() >= 0 and rows.max() <= sizes.rows
    assert (before[starts[1:]] - before[starts[:-1]]).max() <= sizes.capacity
    if cf is not None:
        assert rows[0, 0] < counts[0]  # destination 0 overflowed into further rounds


def test_capacity_rounds_on_seven_ranks(rng):
    # Every token picks expert 0 on a 7-rank axis: 25 one-pair rows per rank for rank 0, whose
    # rounds hold 1 row each (the row budget rounds below the pair budget): 25 rounds needed.
    peers, tokens = 7, 7 * 25
    x = normal(rng, (tokens, H), jnp.float32)
    logits = normal(rng, (tokens, peers), jnp.float32).at[:, 0].add(100.0)
    w_in, w_out = 0.3 * normal(rng, (peers, H, 2 * F), jnp.float32), 0.3 * normal(rng, (peers, F, H), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:peers]), ("ep",))
    ep = lambda *a: moe_xla.moe(*a, top_k=2, mesh=mesh, expert_axis="ep", capacity_factor=0.14, chunks=1)  # noqa: E731
    one = lambda *a: moe_xla.moe(*a, top_k=2)  # noqa: E731
    assert_close(jax.jit(ep)(x, logits, w_in, w_out), jax.jit(one)(x, logits, w_in, w_out), jnp.float32)
    loss = lambda fn: lambda wi: jnp.sum(jnp.sin(fn(x, logits, wi, w_out)))  # noqa: E731
    assert_close(jax.jit(jax.grad(loss(ep)))(w_in), jax.jit(jax.grad(loss(one)))(w_in), jnp.float32, scale=10)


def test_capacity_that_does_not_halve_the_worst_case_keeps_one_round():
    # qwen3-like, dedup: at EP 2, 1.25 x the balanced load is 0.625 of the worst case (and
    # every row), so the worst-case exchange in one round; at EP 4 and 8 budgeted rounds.
    one = sizing.exchange_sizes(2048, 8, 128, 2, dedup=True)
    assert sizing.exchange_sizes(2048, 8, 128, 2, dedup=True, capacity_factor=1.25) == one
    assert one.rounds == 1 and one.rows == 2048 and one.capacity == one.worst
    for peers in (4, 8):
        sizes = sizing.exchange_sizes(2048, 8, 128, peers, dedup=True, capacity_factor=1.25)
        assert 2 * sizes.capacity < sizes.worst and sizes.rounds > 1


@pytest.mark.parametrize("kw,match", [
    (dict(mesh=None, expert_axis="ep"), "needs a mesh"),
    (dict(), "needs expert_axis"),
    (dict(expert_axis="model"), r"expert_axis to be one of the mesh axes \('ep',\)"),
    (dict(expert_axis="ep", transport="nccl"), "transport in"),
    (dict(expert_axis="ep", capacity_factor=0.0), "capacity_factor > 0"),
    (dict(expert_axis="ep", capacity_factor=float("inf")), "finite capacity_factor"),
    (dict(expert_axis="ep", chunks=0), "positive int chunks"),
])
def test_ep_bad_options(rng, kw, match):
    args = (normal(rng, (T, H), jnp.float32), normal(rng, (T, E), jnp.float32)) + _weights(rng)[:2]
    kw = {"mesh": _mesh(4), **kw}
    with pytest.raises(ValueError, match=match):
        moe_xla.moe(*args, top_k=2, **kw)


def test_ep_option_spellings_and_no_tokens(rng):
    # A bare axis name for data_axes, a numpy integer for chunks, and no tokens at all.
    args = (normal(rng, (T, H), jnp.float32), normal(rng, (T, E), jnp.float32)) + _weights(rng)[:2]
    mesh = _mesh(2, 4)
    y = moe_xla.moe(*args, top_k=2, mesh=mesh, expert_axis="ep", data_axes="data", chunks=np.int64(2))
    assert_close(y, moe_xla.moe(*args, top_k=2), jnp.float32)
    empty = (jnp.zeros((0, H)), jnp.zeros((0, E))) + args[2:]
    assert jax.jit(lambda *a: moe_xla.moe(*a, top_k=2, mesh=mesh, expert_axis="ep"))(*empty).shape == (0, H)
    with pytest.raises(ValueError, match=r"distinct data_axes .* \('data', 'data'\)"):
        moe_xla.moe(*args, top_k=2, mesh=mesh, expert_axis="ep", data_axes=("data", "data"))


@pytest.mark.parametrize("spec", [P(None, "ep"), P(None, ("data", "ep")), P("data", "ep"), P()])
def test_ep_explicit_mesh_any_token_layout(rng, spec):
    # x [B, S, H] on an Explicit mesh, its sequence dim (or nothing) sharded: the layer
    # flattens the tokens with an explicit output sharding and returns y in x's layout.
    mesh = _mesh(4, 2)
    x, logits = (jax.device_put(normal(rng, (2, 32, n), jnp.float32), NamedSharding(mesh, spec)) for n in (H, E))
    w_in, w_out, _ = _weights(rng)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda *a: moe_xla.moe(*a, top_k=2, expert_axis="ep"))(x, logits, w_in, w_out)
    assert y.sharding.spec == P(*(tuple(spec) + (None,) * (3 - len(spec))))
    assert_close(y, moe_xla.moe(np.asarray(x), np.asarray(logits), w_in, w_out, top_k=2), jnp.float32)


def test_ep_bad_shapes(rng):
    x, logits = normal(rng, (T, H), jnp.float32), normal(rng, (T, 6), jnp.float32)
    w_in, w_out = normal(rng, (6, H, 2 * F), jnp.float32), normal(rng, (6, F, H), jnp.float32)
    with pytest.raises(ValueError, match=r"6 experts .* of size 4"):
        moe_xla.moe(x, logits, w_in, w_out, top_k=2, mesh=_mesh(4), expert_axis="ep")
    x, logits = normal(rng, (12, H), jnp.float32), normal(rng, (12, E), jnp.float32)
    with pytest.raises(ValueError, match=r"12 tokens of x .* \(8 devices\)"):
        moe_xla.moe(x, logits, *_weights(rng)[:2], top_k=2, mesh=_mesh(8), expert_axis="ep")
