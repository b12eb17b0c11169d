"""Expert parallelism (EP) for moe(): experts split over a mesh axis, tokens sent to them.

Layout. On a mesh with an expert axis of size P (and data axes D), w_in / w_out [E, ...]
are split over the expert axis (rank p holds experts [p E_l, (p+1) E_l), E_l = E / P)
and replicated over D; tokens x [T, H] and router_logits [T, E] are split over
D x expert axis. The layer is one jax.shard_map in which every collective is an
all_to_all (or ragged_all_to_all) over the expert axis: no rank gathers weights or tokens.

Per rank, for each of `chunks` slices of its tokens (independent of each other, so XLA
may run the dispatch of one chunk while the grouped GEMMs of another run):

  route     weights, ids = route(logits)                [T, k]; dest = ids // E_l, lid = ids % E_l
  rows      one row per (token, j) without dedup; with dedup one row per (token,
            destination), sent once however many of the token's experts live there:
              x_rows, counts, row_map = permute(x, row_dest, P)      rows grouped by destination
            each row carries the local experts it asks for, lids [mult] (E_l = none,
            mult = min(k, E_l) with dedup, else 1) and, with dedup, their routing weights
  dispatch  the rows of destination d go to rank d (a transport, in rounds, below)
  experts   on the receiving rank, the (row, local expert) pairs in expert order:
              _, group_sizes, slots = permute(zeros [N, 0], lids, E_l)   (the sort alone)
              x_exp[slots[q, j]] = rows[q];  y_exp = gmm(act(gmm(x_exp, w_in)), w_out)
              back[q] = sum_j w[q, j] y_exp[slots[q, j]]    (dedup: the rank's partial sum)
              back[q] = y_exp[slots[q, 0]]                  (no dedup: the expert output)
  return    back rows travel to their sender, into the places their rows left: y_rows
  combine   y = unpermute(y_rows, row_map, c), accumulated in float32 in j order:
            without dedup c = weights, so y[t] = sum_j weights[t, j] y_{e_j}(x[t]) is the
            single-device sum, bitwise; with dedup c = 1 on the first j of each
            destination, so y[t] adds the per-rank partial sums (equal to f32 rounding).
  shared    the shared expert on the local tokens (no communication), added last as in moe().

Buffers and rounds: static shapes, dropless, no host sync. One peer can send one rank
at most W = T_c min(k, E_l) (token, expert) pairs in at most T_c rows with dedup (W
without); T_c is the chunk's token count. Without capacity_factor the exchange is sized
for that worst case and runs in one round. With capacity_factor f a round carries, per
peer, at most C = f T_c k / P pairs and f times a balanced routing's rows
(exchange_sizes; where neither budget halves the worst case, the one worst-case round
instead); the rows bound for d are cut greedily into rounds, each taking from
where the last stopped as many rows as fit both budgets, and R rounds cover any routing.
Round 0 runs as part of the layer; rounds 1 .. R-1 run in a lax.while_loop that stops at
the first round with no rows on any rank (a psum'd flag), so a step that fits costs one
scalar all-reduce more; under autodiff the same loop re-runs each round under jax.jvp
(forward) or jax.vjp (reverse), so no round's buffers are stacked or kept.

Transports move the same rows between the same places:
  padded  jax.lax.all_to_all of one [rows-per-peer] slab per peer; unused slots are
          zero rows with no expert (lid E_l) that every grouped GEMM skips.
  ragged  jax.lax.ragged_all_to_all: rows [start_d, start_d + size_d) of the grouped
          rows go to slab `rank` of d's receive buffer; the return writes them back at
          the sender's starts (exchanged once per chunk). Where XLA has no
          ragged_all_to_all (XLA:CPU) the same offsets drive an all_to_all stand-in with
          its exact semantics (ragged_all_to_all_by_all_to_all), used for testing.
  "auto": padded. On an H200 XLA's ragged_all_to_all kernel took 17.9 of the 20.6 ms of
  a qwen3 fwd+bwd step (4096 tokens) at EP 1, where it only copies rows to itself.

Autodiff is JAX's, through rules: all_to_all transposes to all_to_all, ragged_all_to_all to
ragged_all_to_all, permute / unpermute / gmm by theirs, and the expansion of rows to pairs
(expand_p) and the sum back (gather_sum_p) to each other, so gradients are deterministic.
Forward mode (jax.jvp, jax.linearize) works too, through capacity rounds included (their
tangent is one linear primitive, see _add_later_rounds). jax.vmap of the layer folds the
batch into rows (expand_p / gather_sum_p have batching rules like the other primitives).
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_xla._rows import expand_rows, gather_sum_rows, row_dots
from moe_xla.moe import _aux, expert_mlp, shared_mlp
from moe_xla.primitives import _ad
from moe_xla.primitives._batching import all_to_front, batched_to_front, folded_rows
from moe_xla.primitives.permute import permute
from moe_xla.primitives.route import route
from moe_xla.primitives.unpermute import unpermute

TRANSPORTS = ("auto", "padded", "ragged")


class ExchangeSizes(NamedTuple):
    """Static per-rank sizes of one chunk's exchange (see the module docstring).

    tokens: T_c, tokens of the chunk; peers: P; local_experts: E_l = E / P.
    mult: local experts one row can ask for: min(k, E_l) with dedup, else 1.
    worst: W = T_c min(k, E_l), most (token, expert) pairs one peer can send one rank.
    capacity: C, pairs per peer per round (W in a one-round exchange).
    rows: rows per peer per round, the slab of the transport (in a one-round exchange T_c
        with dedup, W without).
    pairs: P C, the (row, local expert) pairs per rank per round: the grouped GEMMs' rows.
    rounds: R, enough rounds for any routing.
    """

    tokens: int
    peers: int
    local_experts: int
    mult: int
    worst: int
    capacity: int
    rows: int
    pairs: int
    rounds: int


def exchange_sizes(tokens, top_k, num_experts, peers, *, dedup=True, capacity_factor=None) -> ExchangeSizes:
    """The buffer sizes of one chunk of `tokens` tokens per rank (ExchangeSizes).

    With capacity_factor f the budgets are f times a balanced routing's load: C = f T_c k / P
    pairs and f T_c h rows per peer, h the rows one token sends one peer on average: k / P,
    or with dedup 1 - binom(E - E_l, k) / binom(E, k), the chance that k experts drawn
    uniformly include one of the peer's. With overflow rounds a rank holds two rounds'
    buffers (round 0's and the loop's), so budgets that do not halve the worst case (C >=
    W / 2 and rows >= half the worst-case rows: few ranks) cost memory instead of saving
    it; then the exchange is the worst-case one, in one round. Measured, qwen3-30b-a3b,
    fwd+bwd per rank: EP 2 (W / C = 1.6) 2.19 GiB worst case vs 3.25 with rounds; EP 4
    (W / C = 3.2) 3.80 vs 3.26 (benchmarks/results/LOG.md).
    """
    local = num_experts // peers
    per_rank = min(top_k, local)
    worst = tokens * per_rank
    mult, row_worst = (per_rank, tokens) if dedup else (1, worst)
    one_round = ExchangeSizes(tokens, peers, local, mult, worst, worst, row_worst, peers * worst, 1)
    if capacity_factor is None:
        return one_round
    hit = 1 - math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k) if dedup else top_k / peers
    capacity = min(worst, max(mult, math.ceil(capacity_factor * tokens * top_k / peers)))
    rows = min(row_worst, capacity, max(1, math.ceil(capacity_factor * tokens * hit)))
    if 2 * capacity >= worst and 2 * rows >= row_worst:
        return one_round
    if mult == 1:  # a row is a pair: every round but the last holds `rows` (<= C) of them
        rounds = -(-worst // rows)
    else:  # every round but the last holds `rows` rows or more than C - mult pairs
        rounds = tokens // rows + worst // (capacity - mult + 1) + 1
    return ExchangeSizes(tokens, peers, local, mult, worst, capacity, rows, peers * capacity, rounds)


class _Config(NamedTuple):
    axis: str               # the expert axis: every collective runs over it
    token_axes: tuple       # the axes tokens are split over (data axes, then the expert axis)
    peers: int
    experts: int
    top_k: int
    activation: str
    routing: dict           # route() options other than bias
    transport: str          # "padded" or "ragged"
    native_ragged: bool     # the platform has ragged_all_to_all (else the all_to_all stand-in)
    dedup: bool
    capacity_factor: float | None
    chunks: int


def moe_ep(x, router_logits, w_in, w_out, *, dims, top_k, activation, routing, bias, shared_experts, return_aux,
           mesh, expert_axis, data_axes, transport, dedup, capacity_factor, chunks):
    """moe() with its experts split over `expert_axis` of `mesh`. Arguments are moe()'s,
    already checked by it; dims = (tokens, hidden, experts) as moe() derived them; routing
    holds route()'s options other than bias."""
    mesh = _mesh(mesh, expert_axis)
    names = tuple(mesh.axis_names)
    if expert_axis not in names:
        raise ValueError(f"moe: expected expert_axis to be one of the mesh axes {names}, got {expert_axis!r}")
    if data_axes is None:
        data_axes = tuple(a for a in names if a != expert_axis)
    else:
        data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if expert_axis in data_axes or any(a not in names for a in data_axes) or len(set(data_axes)) < len(data_axes):
        raise ValueError(f"moe: expected distinct data_axes among the mesh axes {names} other than the expert "
                         f"axis {expert_axis!r}, got {data_axes}")
    if transport not in TRANSPORTS:
        raise ValueError(f"moe: expected transport in {TRANSPORTS}, got {transport!r}")
    if capacity_factor is not None and not 0 < capacity_factor < math.inf:
        raise ValueError(f"moe: expected a finite capacity_factor > 0 or None, got {capacity_factor!r}")
    if not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ValueError(f"moe: expected a positive int chunks, got {chunks!r}")
    tokens, hidden, experts = dims
    peers = mesh.shape[expert_axis]
    if experts % peers:
        raise ValueError(f"moe: expected the {experts} experts (w_in.shape[0]) to split evenly over expert_axis "
                         f"{expert_axis!r} of size {peers}")
    token_axes = data_axes + (expert_axis,)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if tokens % shards:
        raise ValueError(f"moe: expected the {tokens} tokens of x to split evenly over the axes {token_axes} "
                         f"({shards} devices)")
    platform = mesh.devices.flat[0].platform if isinstance(mesh, Mesh) else mesh.abstract_device.platform
    if transport == "auto":  # see the module docstring
        transport = "padded"
    cfg = _Config(expert_axis, token_axes, peers, experts, top_k, activation, routing, transport, platform != "cpu",
                  bool(dedup), capacity_factor, max(1, min(int(chunks), tokens // shards)))

    tok, rep = P(token_axes), P()
    specs = (tok, tok, P(expert_axis), P(expert_axis), rep, rep)
    # Explicit axes (jax.make_mesh's default) need every reshard spelled out, the token
    # flattening of x [..., H] included; shard_map reshards arguments on Auto axes itself.
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    tokens_sharding = NamedSharding(mesh, tok) if explicit else None
    logits = jnp.reshape(router_logits, (tokens, experts), out_sharding=tokens_sharding)
    inputs = (jnp.reshape(x, (tokens, hidden), out_sharding=tokens_sharding), logits, w_in, w_out, bias,
              shared_experts)
    if explicit:
        inputs = jax.reshard(inputs, tuple(NamedSharding(mesh, s) for s in specs))
    layer = jax.shard_map(partial(_layer, cfg), mesh=mesh, in_specs=specs, out_specs=(tok, rep, rep),
                          check_vma=False)
    y, tokens_per_expert, dispatched = layer(*inputs)
    if x.ndim > 2:
        y = jnp.reshape(y, x.shape, out_sharding=NamedSharding(mesh, jax.typeof(x).sharding.spec) if explicit else None)
    if not return_aux:
        return y
    with jax.named_scope("moe_xla/aux"):
        aux = _aux(logits, tokens_per_expert, routing["score"], top_k)
    return y, aux._replace(dispatched_rows=dispatched)


def _mesh(mesh, expert_axis):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(f"moe: expert_axis={expert_axis!r} needs a mesh: pass mesh= or call under "
                             f"jax.set_mesh(mesh)")
    if expert_axis is None:
        raise ValueError("moe: a mesh needs expert_axis, the mesh axis the experts are split over")
    return mesh


def _layer(cfg, x, logits, w_in, w_out, bias, shared):
    """One rank's tokens: route, then every chunk through dispatch / experts / combine."""
    with jax.named_scope("moe_xla/route"):
        weights, ids = route(logits, cfg.top_k, bias=bias, **cfg.routing)
    size, extra = divmod(x.shape[0], cfg.chunks)
    bounds = [c * size + min(c, extra) for c in range(cfg.chunks + 1)]
    outs = [_chunk(cfg, x[a:b], weights[a:b], ids[a:b], w_in, w_out) for a, b in zip(bounds, bounds[1:])]
    y = jnp.concatenate([o[0] for o in outs])
    if shared is not None:
        y = y + shared_mlp(x, shared, cfg.activation)
    tokens_per_expert = jnp.zeros((cfg.experts,), jnp.int32).at[ids.reshape(-1)].add(1)
    dispatched = sum(o[1] for o in outs)
    return y, jax.lax.psum(tokens_per_expert, cfg.token_axes), jax.lax.psum(dispatched, cfg.token_axes)


class _Rows(NamedTuple):
    """The rows one rank sends, grouped by destination rank."""

    x: jax.Array        # [T*k, H] permute(x, row_dest, P): the rows of destination d, then d + 1, ...
    lids: jax.Array     # [T*k, mult] int32 the local experts each row asks for; E_l: none
    w: jax.Array | None  # [T*k, mult] float32 their routing weights (dedup), else None
    pairs: jax.Array    # [T*k] int32 number of lids < E_l per row
    counts: jax.Array   # [P] int32 rows per destination
    row_map: jax.Array  # [T*k] int32 (token, j) -> row (permute's)
    combine: jax.Array  # [T, k] float32 weights of the final unpermute


def _rows_by_destination(x, weights, ids, sizes: ExchangeSizes, dedup: bool) -> _Rows:
    t, k = ids.shape
    local, mult = sizes.local_experts, sizes.mult
    dest, lid = ids // local, ids % local
    if dedup:
        j = jnp.arange(k)
        same = dest[:, :, None] == dest[:, None, :]                          # [T, k, k]
        first = jnp.argmax(same, axis=-1) == j                               # j is its destination's first
        pick = jnp.argsort(jnp.where(same, j, k + j), axis=-1)[..., :mult]   # that destination's j, in order
        there = jnp.take_along_axis(same, pick, axis=-1)
        lids = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(lid[:, None], (t, k, k)), pick, -1), local)
        w = jnp.where(there, jnp.take_along_axis(jnp.broadcast_to(weights[:, None], (t, k, k)), pick, -1), 0.0)
        row_dest, combine = jnp.where(first, dest, sizes.peers), first.astype(jnp.float32)
    else:
        lids, w, row_dest, combine = lid[..., None], None, dest, weights
    x_rows, counts, row_map = permute(x, row_dest, sizes.peers)

    def grouped(a):  # a [T, k, ...] per (token, j) -> the rows' order
        flat = a.reshape((t * k,) + a.shape[2:])
        return jnp.zeros_like(flat).at[row_map].set(flat, unique_indices=True)

    lids = grouped(lids)
    return _Rows(x_rows, lids, None if w is None else grouped(w), jnp.sum(lids < local, axis=-1, dtype=jnp.int32),
                 counts, row_map, combine)


def _round_starts(counts, pairs, sizes: ExchangeSizes):
    """[R+1, P] int32: round r sends the grouped rows [starts[r, d], starts[r+1, d]) to d,
    as many rows from where round r - 1 stopped as fit `rows` rows and `capacity` pairs."""
    ends = jnp.cumsum(counts, dtype=jnp.int32)
    offsets = ends - counts
    before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(pairs, dtype=jnp.int32)])  # pairs before row i

    def next_start(start, _):
        fits = jnp.searchsorted(before, before[start] + sizes.capacity, side="right").astype(jnp.int32) - 1
        stop = jnp.minimum(jnp.minimum(start + sizes.rows, fits), ends)
        return stop, stop

    _, stops = jax.lax.scan(next_start, offsets, None, length=sizes.rounds)
    return jnp.concatenate([offsets[None], stops])


