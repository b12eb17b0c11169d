"""The EP layer's dispatch plan: ep_dedup_rows and ep_row_places (common/ep_plan.h).

The kernels (CPU everywhere, CUDA where there is a GPU) against the reference, and the
reference against the contract written as plain Python loops (no jnp). Data: every
destination and slot invalid in some pair (-1, P, INT32 extremes), tokens with several
pairs to one rank, more pairs to a rank than mult keeps, P above and below k, one pair,
no tokens; row maps from permute and, for ep_row_places, row maps naming rows outside
[0, T*k). Then vmap, eager, the reference lowering, one custom call each, the errors, and
rows_by_destination against the plan it replaced (sort-free one-hot ranks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, requires_gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_xla import reference
from moe_xla._lib import target_name
from moe_xla.ep.rows import local_slots, rows_by_destination
from moe_xla.ep.sizing import exchange_sizes
from moe_xla.primitives.ep_dedup_rows import ep_dedup_rows
from moe_xla.primitives.ep_row_places import ep_row_places
from moe_xla.primitives.permute import permute

PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
# (T, k, P, L, M): P < k, P > k, P = 1, M = 1 and M < k (pairs past mult dropped), k = 1,
# no tokens, a large case.
SHAPES = [(37, 8, 4, 9, 8), (21, 4, 8, 3, 4), (9, 6, 1, 6, 6), (30, 8, 4, 5, 1), (25, 8, 2, 16, 3), (13, 1, 3, 2, 1),
          (0, 4, 2, 3, 2), (4000, 8, 8, 17, 8)]
INVALID = [-1, "P", -(2 ** 31), 2 ** 31 - 1]


def _pairs(rng, t, k, p, local):
    """dest, lid [T, k] int32: random ranks (often repeated within a token) and slots, with
    invalid entries of INVALID in both."""
    dest = rng.integers(0, p, (t, k)).astype(np.int64)
    lid = rng.integers(0, local, (t, k)).astype(np.int64)
    if t * k > 8:
        bad = np.array([p if v == "P" else v for v in INVALID], np.int64)
        flat = dest.reshape(-1)
        flat[3: 3 + bad.size] = bad
        # Slots are checked in rows that exist: past the invalid destinations.
        lid.reshape(-1)[3 + bad.size: 3 + 2 * bad.size] = [local if v == "P" else v for v in INVALID]
    return jnp.asarray(dest, jnp.int32), jnp.asarray(lid, jnp.int32)


def _on(platform, *args):
    return [jax.device_put(a, jax.devices(platform)[0]) for a in args]


def _assert_equal(got, want, names):
    for g, w, name in zip(got, want, names, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


DEDUP_OUT = ("row_dest", "lids", "weight_slot", "weight_sources")
PLACES_OUT = ("dest_rows", "row", "source", "pairs")


def _contract_dedup(dest, lid, p, local, mult):
    """common/ep_plan.h's ep_dedup_rows, token by token in Python."""
    dest, lid = np.asarray(dest), np.asarray(lid)
    t, k = dest.shape
    n = min(k, p)
    row_dest = np.full((t, k), p, np.int64)
    lids = np.full((t, n, mult), local, np.int64)
    slot = np.full((t, k), -1, np.int64)
    sources = np.full(t * n * mult, -1, np.int64)
    for i in range(t):
        ranks = []  # the token's valid destinations, in order of their first j
        for j in range(k):
            d = int(dest[i, j])
            if not 0 <= d < p:
                continue
            if d not in ranks:
                ranks.append(d)
                row_dest[i, j] = d
            c = ranks.index(d)
            m = sum(1 for jj in range(j) if dest[i, jj] == d)
            if m < mult:
                lids[i, c, m] = lid[i, j]
                slot[i, j] = (i * n + c) * mult + m
                sources[slot[i, j]] = i * k + j
    return row_dest, lids.reshape(t * n, mult), slot.reshape(-1), sources


