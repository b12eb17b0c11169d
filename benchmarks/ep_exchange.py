"""Benchmark: what the expert-parallel layer sends per rank against the ideal, and what it
holds, on the moe_layer cases of cases.json: counted from the routing, nothing timed.

    python benchmarks/ep_exchange.py [--out benchmarks/results] [--cases NAME ...] [--peers 2 4 8]
                                     [--tokens-per-rank 4096] [--capacity-factor 1.25] [--no-memory]
                                     [--redundant-experts S] [--quantization none fp8_blockwise]

Runs on any backend; on a machine without GPUs it makes max(--peers) CPU devices itself.
ep_scaling.py imports the routings and the counts below.

Routings (ROUTINGS). Router logits ~ N(0, 1) (key 0) for P x tokens-per-rank tokens, then:
  balanced  the logits as they are: every expert equally likely, its load T k / E up to
            sampling noise (a router trained with a balancing loss; the imbalance column
            gives the actual load). Not a pattern such as "token t prefers experts t, ...,
            t+k-1": its k experts would mostly share a rank and dedup would remove most rows;
  skewed    logits - 1.2 log(1 + e): expert e's popularity falls as a power of e.
ids = moe_xla.route(logits, the case's score / groups). Rank r holds tokens
[r T_r, (r+1) T_r) and experts [r E_l, (r+1) E_l), E_l = E / P.

Columns, per EP size P, routing and quantization (one step forward, one chunk, no
capacity_factor); with --quantization fp8_blockwise the layer's expert products are FP8
and its dispatch sends each token's FP8 row (H bytes) with the float32 scales of its
1 x 128 tiles (4 ceil(H / 128) bytes) instead of 2 H bytes of bf16 (moe_xla/ep/
fp8_dispatch.py); the combine's rows stay bf16:
  imbalance   the largest rank's (token, expert) pairs / the mean pairs per rank.
  imbalance_redundant   (with --redundant-experts S) the same with min(S, E / P) replicas
              per rank (moe(redundant_experts=)): placed by moe_xla.ep.place_redundant_experts
              from the tokens_per_expert of a previous batch (the routing's logits drawn
              with key 1), each pair counted on the rank of the replica that serves it;
              redundant_slots gives the slots per rank.
  rows_*      rows crossing a link in the dispatch, summed over ranks (a row to the own
              rank crosses none): no_dedup one per (token, j) whose expert lives on a rank
              d != r; dedup one per (token, d != r) with at least one of its experts on d.
  ideal_mib   the busiest rank's ideal bytes: rank r dispatches out_r dedup rows and
              receives in_r, and each row comes back to its sender in the combine, so r
              sends out_r dispatched rows and in_r combined rows (2 H bytes each in bf16;
              H + 4 ceil(H / 128) for a dispatched FP8 row), nothing else; max over r.
  {transport}_{dedup|no_dedup}_mib   the busiest rank's bytes (max over r) with that
              transport, metadata included (sent_bytes):
                ragged  the routed rows alone: the dispatch's rows (as above) with their
                        local expert ids (int32, mult per row; mult = min(k, E_l) with
                        dedup, else 1) and, with dedup, their routing weights (float32,
                        mult per row); the combine's rows (2 H bytes); the chunk's round
                        starts (R + 1 int32 per peer, R = 1 here);
                padded  whatever the routing, per chunk a slab of sizing.exchange_sizes(
                        ...).rows rows for every peer d != r, dispatch (with the same
                        metadata, padding included) and combine.
  {transport}_{dedup|no_dedup}_ratio  max over ranks of sent_r / ideal_r (every rank sends
              at most this multiple of its own ideal).
The backward pass runs the transposed exchange: it moves the rows and routing weights
again, not the ids (Wire.backward and Wire.meta), the dispatched rows' gradients in bf16
also with FP8 products (the dispatch's derivative is the straight-through one). The
layer's psums (tokens_per_expert, [E] int32, and the dispatched-row count) are not counted.

Memory per rank (at the largest --peers): XLA's compile-time memory_analysis() (temp +
arguments + outputs) of the EP layer's forward and forward+backward (_timing.fwd_bwd:
y and its vector-Jacobian product with a bf16 cotangent ct, an argument) programs on the mesh, per device, inputs
split as the layer wants them (tokens and experts over the expert axis), for each
(dedup, capacity_factor) setting; nothing is run, so full-size cases compile on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

if __name__ == "__main__" and "--help" not in sys.argv and "-h" not in sys.argv:
    _peers = list(itertools.takewhile(str.isdigit, sys.argv[sys.argv.index("--peers") + 1:])) \
        if "--peers" in sys.argv else []
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(map(int, _peers), default=8)}")

from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

from _timing import (CASES, compiled_memory_bytes, environment, fwd_bwd_memory_bytes, gib, moe_input_shapes,  # noqa: E402
                     routing_options, write_results)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_xla  # noqa: E402
from moe_xla import grouped  # noqa: E402
from moe_xla.ep import place_redundant_experts, sizing  # noqa: E402
from moe_xla.ep.placement import expert_slots  # noqa: E402

MIB = 2**20
ROUTINGS = ("balanced", "skewed")
ACT_BYTES = 2  # bf16 activations (the benchmarks' x)


def routing_logits(logits, routing: str):
    """Router logits [T, E] of `routing` (module docstring) from logits ~ N(0, 1)."""
    if routing == "balanced":
        return logits
    if routing == "skewed":
        return logits - 1.2 * jnp.log1p(jnp.arange(logits.shape[1], dtype=jnp.float32))
    raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")


def route_ids(case, logits) -> np.ndarray:
    """[T, k] expert ids moe_xla.route picks from `logits` with the case's routing options."""
    return np.asarray(moe_xla.route(logits, **routing_options(case))[1])