def _chunk(cfg: _Config, x, weights, ids, w_in, w_out):
    """One chunk of one rank's tokens: -> (y [T_c, H], rows dispatched)."""
    sizes = exchange_sizes(x.shape[0], cfg.top_k, cfg.experts, cfg.peers, dedup=cfg.dedup,
                           capacity_factor=cfg.capacity_factor)
    with jax.named_scope("moe_xla/dispatch"):
        rows = _rows_by_destination(x, weights, ids, sizes, cfg.dedup)
        starts = _round_starts(rows.counts, rows.pairs, sizes)
        arrays = _link_arrays(cfg, starts)
    floats, ints = (rows.x, rows.w, w_in, w_out), (rows.lids, arrays)
    y_rows = _round(cfg, sizes, 0, floats, ints)
    if sizes.rounds > 1:
        y_rows = _add_later_rounds(partial(_round, cfg, sizes), y_rows, floats, ints, sizes.rounds, cfg.axis)
    with jax.named_scope("moe_xla/combine"):
        y = unpermute(y_rows, rows.row_map, rows.combine)
    return y, jnp.sum(rows.counts)


def _round(cfg: _Config, sizes: ExchangeSizes, r, floats, ints):
    """Round r of a chunk: its rows to their ranks, through the experts, and back into
    their grouped places ([T*k, H], zero at the rows of other rounds)."""
    x_rows, w_rows, w_in, w_out = floats
    lids, arrays = ints
    link = _link(cfg, sizes.rows, *arrays)
    with jax.named_scope("moe_xla/dispatch"):
        x_recv = link.send(x_rows, 0, r)
        lids = link.send(lids, sizes.local_experts, r)
        w = None if w_rows is None else link.send(w_rows, 0, r)
    y = _experts(x_recv, lids, w, w_in, w_out, sizes, cfg.activation)
    with jax.named_scope("moe_xla/combine"):
        return link.back(y, r, x_rows.shape[0])


