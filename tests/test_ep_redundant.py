"""Skewed load: redundant experts of the EP layer (moe_xla/ep/placement.py, replicas.py)
and the auxiliary-loss-free bias update (moe_xla/routing_bias.py).

The EP layer with hot experts replicated is held to moe() on one device: the forward
pass without dedup bitwise (a replica computes its rows with the owner's weights), with
dedup to f32 rounding, and the gradients of x, router logits, w_in and w_out to f32
rounding (a replica's weight gradient must reach its owner). The placement's greedy rule
and the replica choice t mod n_e are checked by hand. The replica weights' row selections
(primitives/select_rows.py) transpose to a gather and a sum in ascending place order, bitwise
np.add.at, so the step with replicas has no scatter (no atomics: deterministic gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_xla
from conftest import assert_close, normal, requires_8_devices
from moe_xla.ep import place_redundant_experts
from moe_xla.ep.placement import expert_slots
from moe_xla.primitives.select_rows import select_rows

T, H, F, E, K = 64, 16, 8, 16, 2  # 8 tokens and 2 experts per rank on 8 ranks


def test_placement_follows_the_greedy_rule_by_hand():
    # 2 ranks of 4 experts, 2 slots each; rank loads 15 and 4.
    # e0 (8 per replica) -> rank 1 (loads 11, 8); e1 (4; e0 now 4, lower index, but both
    # ranks host it) -> rank 1 (9, 10); rank 1 is full and rank 0 hosts e0..e3, so the
    # next largest loads per replica that rank 0 can take: e4 and e5 (1 each, lower index).
    assert place_redundant_experts([8, 4, 2, 1, 1, 1, 1, 1], peers=2, slots=2) == ((4, 5), (0, 1))
    assert place_redundant_experts(np.ones(8), peers=4, slots=0) == ((),) * 4


def test_replica_choice_is_token_index_mod_replicas():
    placement = ((4, 5), (1, 0), (0, 1), (0, 2))  # 4 ranks of 4 experts: e0 on ranks 0, 1, 2, 3
    ids = jnp.array([[0, 1], [0, 5], [0, 15], [2, 0], [0, 3]])
    dest, slot = np.divmod(np.asarray(expert_slots(ids, placement, 16)), 16 // 4 + 2)  # 6 slots per rank
    # (rank, slot) of the replicas: e0 (0, 0), (1, 5), (2, 4), (3, 4); e1 (0, 1), (2, 5);
    # e2 (0, 2), (3, 5); e5 (1, 1), (0, 5); e15 (3, 3) alone; token t takes replica t mod n_e
    np.testing.assert_array_equal(dest, [[0, 0], [1, 0], [2, 3], [3, 3], [0, 0]])
    np.testing.assert_array_equal(slot, [[0, 1], [5, 5], [4, 3], [5, 4], [0, 3]])


def test_without_replicas_slots_are_the_replica_table_of_owners_alone():
    """No replicas: the shortcut, slots numbered as the ids, is the table's owner entries."""
    from moe_xla.ep.placement import replica_table

    ids = jnp.array([[0, 15], [7, 4], [8, 3]])
    table, count = replica_table(((),) * 4, 16)
    assert np.all(count == 1)
    dest, slot = np.divmod(np.asarray(expert_slots(ids, ((),) * 4, 16)), 16 // 4)
    np.testing.assert_array_equal(np.stack([dest, slot], -1), table[np.asarray(ids), 0])


@pytest.mark.parametrize("placement,message", [
    (((1,),) * 4, "one tuple of replicated experts per rank"),
    (((2,), (0, 1)) + ((0,),) * 6, "as many replicas on every rank"),
    (((2, 3, 4),) + ((0, 1, 2),) * 7, r"slots per rank an int in \[0, E / P = 2\]"),
    (((0,),) + ((0,),) * 7, "rank 0's replicas to be distinct experts in \\[0, 16\\) that rank 0 does not own"),
    (((2, 2),) + ((0, 1),) * 7, "rank 0's replicas to be distinct"),
    (((16,),) + ((0,),) * 7, "rank 0's replicas to be distinct experts in \\[0, 16\\)"),
    ("abc", "a sequence of 8 sequences of expert ids"),
])
@requires_8_devices
def test_bad_placements_are_named(rng, placement, message):
    x, logits = normal(rng, (T, H), jnp.float32), normal(rng, (T, E), jnp.float32)
    w_in, w_out = normal(rng, (E, H, 2 * F), jnp.float32), normal(rng, (E, F, H), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    with pytest.raises(ValueError, match=message):
        moe_xla.moe(x, logits, w_in, w_out, top_k=K, mesh=mesh, expert_axis="ep", redundant_experts=placement)


def test_placement_arguments_are_checked():
    with pytest.raises(ValueError, match=r"slots per rank an int in \[0, E / P = 2\].*got 3"):
        place_redundant_experts(np.ones(16), peers=8, slots=3)
    with pytest.raises(ValueError, match="peers > 1"):
        place_redundant_experts(np.ones(16), peers=1, slots=1)
    with pytest.raises(ValueError, match=r"shape \[E\], got \(2, 8\)"):
        place_redundant_experts(np.ones((2, 8)), peers=2, slots=1)
    with pytest.raises(ValueError, match="needs expert parallelism"):
        x = jnp.ones((4, H))
        moe_xla.moe(x, jnp.ones((4, E)), jnp.ones((E, H, 2 * F)), jnp.ones((E, F, H)), top_k=K,
                    redundant_experts=((),))


def _skewed(rng):
    """Router logits whose expert e is picked about (1 + e)^-3 as often: ranks 0 and 1 hot."""
    return normal(rng, (T, E), jnp.float32) - 3.0 * jnp.log1p(jnp.arange(E, dtype=jnp.float32))


def _pairs_per_rank(ids, placement):
    """[P] pairs each rank serves, the P ranks' tokens ids [P T_r, k] in order."""
    slots = jax.vmap(lambda i: expert_slots(i, placement, E))(ids.reshape(8, -1, K))
    return np.bincount(np.asarray(slots).reshape(-1) // (E // 8 + len(placement[0])), minlength=8)


@requires_8_devices
@pytest.mark.parametrize("transport,capacity_factor", [("padded", None), ("ragged", 0.5)])
def test_redundant_experts_match_one_device(rng, transport, capacity_factor):
    x, logits = normal(rng, (T, H), jnp.float32), _skewed(rng)
    w_in = normal(rng, (E, H, 2 * F), jnp.float32) / np.sqrt(H)
    w_out = normal(rng, (E, F, H), jnp.float32) / np.sqrt(F)
    ct = normal(rng, (T, H), jnp.float32)
    ids = moe_xla.route(logits, K)[1]
    placement = place_redundant_experts(np.bincount(np.asarray(ids).reshape(-1), minlength=E), peers=8, slots=2)
    before, after = _pairs_per_rank(ids, ((),) * 8), _pairs_per_rank(ids, placement)
    assert after.max() <= before.max() / 2, (before, after)  # the replicas take load
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))

    def ep(*a, dedup=True):
        return moe_xla.moe(*a, top_k=K, mesh=mesh, expert_axis="ep", transport=transport, dedup=dedup,
                           capacity_factor=capacity_factor, redundant_experts=placement)

    def one(*a):
        return moe_xla.moe(*a, top_k=K)

    args = (x, logits, w_in, w_out)
    y_one = jax.jit(one)(*args)
    np.testing.assert_array_equal(jax.jit(lambda *a: ep(*a, dedup=False))(*args), y_one)
    grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3)))  # noqa: E731
    (loss, grads), (loss_one, grads_one) = grad(ep)(*args), grad(one)(*args)
    assert_close(loss, loss_one, jnp.float32)
    for g, g_one in zip(grads, grads_one):  # x, logits, w_in, w_out
        assert_close(g, g_one, jnp.float32, scale=10)