def _contract_places(row_dest, row_map, lids, p, local, n):
    """common/ep_plan.h's ep_row_places in Python."""
    row_dest, row_map, lids = np.asarray(row_dest), np.asarray(row_map), np.asarray(lids)
    t, k = row_dest.shape
    dest_rows, row = np.full((t, n), p, np.int64), np.full((t, n), t * k, np.int64)
    source, pairs = np.full(t * k, t * n, np.int64), np.zeros(t * k, np.int64)
    for i in range(t):
        c = 0
        for j in range(k):
            if c == n or not 0 <= row_dest[i, j] < p:
                continue
            r = int(row_map[i * k + j])
            dest_rows[i, c] = row_dest[i, j]
            if 0 <= r < t * k:
                row[i, c] = r
                source[r] = i * n + c
                pairs[r] = np.sum((lids[i * n + c] >= 0) & (lids[i * n + c] < local))
            c += 1
    return dest_rows, row, source, pairs


def _row_map(row_dest, p):
    return permute(jnp.zeros((row_dest.shape[0], 0), jnp.float32), row_dest, p)[2]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_are_the_reference(rng, shape, platform):
    t, k, p, local, mult = shape
    dest, lid = _on(platform, *_pairs(rng, t, k, p, local))
    dedup = jax.jit(lambda d, l: ep_dedup_rows(d, l, peers=p, local=local, mult=mult))(dest, lid)
    want = reference.ep_dedup_rows(*_on("cpu", dest, lid), peers=p, local=local, mult=mult)
    _assert_equal(dedup, want, DEDUP_OUT)
    row_dest, lids, *_ = dedup
    n = min(k, p)
    row_map = _row_map(row_dest, p)
    places = jax.jit(lambda *a: ep_row_places(*a, peers=p, local=local, rows_per_token=n))(row_dest, row_map, lids)
    want = reference.ep_row_places(*_on("cpu", row_dest, row_map, lids), peers=p, local=local, rows_per_token=n)
    _assert_equal(places, want, PLACES_OUT)


@pytest.mark.parametrize("shape", SHAPES[:-1], ids=str)
def test_reference_is_the_contract_in_python(rng, shape):
    t, k, p, local, mult = shape
    dest, lid = _pairs(rng, t, k, p, local)
    dedup = reference.ep_dedup_rows(dest, lid, peers=p, local=local, mult=mult)
    _assert_equal(dedup, _contract_dedup(dest, lid, p, local, mult), DEDUP_OUT)
    n = min(k, p)
    row_map = _row_map(dedup[0], p)
    _assert_equal(reference.ep_row_places(dedup[0], row_map, dedup[1], peers=p, local=local, rows_per_token=n),
                  _contract_places(dedup[0], row_map, dedup[1], p, local, n), PLACES_OUT)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_row_places_with_row_maps_naming_no_row(rng, platform):
    """Entries outside [0, T*k) place nothing (no write out of bounds) and give row T*k;
    the others still land, and rows nobody names keep their fills. Without dedup: n = k."""
    t, k, p, local = 40, 6, 5, 7
    dest, lid = _pairs(rng, t, k, p, local)
    row_map = np.asarray(rng.permutation(t * k), np.int64)
    row_map[::7] = np.resize([-1, t * k, t * k + 5, -(2 ** 31), 2 ** 31 - 1], row_map[::7].size)
    args = _on(platform, dest, jnp.asarray(row_map, jnp.int32), lid.reshape(t * k, 1))
    got = jax.jit(lambda *a: ep_row_places(*a, peers=p, local=local, rows_per_token=k))(*args)
    _assert_equal(got, _contract_places(*(np.asarray(a) for a in args), p, local, k), PLACES_OUT)


def test_vmap_is_the_plan_of_each_batch_entry(rng):
    t, k, p, local, mult = 19, 6, 4, 5, 3
    pairs = [_pairs(rng, t, k, p, local) for _ in range(3)]
    dest, lid = (jnp.stack(a) for a in zip(*pairs))
    dedup = jax.vmap(lambda d, l: ep_dedup_rows(d, l, peers=p, local=local, mult=mult))(dest, lid)
    row_map = jax.vmap(lambda rd: _row_map(rd, p))(dedup[0])
    # An entry naming no row in the batch's second element must stay one.
    row_map = row_map.at[1, 2].set(-3).at[1, 5].set(t * k)
    n = min(k, p)
    places = jax.vmap(lambda *a: ep_row_places(*a, peers=p, local=local, rows_per_token=n))(
        dedup[0], row_map, dedup[1])
    for b in range(3):
        one = ep_dedup_rows(dest[b], lid[b], peers=p, local=local, mult=mult)
        _assert_equal([o[b] for o in dedup], one, DEDUP_OUT)
        _assert_equal([o[b] for o in places],
                      ep_row_places(one[0], row_map[b], one[1], peers=p, local=local, rows_per_token=n), PLACES_OUT)