def _add_later_rounds(round_fn, first, floats, ints, rounds: int, axis):
    """first + sum_{r = 1 .. R-1} round_fn(r, floats, ints), in a lax.while_loop that stops
    at the first round with no rows on any rank of `axis` (rounds fill in order).

    A while_loop has no reverse-mode rule, and scanning all R rounds would keep every
    round's buffers, so the rounds are a custom_jvp whose tangent, sum_r J_r d_floats
    (J_r the Jacobian of round r in floats), is the linear primitive rounds_tangent_p:
    forward mode runs the loop over jax.jvp of each round, reverse mode transposes the
    primitive into the same loop over jax.vjp of each round (recomputed: nothing stacked).
    """
    spec = _RoundsSpec(round_fn, rounds, axis, jax.tree.structure(floats), jax.tree.structure(ints),
                       jax.core.ShapedArray(first.shape, first.dtype))

    @jax.custom_jvp
    def add_later(first, floats, ints):
        return _rounds_loop(spec, ints, lambda r, acc: acc + round_fn(r, floats, ints), first)

    @add_later.defjvp
    def add_later_jvp(primals, tangents):  # tangents arrive instantiated (no symbolic zeros)
        first, floats, ints = primals
        d_first, d_floats, _ = tangents
        args = jax.tree.leaves(floats) + jax.tree.leaves(ints) + jax.tree.leaves(d_floats)
        return add_later(first, floats, ints), d_first + rounds_tangent_p.bind(*args, spec=spec, levels=())

    return add_later(first, floats, ints)