def test_select_rows_transpose_adds_each_rows_places_in_order(rng):
    # 4 rows, 2 ranks of 7 places; 4 is no row (padding). Rank 1 names row 0 three times,
    # row 2 twice, rows 1 and 3 never; rank 0 another table, so the rank's table is the one read.
    table = np.array([[3, 3, 1, 0, 4, 0, 2], [2, 0, 4, 0, 2, 0, 4]], np.int32)
    x = normal(rng, (4, 3, 2), jnp.float32)
    ct = normal(rng, (7, 3, 2), jnp.float32)  # nonzero at padding places too: they must add nothing
    select_vjp = jax.jit(lambda x, ct, rank: jax.vjp(lambda x: select_rows(x, table, rank), x)[1](ct)[0])
    select = jax.jit(lambda x, rank: select_rows(x, table, rank))
    for rank in range(2):
        valid = table[rank] < 4
        rows = np.where(valid[:, None, None], np.asarray(x)[table[rank] % 4], 0)  # padding places: zero rows
        np.testing.assert_array_equal(select(x, rank), rows)
        expected = np.zeros((4, 3, 2), np.float32)
        np.add.at(expected, table[rank][valid], np.asarray(ct)[valid])  # in ascending place order
        np.testing.assert_array_equal(select_vjp(x, ct, rank), expected)  # bitwise: the same order of additions
        batched = jax.vmap(select_vjp, in_axes=(None, 1, None), out_axes=1)(x, jnp.stack([ct, 2 * ct], 1), rank)
        np.testing.assert_array_equal(batched, np.stack([expected, 2 * expected], 1))


def test_bias_update_moves_towards_the_mean_load():
    bias = jnp.array([0.5, 0.0, -0.25, 1.0], jnp.float32)
    load = jnp.array([10, 2, 6, 6], jnp.int32)  # mean 6
    np.testing.assert_array_equal(moe_xla.update_routing_bias(bias, load, 0.125), [0.375, 0.125, -0.25, 1.0])
    with pytest.raises(ValueError, match=r"tokens_per_expert of bias's shape \[4\], got \[3\]"):
        moe_xla.update_routing_bias(bias, load[:3], 0.1)
    with pytest.raises(ValueError, match=r"bias of shape \[E\], got float32\[2, 2\]"):
        moe_xla.update_routing_bias(bias.reshape(2, 2), load.reshape(2, 2), 0.1)


def test_bias_update_needs_a_float32_bias():
    # rate 1e-3 as DeepSeek-V3: in bfloat16 the steps from 0.5 double (0.3047 after 100 updates)
    # and those from 2.0 vanish, so any other dtype is refused by name
    load = jnp.array([10, 2], jnp.int32)  # expert 0 above the mean, expert 1 below
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32):
        with pytest.raises(ValueError, match=rf"expected a float32 bias, got {jnp.dtype(dtype).name}: .*master copy"):
            moe_xla.update_routing_bias(jnp.array([0.5, 2.0], dtype), load, 1e-3)
    bias, expected = jnp.array([0.5, 2.0], jnp.float32), np.array([0.5, 2.0], np.float32)
    step = jax.jit(moe_xla.update_routing_bias)
    for _ in range(100):
        bias = step(bias, load, 1e-3)
        expected += np.float32(1e-3) * np.array([-1, 1], np.float32)  # the float32 sum, step by step
    assert bias.dtype == jnp.float32
    np.testing.assert_array_equal(bias, expected)
    np.testing.assert_allclose(bias, [0.4, 2.1], rtol=1e-5)
