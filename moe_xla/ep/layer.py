"""The EP layer: moe() with its experts split over a mesh axis (see the package docstring)."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla.first_product as first_product
from moe_xla._rows import pair_sources
from moe_xla.aux_losses import router_aux
from moe_xla.ep.config import EpConfig, ep_config
from moe_xla.ep.fp8_dispatch import quantized_tokens, sent_tokens
from moe_xla.ep.placement import expert_slots
from moe_xla.ep.replicas import with_replicas
from moe_xla.ep.rounds import RoundFloats, RoundInts, add_later_rounds, round_starts
from moe_xla.ep.rows import local_slots, rows_by_destination
from moe_xla.ep.sizing import ExchangeSizes, exchange_sizes
from moe_xla.ep.transports import link, link_arrays, pack
from moe_xla.experts import expert_mlp, shared_mlp
from moe_xla.grouped import is_fp8
from moe_xla.primitives.permute import permute
from moe_xla.primitives.route import route
from moe_xla.primitives.unpermute import unpermute


def moe_ep(x, router_logits, w_in, w_out, *, dims, top_k, activation, routing, bias, shared_experts, return_aux,
           mesh, expert_axis, data_axes, transport, dedup, capacity_factor, chunks, quantization=None,
           redundant_experts=None):
    """moe() with its experts split over `expert_axis` of `mesh`. Arguments are moe()'s,
    already checked by it; dims = (tokens, hidden, experts) as moe() derived them; routing
    holds route()'s options other than bias; redundant_experts a placement (placement.py) or None."""
    mesh, cfg = ep_config(mesh, dims=dims, top_k=top_k, activation=activation, routing=routing,
                          expert_axis=expert_axis, data_axes=data_axes, transport=transport, dedup=dedup,
                          capacity_factor=capacity_factor, chunks=chunks, quantization=quantization,
                          redundant_experts=redundant_experts)
    tokens, hidden, experts = dims
    tok, rep = P(cfg.token_axes), P()
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
        aux = router_aux(logits, tokens_per_expert, routing["score"], top_k)
    return y, aux._replace(dispatched_rows=dispatched)


def _layer(cfg: EpConfig, x, logits, w_in, w_out, bias, shared):
    """One rank's tokens: route, then every chunk through dispatch / experts / combine."""
    with jax.named_scope("moe_xla/route"):
        weights, ids = route(logits, cfg.top_k, bias=bias, **cfg.routing)
    with jax.named_scope("moe_xla/dispatch"):
        slot = expert_slots(ids, cfg.placement, cfg.experts)
        w_in, w_out = (with_replicas(w, cfg.placement, cfg.axis) for w in (w_in, w_out))
    size, extra = divmod(x.shape[0], cfg.chunks)
    bounds = [c * size + min(c, extra) for c in range(cfg.chunks + 1)]
    outs = [_chunk(cfg, x[a:b], weights[a:b], slot[a:b], w_in, w_out) for a, b in zip(bounds, bounds[1:])]
    y = jnp.concatenate([o.y for o in outs])
    if shared is not None:
        y = y + shared_mlp(x, shared, cfg.activation)
    tokens_per_expert = jnp.zeros((cfg.experts,), jnp.int32).at[ids.reshape(-1)].add(1)
    dispatched = sum(o.dispatched for o in outs)
    return y, jax.lax.psum(tokens_per_expert, cfg.token_axes), jax.lax.psum(dispatched, cfg.token_axes)


class _ChunkOut(NamedTuple):
    y: jax.Array            # [T_c, H] the chunk's outputs
    dispatched: jax.Array   # int32 rows the chunk sent over the expert axis


def _chunk(cfg: EpConfig, x, weights, slot, w_in, w_out) -> _ChunkOut:
    """One chunk of one rank's tokens, pair (t, j) served by slot[t, j] (placement.expert_slots)."""
    sizes = exchange_sizes(x.shape[0], cfg.top_k, cfg.experts, cfg.peers, dedup=cfg.dedup,
                           capacity_factor=cfg.capacity_factor, extra_slots=len(cfg.placement[0]))
    with jax.named_scope("moe_xla/dispatch"):
        rows = rows_by_destination(weights, slot, sizes, cfg.dedup)
        starts = round_starts(rows.counts, rows.pairs, sizes)
        arrays = link_arrays(cfg, starts)
    floats = RoundFloats(x, rows.w, w_in, w_out)
    x_fp8 = quantized_tokens(x) if is_fp8(cfg.quantization) else None
    ints = RoundInts(rows.lids, rows.dest, rows.row, rows.source, arrays, x_fp8)
    if sizes.rounds == 1 and cfg.dedup:
        # Every row has combine weight 1: y[t] is the sum of the token's rows (the
        # destinations' partial sums) in j order straight from the returned slabs. The
        # slots of rows a token does not have lie past the slabs and add nothing; sources
        # names none of them, so the transpose sends them nothing either.
        back, slots, sources = _round(cfg, sizes, 0, floats, ints)
        with jax.named_scope("moe_xla/combine"):
            y = unpermute(back, slots.reshape(-1), top_k=slots.shape[1], row_pairs=sources)
        return _ChunkOut(y, jnp.sum(rows.counts))
    round_rows = partial(_round_rows, cfg, sizes)
    y_rows = round_rows(0, floats, ints)
    if sizes.rounds > 1:
        y_rows = add_later_rounds(round_rows, y_rows, floats, ints, sizes.rounds)
    with jax.named_scope("moe_xla/combine"):
        y = unpermute(y_rows, rows.row_map, rows.combine, row_pairs=rows.row_pairs)  # permute's
    return _ChunkOut(y, jnp.sum(rows.counts))