class _RoundsSpec(NamedTuple):
    """Static description of a chunk's rounds 1 .. R-1 (a hashable primitive parameter)."""

    round_fn: object          # (r, floats, ints) -> [T*k, H]
    rounds: int
    axis: str
    floats_tree: object       # pytree structures of floats and ints
    ints_tree: object
    out: jax.core.ShapedArray  # one round's result


def _rounds_loop(spec: _RoundsSpec, ints, body, init):
    """body(r, acc) over r = 1, 2, ... while r < R and some rank of the axis has rows in round r."""
    starts = ints[1][0]

    def more(carry):
        r = carry[0]
        return (r < spec.rounds) & (jax.lax.psum(jnp.sum(starts[r + 1] - starts[r]), spec.axis) > 0)

    return jax.lax.while_loop(more, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(1), init))[1]


def _split_rounds_args(spec: _RoundsSpec, args):
    n_f, n_i = spec.floats_tree.num_leaves, spec.ints_tree.num_leaves
    floats = jax.tree.unflatten(spec.floats_tree, args[:n_f])
    ints = jax.tree.unflatten(spec.ints_tree, args[n_f:n_f + n_i])
    return floats, ints, args[n_f + n_i:]


# rounds_tangent_p under vmap: `levels`, outermost first, holds one (size, in_axes) per
# vmap around it, in_axes[i] = 0 where argument i carries that level's batch axis (the
# leading one of those it carries), None where it does not: unbatched arguments (the
# expert weights, in vmap(linearize)) are not broadcast to the batch.