def imbalance(ids, peers: int, num_experts: int, placement=None) -> float:
    """The largest rank's (token, expert) pairs / the mean pairs per rank, ids [T, k] of all
    P ranks' tokens in rank order; with a placement of redundant experts, each pair on the
    rank of the replica that serves it (moe_xla.ep.placement.expert_slots)."""
    placement = ((),) * peers if placement is None else placement
    per_rank = jnp.asarray(ids).reshape(peers, -1, ids.shape[-1])
    slots = jax.vmap(lambda i: expert_slots(i, placement, num_experts))(per_rank)
    dest = np.asarray(slots).reshape(-1) // (num_experts // peers + len(placement[0]))  # slots per rank
    pairs = np.bincount(dest, minlength=peers)
    return float(pairs.max() / pairs.mean())


def redundant_placement(case, tokens: int, peers: int, routing: str, slots: int) -> tuple:
    """A placement of min(slots, E / P) replicas per rank from the tokens_per_expert of a
    previous batch of `tokens` tokens: the routing's logits drawn with key 1 (module docstring)."""
    logits = jax.random.normal(jax.random.key(1), (tokens, case["E"]), jnp.float32)
    ids = route_ids(case, routing_logits(logits, routing))
    load = np.bincount(ids.reshape(-1), minlength=case["E"])
    return place_redundant_experts(load, peers, min(slots, case["E"] // peers))


def rows_between(ids, peers: int, num_experts: int, dedup: bool) -> np.ndarray:
    """[P, P] rows rank r dispatches to rank d (the diagonal: rows to itself, which cross no
    link); tokens split evenly over the ranks in order."""
    tokens = ids.shape[0]
    dest = ids // (num_experts // peers)
    home = np.arange(tokens) // (tokens // peers)
    if dedup:  # one row per (token, destination)
        hit = np.zeros((tokens, peers), np.int64)
        np.put_along_axis(hit, dest, 1, axis=1)
        return np.stack([hit[home == r].sum(0) for r in range(peers)])
    between = np.zeros((peers, peers), np.int64)
    np.add.at(between, (np.broadcast_to(home[:, None], dest.shape), dest), 1)
    return between


def _out_in(between):
    """([P] rows each rank dispatches to other ranks, [P] rows it receives from them)."""
    own = np.diag(between)
    return between.sum(1) - own, between.sum(0) - own


class Wire(NamedTuple):
    """Bytes each rank sends in one step, [P] each: `data` (rows and routing weights) and
    `meta` (expert ids and round starts) forward, `backward` (rows and routing weights again;
    the ids are not resent)."""

    data: np.ndarray
    meta: np.ndarray
    backward: np.ndarray

    def forward(self):
        return self.data + self.meta

    def forward_backward(self):
        return self.data + self.backward + self.meta


def row_bytes(hidden: int, quantization=None) -> tuple[int, int]:
    """(dispatched, combined) bytes of one token row forward (module docstring), for moe()'s
    `quantization` argument."""
    grouped.check_quantization("ep_exchange", quantization)
    combined = hidden * ACT_BYTES
    return (hidden + 4 * -(-hidden // 128) if grouped.is_fp8(quantization) else combined), combined


def ideal_bytes(ids, peers: int, num_experts: int, hidden: int, quantization=None) -> np.ndarray:
    """[P] ideal bytes each rank sends per step forward (module docstring)."""
    out, into = _out_in(rows_between(ids, peers, num_experts, dedup=True))
    dispatched, combined = row_bytes(hidden, quantization)
    return out * dispatched + into * combined


def _chunk_tokens(tokens: int, chunks: int):
    """The token counts of the layer's chunks of one rank's tokens (moe_xla/ep/layer.py)."""
    size, extra = divmod(tokens, chunks)
    return [size + (c < extra) for c in range(chunks)]


def _padded(ids, peers, num_experts, hidden, top_k, dedup, chunks, quantization) -> Wire:
    """One [rows] slab per chunk and peer, each way, whatever the routing."""
    dispatched, combined = row_bytes(hidden, quantization)
    data = meta = backward = 0
    for tokens in _chunk_tokens(ids.shape[0] // peers, chunks):
        sizes = sizing.exchange_sizes(tokens, top_k, num_experts, peers, dedup=dedup)
        slab = sizes.rows * (peers - 1)
        weights = 4 * sizes.mult if dedup else 0
        data += slab * (dispatched + combined + weights)
        backward += slab * (2 * combined + weights)
        meta += slab * 4 * sizes.mult
    return Wire(np.full(peers, data), np.full(peers, meta), np.full(peers, backward))


def _ragged(ids, peers, num_experts, hidden, top_k, dedup, chunks, quantization) -> Wire:
    """The routed rows alone, with their metadata, and each chunk's round starts."""
    dispatched, combined = row_bytes(hidden, quantization)
    mult = min(top_k, num_experts // peers) if dedup else 1
    out, into = _out_in(rows_between(ids, peers, num_experts, dedup))
    weights = out * 4 * mult if dedup else 0
    return Wire(out * dispatched + into * combined + weights, out * 4 * mult + chunks * 2 * 4 * (peers - 1),
                (out + into) * combined + weights)


TRANSPORT_BYTES = {"padded": _padded, "ragged": _ragged}


def sent_bytes(transport: str, ids, peers: int, num_experts: int, hidden: int, top_k: int, *, dedup: bool = True,
               chunks: int = 1, quantization=None) -> Wire | None:
    """Wire of one step of the layer's `transport` (module docstring) without capacity_factor,
    for ids [T, k] of all P ranks' tokens; None for a transport this script cannot count."""
    count = TRANSPORT_BYTES.get(transport)
    return None if count is None else count(ids, peers, num_experts, hidden, top_k, dedup, chunks, quantization)


def _memory(case, mesh, tokens, dedup, capacity_factor):
    inputs, ct = moe_input_shapes(tokens, case["H"], case["F"], case["E"], NamedSharding(mesh, P("ep")))

    def layer(*a):
        return moe_xla.moe(*a, **routing_options(case), mesh=mesh, expert_axis="ep", transport="padded",
                           dedup=dedup, capacity_factor=capacity_factor)

    return compiled_memory_bytes(jax.jit(layer).lower(*inputs).compile()), fwd_bwd_memory_bytes(layer, inputs, ct)


def exchange_row(case, peers: int, per_rank: int, routing: str, redundant_slots: int = 0,
                 quantization=None) -> dict:
    """The wire columns of one case, EP size, routing and quantization (module docstring)."""
    experts, hidden, k = case["E"], case["H"], case["top_k"]
    logits = jax.random.normal(jax.random.key(0), (peers * per_rank, experts), jnp.float32)
    ids = route_ids(case, routing_logits(logits, routing))
    ideal = ideal_bytes(ids, peers, experts, hidden, quantization)
    row = {"case": case["name"], "peers": peers, "routing": routing, "quantization": quantization or "none",
           "tokens_per_rank": per_rank, "imbalance": imbalance(ids, peers, experts), "ideal_mib": ideal.max() / MIB}
    if redundant_slots:
        placement = redundant_placement(case, peers * per_rank, peers, routing, redundant_slots)
        row.update(redundant_slots=len(placement[0]), imbalance_redundant=imbalance(ids, peers, experts, placement))
    for dd, on in (("no_dedup", False), ("dedup", True)):
        between = rows_between(ids, peers, experts, on)
        row[f"rows_{dd}"] = int(between.sum() - np.trace(between))
    for transport in TRANSPORT_BYTES:
        for dd, on in (("dedup", True), ("no_dedup", False)):
            sent = sent_bytes(transport, ids, peers, experts, hidden, k, dedup=on, quantization=quantization).forward()
            row[f"{transport}_{dd}_mib"] = sent.max() / MIB
            row[f"{transport}_{dd}_ratio"] = float(np.max(sent / ideal)) if ideal.min() > 0 else None
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*")
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--no-memory", action="store_true", help="skip the compile-time memory figures")
    parser.add_argument("--redundant-experts", type=int, default=0, metavar="S",
                        help="replicas per rank (at most E / P) for the imbalance_redundant column; 0: none")
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "fp8_blockwise"],
                        help="the expert products' quantization (moe()'s argument): what the dispatch sends")
    args = parser.parse_args()
    most = max(args.peers)
    if not args.no_memory and len(jax.devices()) < most:
        sys.exit(f"ep_exchange: the memory figures need {most} devices, found {len(jax.devices())} (or --no-memory)")
    rows = []
    for case in CASES["moe_layer"]:
        if args.cases and case["name"] not in args.cases:
            continue
        for peers in args.peers:
            if case["E"] % peers:
                print(f"ep_exchange: {case['name']}: {case['E']} experts do not split over {peers} ranks", flush=True)
                continue
            for routing, quantization in itertools.product(ROUTINGS, args.quantization):
                rows.append(exchange_row(case, peers, args.tokens_per_rank, routing, args.redundant_experts,
                                         None if quantization == "none" else quantization))
                print(rows[-1], flush=True)
        if not args.no_memory and case["E"] % most == 0:
            mesh = Mesh(np.array(jax.devices()[:most]), ("ep",))
            row = {"case": case["name"], "peers": most}
            for name, on in (("no_dedup", False), ("dedup", True)):
                for cf_name, cf in (("worst", None), (f"cf{args.capacity_factor:g}", args.capacity_factor)):
                    fwd, bwd = _memory(case, mesh, most * args.tokens_per_rank, on, cf)
                    row[f"mem_gib_fwd_{name}_{cf_name}"] = gib(fwd)
                    row[f"mem_gib_fwdbwd_{name}_{cf_name}"] = gib(bwd)
            rows.append(row)
            print(row, flush=True)
    columns = ["case", "peers", "routing", "quantization", "imbalance", "redundant_slots", "imbalance_redundant",
               "rows_no_dedup", "rows_dedup", "ideal_mib"]
    columns += [f"{t}_{dd}_{v}" for t in TRANSPORT_BYTES for dd in ("dedup", "no_dedup") for v in ("mib", "ratio")]
    columns += list(dict.fromkeys(c for r in rows for c in r if c.startswith("mem_gib")))
    write_results(args.out, f"ep_exchange_{jax.devices()[0].platform}", environment(), rows, columns)


if __name__ == "__main__":
    main()