def _round(cfg: EpConfig, sizes: ExchangeSizes, r, floats: RoundFloats, ints: RoundInts):
    """Round r of a chunk: its rows to their ranks and through the experts, and their
    results back -> (back [P*block, H] in the send buffer's layout, slots [T, n] where
    row (t, c) sits in it, sources [P*block], slots' inverse: the t * n + c at each place,
    outside [0, T*n) where none)."""
    chunk_link = link(cfg, sizes.rows, ints.link)
    with jax.named_scope("moe_xla/dispatch"):
        slots = chunk_link.slots(ints.dest, ints.row, r)
        row_slots, num_rows = slots.reshape(slots.size, 1), sizes.peers * sizes.rows
        # What sits at each place of the send buffer: row (t, c) flattened, or past the
        # rows (-1, or T*n for a grouped row no pair sends); its token t = (t, c) // n, -1
        # for none: pair_sources, as the combine's transpose computes it from the same
        # sources (unpermute with row_pairs=sources), so XLA computes the array once.
        sources = chunk_link.sources(ints.source, r)
        tokens = pair_sources(sources, slots.shape)[0]
        # The token rows' path, every array it reads in `arrays` (fp8_dispatch.sent_tokens).
        send = lambda rows, arrays: link(cfg, sizes.rows, arrays[2]).send(  # noqa: E731
            pack(rows, arrays[0], num_rows, sources=arrays[1]), 0, r)
        arrays = (slots, tokens, ints.link)
        if ints.x_fp8 is None:
            x_recv, x_fp8 = send(floats.x, arrays), None
        else:
            x_recv, *x_fp8 = sent_tokens(send, arrays, floats.x, *ints.x_fp8)
        numbered = pack(ints.lids, row_slots, num_rows, sizes.peers * sizes.local_experts, sources)
        lids = chunk_link.send(local_slots(numbered, sizes), sizes.local_experts, r)
        w = None if floats.w is None else chunk_link.send(pack(floats.w, row_slots, num_rows, sources=sources), 0, r)
    y = _experts(x_recv, x_fp8, lids, w, floats.w_in, floats.w_out, sizes, cfg.activation, cfg.quantization)
    with jax.named_scope("moe_xla/combine"):
        return chunk_link.back(y, r), slots, sources


def _round_rows(cfg: EpConfig, sizes: ExchangeSizes, r, floats: RoundFloats, ints: RoundInts):
    """Round r's results in the rows' grouped places ([T*k, H], zero at the rows of other rounds)."""
    back, slots, sources = _round(cfg, sizes, r, floats, ints)
    with jax.named_scope("moe_xla/combine"):
        none = jnp.full((1,), back.shape[0], jnp.int32)  # ints.source's T*n: a row no one sends
        row_slots = jnp.concatenate([slots.reshape(slots.size), none])[ints.source]
        # row_slots' inverse: the grouped row of the (t, c) at each place (ints.row), by a gather.
        sent = (sources >= 0) & (sources < slots.size)
        row_pairs = jnp.where(sent, ints.row.reshape(-1)[jnp.where(sent, sources, 0)], -1)
        return unpermute(back, row_slots, top_k=1, row_pairs=row_pairs)


def _experts(x_recv, x_fp8, lids, w, w_in, w_out, sizes: ExchangeSizes, activation, quantization):
    """The receiving rank: rows [N, H] asking for lids [N, mult] -> back rows [N, H]. x_fp8:
    their FP8 rows (q as uint8 bits, scales) where they travelled (fp8_dispatch), or None."""
    n = lids.shape[0]
    with jax.named_scope("moe_xla/dispatch"):
        _, group_sizes, row_map, row_pairs = permute(jnp.zeros((n, 0), x_recv.dtype), lids, sizes.local_experts,
                                                     return_row_pairs=True)
        slots = row_map.reshape(lids.shape)
        # The grouped GEMMs' sizes.pairs rows: permute's n * mult cut there, or padded with rows
        # no pair holds (where the row budget rounds below the pair budget: rows * mult < C).
        row_pairs = jnp.pad(row_pairs[:sizes.pairs], (0, max(0, sizes.pairs - row_pairs.size)), constant_values=-1)
        # The grouped rows, left in x_recv where moe() would leave them in its tokens
        # (first_product.choose), else copied.
        rows = first_product.GatheredRows(x_recv, pair_sources(row_pairs, lids.shape)[0], slots)
        gathers = not is_fp8(quantization) and first_product.choose(x_recv, w_in, lids.shape[1]) == "gather"
        x_sorted = rows if gathers else rows.copy()
        x_quantized = None
        if x_fp8 is not None:
            q, scales = (pack(a, slots, sizes.pairs, sources=rows.src) for a in x_fp8)
            x_quantized = (jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn), scales)
    # back[q] = sum_j w[q, j] y_exp[slots[q, j]]: unpermute over the pair rows, which
    # expert_mlp's combine fuses with the second product (its backward needs neither y_exp
    # nor a weighted cotangent: product_combine.py).
    combine = (row_map, jnp.ones(lids.shape, jnp.float32) if w is None else w, row_pairs)
    return expert_mlp(x_sorted, w_in, w_out, group_sizes, activation, quantization, x_quantized, combine=combine)