def _vmapped(fn, levels, lead=()):
    """fn vmapped over `levels`; `lead` are the in_axes of extra leading arguments."""
    for _, in_axes in reversed(levels):
        fn = jax.vmap(fn, in_axes=tuple(lead) + tuple(in_axes))
    return fn


def _rounds_tangent_impl(*args, spec: _RoundsSpec, levels):
    def one(*a):
        floats, ints, d_leaves = _split_rounds_args(spec, a)
        d_floats = jax.tree.unflatten(spec.floats_tree, d_leaves)

        def body(r, acc):
            return acc + jax.jvp(lambda f: spec.round_fn(r, f, ints), (floats,), (d_floats,))[1]

        return _rounds_loop(spec, ints, body, jnp.zeros(spec.out.shape, spec.out.dtype))

    return _vmapped(one, levels)(*args)


def _rounds_tangent_transpose(ct, *args, spec: _RoundsSpec, levels):
    n_known = spec.floats_tree.num_leaves + spec.ints_tree.num_leaves
    known = args[:n_known]
    if any(ad.is_undefined_primal(a) for a in known):
        raise ValueError("moe: the capacity rounds are linear in the tangents of their floats only")
    d_avals = [a.aval for a in args[n_known:]]
    if type(ct) is ad.Zero:
        return [None] * n_known + [ad.Zero(a) for a in d_avals]

    def one(ct, *a):
        floats, ints, _ = _split_rounds_args(spec, a)

        def body(r, acc):
            pull = jax.vjp(lambda f: spec.round_fn(r, f, ints), floats)[1]
            return jax.tree.map(jnp.add, acc, pull(ct)[0])

        return jax.tree.leaves(_rounds_loop(spec, ints, body, jax.tree.map(jnp.zeros_like, floats)))

    known_levels = tuple((size, in_axes[:n_known]) for size, in_axes in levels)
    d_floats = _vmapped(one, known_levels, lead=(0,))(ct, *known)  # batched at every level
    # A tangent a level does not batch gets the sum of its cotangent over that level.
    return [None] * n_known + [
        jnp.sum(d, axis=tuple(i for i, (_, in_axes) in enumerate(levels) if in_axes[n_known + j] is None))
        for j, d in enumerate(d_floats)]