def test_eager_and_reference_lowering_are_the_kernel(monkeypatch, rng):
    t, k, p, local, mult = 23, 8, 4, 6, 4
    dest, lid = _pairs(rng, t, k, p, local)
    f = lambda d, l: ep_dedup_rows(d, l, peers=p, local=local, mult=mult)  # noqa: E731
    kernel = jax.jit(f)(dest, lid)
    _assert_equal(f(dest, lid), kernel, DEDUP_OUT)
    row_map = _row_map(kernel[0], p)
    g = lambda *a: ep_row_places(*a, peers=p, local=local, rows_per_token=min(k, p))  # noqa: E731
    places = jax.jit(g)(kernel[0], row_map, kernel[1])
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f_ref, g_ref = jax.jit(lambda *a: f(*a)), jax.jit(lambda *a: g(*a))  # fresh jits: read while lowering
    assert "moe_xla_ep_dedup_rows" not in f_ref.lower(dest, lid).as_text()
    _assert_equal(f_ref(dest, lid), kernel, DEDUP_OUT)
    _assert_equal(g_ref(kernel[0], row_map, kernel[1]), places, PLACES_OUT)


def test_each_lowers_to_one_versioned_call():
    platform = "cuda" if ON_GPU else "cpu"
    d = jnp.zeros((8, 4), jnp.int32)
    text = jax.jit(lambda a, b: ep_dedup_rows(a, b, peers=2, local=3, mult=2)).lower(d, d).as_text()
    assert text.count(target_name("ep_dedup_rows", platform)) == 1
    text = jax.jit(lambda a, b, c: ep_row_places(a, b, c, peers=2, local=3, rows_per_token=2)).lower(
        d, d.reshape(-1), jnp.zeros((16, 2), jnp.int32)).as_text()
    assert text.count(f"moe_xla_ep_row_places_{platform}_v1") == 1


D, M = jnp.zeros((6, 4), jnp.int32), jnp.zeros((24,), jnp.int32)


