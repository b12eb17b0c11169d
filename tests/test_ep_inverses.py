"""The inverses the EP dispatch knows without a scatter, against a numpy inversion.

ep_expand takes the inverse of its slots as `sources` where the caller knows it: the send
buffers' (transports.Link.sources, a gather of ep_row_places' sources) and the routing
weights' places (ep_dedup_rows' weight_sources, written beside weight_slot). Each must
be the exact inverse, or expand with it copies rows to the wrong places while its
transpose (read from the slots) stays right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normal

from moe_xla.ep.rounds import round_starts
from moe_xla.ep.rows import rows_by_destination
from moe_xla.ep.sizing import exchange_sizes
from moe_xla.ep.transports import Padded
from moe_xla.primitives import ep_expand
from moe_xla.primitives.ep_dedup_rows import ep_dedup_rows


def _inverse(slots, num_places):
    """[num_places]: the flat index of the entry of slots naming each place, -1 for none."""
    out = np.full(num_places, -1, np.int64)
    for i, s in enumerate(np.asarray(slots).reshape(-1)):
        if 0 <= s < num_places:
            assert out[s] == -1, "slots name a place twice"
            out[s] = i
    return out


def _routing(rng, tokens, top_k, experts):
    """weights [T, k] float32 and expert ids [T, k] int32 (the slots of experts split evenly
    over the ranks, placement.expert_slots) of a skewed top-k routing (distinct experts per token)."""
    p = np.arange(experts, 0, -1, dtype=np.float64) ** 2
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=p / p.sum()) for _ in range(tokens)])
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return jnp.asarray(weights), jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("t,k,p,local,mult", [(29, 6, 4, 5, 3), (17, 8, 1, 16, 8), (11, 4, 8, 2, 2), (0, 4, 2, 3, 2)])
def test_weight_sources_invert_the_weight_slots(rng, t, k, p, local, mult):
    dest = rng.integers(-1, p + 1, (t, k)).astype(np.int32)  # some destinations invalid
    lid = rng.integers(0, local, (t, k)).astype(np.int32)
    _, _, slot, sources = jax.jit(lambda d, l: ep_dedup_rows(d, l, peers=p, local=local, mult=mult))(
        jnp.asarray(dest), jnp.asarray(lid))
    np.testing.assert_array_equal(np.asarray(sources), _inverse(slot, t * min(k, p) * mult))


@pytest.mark.parametrize("tokens,top_k,experts,peers,dedup,cf", [
    (40, 6, 16, 4, True, None), (40, 6, 16, 4, True, 0.3), (40, 6, 16, 4, False, 0.5), (33, 4, 8, 8, True, 0.4),
    (25, 8, 16, 1, True, None),
])
def test_link_sources_invert_the_send_slots(rng, tokens, top_k, experts, peers, dedup, cf):
    # Every round's send buffer, with overflow rounds (cf) and without dedup.
    weights, ids = _routing(rng, tokens, top_k, experts)
    sizes = exchange_sizes(tokens, top_k, experts, peers, dedup=dedup, capacity_factor=cf)
    rows = rows_by_destination(weights, ids, sizes, dedup)
    link = Padded(None, sizes.rows, round_starts(rows.counts, rows.pairs, sizes))
    num_places = sizes.peers * sizes.rows
    seen = 0
    for r in range(sizes.rounds):
        slots = link.slots(rows.dest, rows.row, r)
        want = _inverse(slots, num_places)
        np.testing.assert_array_equal(np.asarray(link.sources(rows.source, r)), want, err_msg=f"round {r}")
        seen += int(np.sum(want >= 0))
    assert seen == int(jnp.sum(rows.counts))  # every row sent in some round


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expand_with_sources_is_expand(rng, dtype):
    # The same copy, derivatives and batching whether expand inverts its slots or is told.
    n, mult, pairs = 9, 3, 31
    slots = np.full((2, n, mult), -1, np.int32)
    for b in range(2):
        slots[b].reshape(-1)[:20] = rng.permutation(pairs)[:20]
    slots[1, 4, 2] = pairs + 5  # names no place
    inverse = np.stack([_inverse(s, pairs) for s in slots])
    sources = np.where(inverse >= 0, inverse // mult, -1).astype(np.int32)  # the row q of each place
    rows = normal(rng, (2, n, 8), jnp.float32).astype(dtype)
    told = jax.jit(jax.vmap(lambda r, s, src: ep_expand.expand(r, s, num_pairs=pairs, sources=src)))
    plain = jax.jit(jax.vmap(lambda r, s: ep_expand.expand(r, s, num_pairs=pairs)))
    args = (jnp.asarray(slots), jnp.asarray(sources))
    np.testing.assert_array_equal(np.asarray(told(rows, *args), np.float32),
                                  np.asarray(plain(rows, args[0]), np.float32))
    tangent, ct = normal(rng, rows.shape, jnp.float32).astype(dtype), normal(rng, (2, pairs, 8), jnp.float32)
    _, d_told = jax.jvp(lambda r: told(r, *args), (rows,), (tangent,))
    _, d_plain = jax.jvp(lambda r: plain(r, args[0]), (rows,), (tangent,))
    np.testing.assert_array_equal(np.asarray(d_told, np.float32), np.asarray(d_plain, np.float32))
    ct = ct.astype(dtype)
    (g_told,) = jax.vjp(lambda r: told(r, *args), rows)[1](ct)
    (g_plain,) = jax.vjp(lambda r: plain(r, args[0]), rows)[1](ct)
    np.testing.assert_array_equal(np.asarray(g_told, np.float32), np.asarray(g_plain, np.float32))


@pytest.mark.parametrize("sources,match", [
    (np.zeros((5,), np.int32), r"sources.shape\[0\] \(num_pairs\)"),
    (np.zeros((3,), np.int64), "expected int32 sources"),
    (np.zeros((3, 1), np.int32), r"expected sources of rank 1"),
])
def test_expand_rejects_bad_sources(sources, match):
    rows, slots = np.zeros((4, 8), np.float32), np.zeros((4, 2), np.int32)
    with jax.enable_x64(True), pytest.raises((TypeError, ValueError), match=match):
        jax.eval_shape(lambda r, s, src: ep_expand.expand(r, s, num_pairs=3, sources=src), rows, slots, sources)