def _rounds_tangent_batch(args, dims, *, spec: _RoundsSpec, levels):
    args, size = batched_to_front(args, dims)
    in_axes = tuple(None if d is None else 0 for d in dims)
    return rounds_tangent_p.bind(*args, spec=spec, levels=((size, in_axes),) + levels), 0


rounds_tangent_p = Primitive("moe_xla_ep_rounds_tangent")
rounds_tangent_p.def_impl(_rounds_tangent_impl)
rounds_tangent_p.def_abstract_eval(lambda *args, spec, levels: jax.core.ShapedArray(
    tuple(size for size, _ in levels) + spec.out.shape, spec.out.dtype))
ad.primitive_transposes[rounds_tangent_p] = _rounds_tangent_transpose
batching.primitive_batchers[rounds_tangent_p] = _rounds_tangent_batch
mlir.register_lowering(rounds_tangent_p, mlir.lower_fun(_rounds_tangent_impl, multiple_results=False))


def _experts(x_recv, lids, w, w_in, w_out, sizes: ExchangeSizes, activation):
    """The receiving rank: rows [N, H] asking for lids [N, mult] -> back rows [N, H]."""
    n = lids.shape[0]
    with jax.named_scope("moe_xla/dispatch"):
        _, group_sizes, slots = permute(jnp.zeros((n, 0), x_recv.dtype), lids, sizes.local_experts)
        slots = slots.reshape(lids.shape)
        ones = jnp.ones(lids.shape, jnp.float32)
        x_exp = expand_p.bind(x_recv, slots, ones, num_pairs=sizes.pairs)
    y_exp = expert_mlp(x_exp, w_in, w_out, group_sizes, activation)
    with jax.named_scope("moe_xla/combine"):
        return gather_sum_p.bind(y_exp, slots, ones if w is None else w)