@pytest.mark.parametrize("call, message", [
    (lambda: ep_dedup_rows(D[0], D[0], peers=2, local=3, mult=2),
     r"ep_dedup_rows: expected dest of rank 2 \[T, k\], got shape \(4,\)"),
    (lambda: ep_dedup_rows(D.astype(jnp.uint32), D, peers=2, local=3, mult=2),
     "ep_dedup_rows: expected int32 dest, got uint32"),
    (lambda: ep_dedup_rows(D, D[:5], peers=2, local=3, mult=2),
     r"ep_dedup_rows: expected lid of the shape of dest \(6, 4\), got \(5, 4\)"),
    (lambda: ep_dedup_rows(D, D, peers=0, local=3, mult=2), "ep_dedup_rows: expected an int peers >= 1, got 0"),
    (lambda: ep_dedup_rows(D, D, peers=2, local=3, mult=2.0), "ep_dedup_rows: expected an int mult >= 1, got 2.0"),
    (lambda: ep_row_places(D, M[:23], jnp.zeros((12, 2), jnp.int32), peers=2, local=3, rows_per_token=2),
     r"ep_row_places: expected row_map.shape\[0\] \(T\*k of row_dest \[T, k\]\) = 24, got 23"),
    (lambda: ep_row_places(D, M, jnp.zeros((11, 2), jnp.int32), peers=2, local=3, rows_per_token=2),
     r"ep_row_places: expected lids.shape\[0\] \(T\*n, n = rows_per_token\) = 12, got 11"),
    (lambda: ep_row_places(D, M, jnp.zeros((30, 2), jnp.int32), peers=2, local=3, rows_per_token=5),
     "ep_row_places: expected rows_per_token <= k = 4, got 5"),
    (lambda: ep_row_places(D, M.astype(jnp.float32), jnp.zeros((12, 2), jnp.int32), peers=2, local=3,
                           rows_per_token=2), "ep_row_places: expected int32 row_map, got float32"),
    (lambda: ep_row_places(D, M, jnp.zeros((12, 2), jnp.int32), peers=2, local=-1, rows_per_token=2),
     "ep_row_places: expected an int local >= 0, got -1"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


@pytest.mark.parametrize("op, args, results, attrs, message", [
    ("ep_dedup_rows", [(6, 4), (6, 3)], [(6, 4), (12, 2), (24,), (24,)], dict(peers=2, local=3, mult=2),
     r"lid: expected shape \[6, 4\], got \[6, 3\]"),
    ("ep_dedup_rows", [(6, 4), (6, 4)], [(6, 4), (12, 2), (24,), (24,)], dict(peers=0, local=3, mult=2),
     "peers: expected 1 <= peers"),
    ("ep_dedup_rows", [(6, 4), (6, 4)], [(6, 4), (12, 3), (24,), (24,)], dict(peers=2, local=3, mult=2),
     r"lids: expected shape \[12, 2\], got \[12, 3\]"),
    ("ep_dedup_rows", [(6, 4), (6, 4)], [(6, 4), (12, 2), (24,), (23,)], dict(peers=2, local=3, mult=2),
     r"weight_sources: expected shape \[24\], got \[23\]"),
    ("ep_row_places", [(6, 4), (24,), (12, 2)], [(6, 2), (6, 2), (24,), (24,)], dict(peers=2, local=3,
                                                                                   rows_per_token=5),
     "rows_per_token: expected 0 <= n <= k = 4, got 5"),
    ("ep_row_places", [(6, 4), (20,), (12, 2)], [(6, 2), (6, 2), (24,), (24,)], dict(peers=2, local=3,
                                                                                   rows_per_token=2),
     r"row_map: expected shape \[24\], got \[20\]"),
    ("ep_row_places", [(6, 4), (24,), (12, 2)], [(6, 2), (6, 2), (24,), (23,)], dict(peers=2, local=3,
                                                                                   rows_per_token=2),
     r"pairs: expected shape \[24\], got \[23\]"),
])
def test_handlers_reject_inconsistent_buffers(op, args, results, attrs, message):
    """The FFI handlers check what the primitives' shape rules already guarantee, for
    callers that reach the targets without them."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel(op, "cpu"), [jax.ShapeDtypeStruct(r, jnp.int32) for r in results])
    operands = [jnp.zeros(a, jnp.int32) for a in args]
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(*operands))


def _one_hot_plan(weights, dest, lid, peers, local, mult):
    """The dedup plan as the EP layer computed it before these kernels: ranks by one-hot
    cumulative sums over [T, k, k] (no sort, no kernel), rows placed by permute."""
    t, k = dest.shape
    j = jnp.arange(k)
    same = dest[:, :, None] == dest[:, None, :]
    first = jnp.argmax(same, axis=-1) == j
    rank_there = jnp.cumsum(same, axis=-1, dtype=jnp.int32) - 1
    hits = same[..., None] & (rank_there[..., None] == jnp.arange(mult))
    pick, there = jnp.argmax(hits, axis=2), jnp.any(hits, axis=2)
    lids = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(lid[:, None], (t, k, k)), pick, -1), local)
    w = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(weights[:, None], (t, k, k)), pick, -1), 0.0)
    row_dest = jnp.where(first, dest, peers)
    n = min(k, peers)
    rank = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1
    hit = first[:, :, None] & (rank[:, :, None] == jnp.arange(n))
    cols, sent = jnp.argmax(hit, axis=1), jnp.any(hit, axis=1)
    _, counts, row_map = permute(jnp.zeros((t, 0), jnp.float32), row_dest, peers)
    take = lambda a: jnp.take_along_axis(a, cols.reshape(cols.shape + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
    return dict(dest=jnp.where(sent, take(row_dest), peers), row=jnp.where(sent, take(row_map.reshape(t, k)), t * k),
                lids=take(lids).reshape(t * n, mult), w=take(w).reshape(t * n, mult), counts=counts,
                row_map=row_map, combine=first.astype(jnp.float32))


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "no_dedup"])
def test_rows_by_destination_is_the_one_hot_plan(rng, dedup):
    """The kernels' plan equals the one it replaced, and the weights' gradient reaches each
    pair's weight once (the transpose of the expansion of the weights)."""
    t, k, experts, p = 50, 6, 16, 4
    ids = jnp.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]), jnp.int32)
    dest, lid = ids // (experts // p), ids % (experts // p)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    sizes = exchange_sizes(t, k, experts, p, dedup=dedup, capacity_factor=None, extra_slots=0)
    rows = rows_by_destination(weights, ids, sizes, dedup)
    lids = np.asarray(local_slots(rows.lids, sizes))  # the rows' slots on their ranks
    n = min(k, p) if dedup else k
    sent = np.asarray(rows.dest).reshape(-1) < p
    if dedup:
        # Rows a token does not have held the token's first row's lids and weights before
        # (never sent); now they ask for nothing.
        want = _one_hot_plan(weights, dest, lid, p, sizes.local_experts, sizes.mult)
        for name, value in want.items():
            got, value = lids if name == "lids" else np.asarray(getattr(rows, name)), np.asarray(value)
            if name in ("lids", "w"):
                got, value = got[sent], value[sent]
            np.testing.assert_array_equal(got, value, err_msg=name)
        np.testing.assert_array_equal(np.asarray(rows.lids)[~sent], sizes.peers * sizes.local_experts)
        np.testing.assert_array_equal(lids[~sent], sizes.local_experts)
        np.testing.assert_array_equal(np.asarray(rows.w)[~sent], 0)
        probe = jnp.asarray(rng.standard_normal((t * n, sizes.mult)) * sent[:, None], jnp.float32)
        grad = jax.grad(lambda w: jnp.sum(rows_by_destination(w, ids, sizes, dedup).w * probe))(weights)
        grad_want = jax.grad(lambda w: jnp.sum(_one_hot_plan(w, dest, lid, p, sizes.local_experts,
                                                             sizes.mult)["w"] * probe))(weights)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(grad_want))
    # Every row the rank sends is named once: source inverts row, pairs counts its slots.
    row, source = np.asarray(rows.row).reshape(-1), np.asarray(rows.source)
    assert sorted(row[sent]) == list(range(int(np.sum(rows.counts))))
    np.testing.assert_array_equal(source[row[sent]], np.flatnonzero(sent))
    assert np.all(source[int(np.sum(rows.counts)):] == t * n)
    np.testing.assert_array_equal(np.asarray(rows.pairs)[row[sent]], np.sum(lids < sizes.local_experts, -1)[sent])


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
def test_sharded_inputs_give_the_unsharded_plan(rng):
    """Under jit with token-sharded inputs the ops run whole (their outputs hold global
    indices): the same plan as on one device."""
    t, k, p, local, mult = 32, 8, 4, 5, 4
    dest, lid = _pairs(rng, t, k, p, local)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    f = lambda d, l: ep_dedup_rows(d, l, peers=p, local=local, mult=mult)  # noqa: E731
    want = f(dest, lid)
    _assert_equal(jax.jit(f)(jax.device_put(dest, split), jax.device_put(lid, split)), want, DEDUP_OUT)
    row_map = _row_map(want[0], p)
    g = lambda *a: ep_row_places(*a, peers=p, local=local, rows_per_token=min(k, p))  # noqa: E731
    _assert_equal(jax.jit(g)(*(jax.device_put(a, split) for a in (want[0], row_map, want[1]))),
                  g(want[0], row_map, want[1]), PLACES_OUT)