# The expansion of the received rows to their (row, local expert) pairs and the weighted
# sum back are two primitives over _rows.expand_rows / gather_sum_rows (bilinear, each
# other's transpose); they lower through jnp on every platform.

expand_p = Primitive("moe_xla_ep_expand")
gather_sum_p = Primitive("moe_xla_ep_gather_sum")
expand_p.def_abstract_eval(lambda rows, slots, weights, *, num_pairs: jax.core.ShapedArray(
    (num_pairs, rows.shape[1]), rows.dtype))
gather_sum_p.def_abstract_eval(lambda values, slots, weights: jax.core.ShapedArray(
    (slots.shape[0], values.shape[1]), values.dtype))


def _bilinear_rules(prim, data_transpose, weights_transpose):
    """JVP and transpose of prim(data, slots, weights), linear in data and in weights."""

    def transpose(ct, data, slots, weights, **params):
        if ad.is_undefined_primal(data):
            d = ad.Zero(data.aval) if type(ct) is ad.Zero else data_transpose(ct, slots, weights, data.aval)
            return d, None, None
        d = ad.Zero(weights.aval) if type(ct) is ad.Zero else weights_transpose(ct, data, slots)
        return None, None, d

    ad.primitive_jvps[prim] = _ad.bilinear_jvp(prim, 0, 2)
    ad.primitive_transposes[prim] = transpose


def _folded_slots(slots, per_batch: int):
    """[B, N, mult] slots into B blocks of per_batch rows -> [B N, mult] slots into the stack."""
    return folded_rows(slots, per_batch).reshape(slots.shape[0] * slots.shape[1], slots.shape[2])


def _expand_batch(args, dims, *, num_pairs):
    (rows, slots, weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], rows.shape[-1]
    out = expand_p.bind(rows.reshape(size * n, h), _folded_slots(slots, num_pairs),
                        weights.reshape(size * n, weights.shape[-1]), num_pairs=size * num_pairs)
    return out.reshape(size, num_pairs, h), 0


def _gather_sum_batch(args, dims):
    (values, slots, weights), size = all_to_front(args, dims)
    n, h = slots.shape[1], values.shape[-1]
    out = gather_sum_p.bind(values.reshape(size * values.shape[1], h), _folded_slots(slots, values.shape[1]),
                            weights.reshape(size * n, weights.shape[-1]))
    return out.reshape(size, n, h), 0


batching.primitive_batchers[expand_p] = _expand_batch
batching.primitive_batchers[gather_sum_p] = _gather_sum_batch
for _prim, _impl in ((expand_p, expand_rows), (gather_sum_p, gather_sum_rows)):
    _prim.def_impl(_impl)
    mlir.register_lowering(_prim, mlir.lower_fun(_impl, multiple_results=False))
_bilinear_rules(expand_p, lambda ct, slots, w, aval: gather_sum_p.bind(ct, slots, w),
                lambda ct, rows, slots: row_dots(rows, ct, slots))
_bilinear_rules(gather_sum_p, lambda ct, slots, w, aval: expand_p.bind(ct, slots, w, num_pairs=aval.shape[0]),
                lambda ct, values, slots: row_dots(ct, values, slots))


def _slabs(rows, starts, sizes, block: int, fill):
    """[P*block, ...]: slab d holds rows [starts[d], starts[d] + sizes[d]), then `fill`."""
    pos = jnp.arange(block, dtype=jnp.int32)
    idx = jnp.clip(starts[:, None] + pos, 0, rows.shape[0] - 1).reshape(-1)
    valid = (pos < sizes[:, None]).reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(valid, rows[idx], jnp.asarray(fill, rows.dtype))


def _unslab(out, slabs, starts, sizes, block: int):
    """out with rows [starts[d], starts[d] + sizes[d]) replaced by the head of slab d."""
    pos = jnp.arange(block, dtype=jnp.int32)
    peers = starts.shape[0]
    beyond = out.shape[0] + jnp.arange(peers * block, dtype=jnp.int32).reshape(peers, block)  # distinct, dropped
    idx = jnp.where(pos < sizes[:, None], starts[:, None] + pos, beyond).reshape(-1)
    return out.at[idx].set(slabs, mode="drop", unique_indices=True)


def ragged_all_to_all_by_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                    axis_name, block):
    """jax.lax.ragged_all_to_all (one slice per peer, send sizes <= block) from all_to_all:
    slice d of operand travels in a [block] slab to peer d, which writes its head into
    output at the offset output_offsets[d] the sender chose. For XLA:CPU, which has no
    ragged-all-to-all, and as the ragged transport's test double."""
    slabs = jax.lax.all_to_all(_slabs(operand, input_offsets, send_sizes, block, 0), axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    return _unslab(output, slabs, at, recv_sizes, block)


def _link_arrays(cfg: _Config, starts):
    """What a chunk's link is built from (_link(cfg, block, *arrays)): its starts [R+1, P],
    and for the ragged transport the starts of every peer for this rank [P, R+1] (else None)."""
    if cfg.transport == "padded":
        return starts, None
    return starts, jax.lax.all_to_all(starts.T, cfg.axis, 0, 0, tiled=True)


def _link(cfg: _Config, block: int, starts, theirs):
    """The chunk's transport (theirs: the ragged transport's peer starts, _link_arrays)."""
    if cfg.transport == "padded":
        return _Padded(cfg.axis, block, starts)
    return _Ragged(cfg.axis, block, starts, cfg.native_ragged, theirs)


class _Link:
    """A chunk's transport over `axis`: round r sends the grouped rows [starts[r, d],
    starts[r+1, d]) to rank d, into a [block] slab of its receive buffer [P*block, ...].

    send(rows, fill, r): round r of the grouped rows [T*k, ...] -> the receive buffer
        (slab s from rank s; unused slots hold `fill`).
    back(y, r, num_rows): results [P*block, H] of round r -> [num_rows, H], each at the
        place its row left on its sender, 0 elsewhere.
    """

    def __init__(self, axis, block, starts):
        self.axis, self.block, self.starts = axis, block, starts

    def _sent(self, r):
        return self.starts[r], self.starts[r + 1] - self.starts[r]


class _Padded(_Link):
    """all_to_all of one [block] slab per peer and round."""

    def send(self, rows, fill, r):
        return jax.lax.all_to_all(_slabs(rows, *self._sent(r), self.block, fill), self.axis, 0, 0, tiled=True)

    def back(self, y, r, num_rows):
        slabs = jax.lax.all_to_all(y, self.axis, 0, 0, tiled=True)
        return _unslab(jnp.zeros((num_rows,) + y.shape[1:], y.dtype), slabs, *self._sent(r), self.block)


class _Ragged(_Link):
    """ragged_all_to_all: only the rows of the round travel."""

    def __init__(self, axis, block, starts, native: bool, theirs):
        super().__init__(axis, block, starts)
        peers = starts.shape[1]
        self.collective = partial(jax.lax.ragged_all_to_all, axis_name=axis) if native else \
            partial(ragged_all_to_all_by_all_to_all, axis_name=axis, block=block)
        self.theirs = theirs  # [P, R+1]: peer s's starts for this rank
        self.mine = jnp.full((peers,), jax.lax.axis_index(axis) * block, jnp.int32)  # my slab on every peer
        self.slabs = jnp.arange(peers, dtype=jnp.int32) * block

    def _received(self, r):
        return self.theirs[:, r + 1] - self.theirs[:, r]

    def send(self, rows, fill, r):
        out = jnp.full((self.slabs.shape[0] * self.block,) + rows.shape[1:], fill, rows.dtype)
        return self.collective(rows, out, *self._sent(r), self.mine, self._received(r))

    def back(self, y, r, num_rows):
        out = jnp.zeros((num_rows,) + y.shape[1:], y.dtype)
        return self.collective(y, out, self.slabs, self._received(r), self.theirs[:, r], self._sent(r)[1])