T_PROP, K_PROP = 12, 6
_IDS = st.one_of(st.integers(-2, 9), st.sampled_from([-(2 ** 31), 2 ** 31 - 1]))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(dest=st.lists(_IDS, min_size=T_PROP * K_PROP, max_size=T_PROP * K_PROP),
       lid=st.lists(_IDS, min_size=T_PROP * K_PROP, max_size=T_PROP * K_PROP),
       peers=st.sampled_from([1, 3, 8]), local=st.sampled_from([0, 4]), mult=st.sampled_from([1, 2, 6]))
def test_any_destinations_and_slots_give_the_contract(dest, lid, peers, local, mult):
    """Any ids (repeated ranks, invalid ones, int32 extremes) on the kernels of the default
    platform against the contract as Python loops, both ops in a row."""
    dest = jnp.asarray(np.reshape(dest, (T_PROP, K_PROP)), jnp.int32)
    lid = jnp.asarray(np.reshape(lid, (T_PROP, K_PROP)), jnp.int32)
    dedup = ep_dedup_rows(dest, lid, peers=peers, local=local, mult=mult)
    _assert_equal(dedup, _contract_dedup(dest, lid, peers, local, mult), DEDUP_OUT)
    n = min(K_PROP, peers)
    row_map = _row_map(dedup[0], peers)
    _assert_equal(ep_row_places(dedup[0], row_map, dedup[1], peers=peers, local=local, rows_per_token=n),
                  _contract_places(dedup[0], row_map, dedup[1], peers, local, n), PLACES_OUT)
