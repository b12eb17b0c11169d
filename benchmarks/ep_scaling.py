"""Benchmark: the expert-parallel moe_xla.moe on several devices: correctness against one
device; weak scaling under balanced and under skewed routing, each beside what bounds it
(load imbalance, bytes sent against the ideal, the link's own all_to_all bandwidth,
communication time without waits for late peers, host synchronisations); memory per device.

    python benchmarks/ep_scaling.py [--cases NAME ...] [--peers 1 2 4 8] [--tokens-per-device 4096 16384]
        [--transports padded ragged] [--chunks 1] [--check-capacity-factor 0.25] [--capacity-factor 1.25]
        [--reps 20] [--scale 1.0] [--out DIR] [--skip check scaling memory] [--redundant-experts S]

Inputs (_timing.moe_inputs, key 0): x bf16, w_in / w_out ~ N(0, 1/fan_in) bf16, the bf16
cotangent ct, router logits of the routings of ep_exchange.py: "balanced" (every expert
equally likely) and "skewed" (expert e's popularity falls as a power of e). On P devices
tokens and experts are split over the expert axis; rank p owns experts [p E/P, (p+1) E/P).
--scale shrinks H and F (multiples of 8) for smoke runs; without XLA_FLAGS the script makes
8 CPU devices; on GPUs NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set).
A step is forward and backward in one program (_timing.fwd_bwd): y, and the gradients of
<y, ct> w.r.t. x, router logits, w_in and w_out. Each program is compiled once per shape and options and
runs both routings. XLA:CPU has no ragged_all_to_all: there the layer's ragged transport
runs its all_to_all stand-in, which `check` checks and `scaling` does not time.

Sections, over the moe_layer cases of cases.json; the markdown table's columns:

check    at every EP size P > 1 and the smallest --tokens-per-device T, for each routing,
         transport and capacity_factor (none, and --check-capacity-factor, small enough
         that the overflow rounds run), the layer on P devices against moe() on one device,
         same P T tokens:
           bitwise_fwd        the forward pass with dedup off equals moe()'s bit for bit;
           rel_err_fwd_dedup  relative (Frobenius) error of the step's y, dedup on;
           rel_err_dx, rel_err_dw_in  of the step's gradients w.r.t. x and w_in (the JSON
                              also has rel_err_dlogits and rel_err_dw_out).
         With --redundant-experts S, rows with redundant_slots > 0 run the layer with
         min(S, E / P) replicas per rank (moe(redundant_experts=), no capacity_factor),
         placed by ep_exchange.redundant_placement from a previous batch's routing.
scaling  for each --tokens-per-device T and routing: a baseline row (transport "moe()"),
         moe() without a mesh on one device with T tokens; then at every EP size P that
         divides E, for each transport and --chunks value, the layer (dedup on, no
         capacity_factor) on P devices with P T tokens:
           fwd_bwd_ms         median wall ms per step: --reps batches of back-to-back steps
                              (_timing.time_jax_batched);
           tokens_per_s       P T / fwd_bwd_ms;
           efficiency         tokens_per_s / (P x the baseline's tokens_per_s);
           imbalance          the largest rank's routed (token, expert) pairs / the mean
                              per rank, from moe_xla.route on the logits;
           ideal_efficiency   1 / imbalance: what the busiest rank's expert work allows;
                              with --redundant-experts S, each (transport, chunks) row at P > 1
                              has a twin with redundant_slots = min(S, E / P) replicas per rank
                              (as in check) whose imbalance counts each pair on the rank of the
                              replica serving it (ep_exchange.imbalance); the twin has no byte
                              columns (the byte counts know no replicas);
           ideal_mib          the busiest rank's ideal bytes per step, forward: distinct
                              (token, destination rank != own) rows x 2 H bytes, dispatched
                              or returned in the combine (ep_exchange.ideal_bytes); the
                              backward pass moves as many again;
           sent_mib           the busiest rank's bytes per step with the transport, forward,
                              metadata included: the padded transport's slabs, the ragged
                              one's routed rows (ep_exchange.sent_bytes; the JSON's
                              sent_mib_fwd_bwd adds the backward pass);
           sent_ratio         max over ranks of sent / ideal;
           link_gbps          the link alone, measured in the same run: GB/s per rank of
                              one jax.lax.all_to_all under shard_map of a bf16 [P n, H]
                              buffer per rank, n = ceil(rows / 2 / (P - 1)) with rows =
                              ideal_mib / 2 H (the ideal dispatch of the busiest rank,
                              spread over its peers): bytes to the other ranks / the
                              all_to_all's wait-free time (below) per call, over 20 calls;
           exch_gbps          the ideal bytes forward and backward (2 ideal_mib) /
                              comm_ms_wait_free: the exchange's effective bandwidth;
           exch_vs_link       exch_gbps / link_gbps;
         and from a profiler trace of 5 steps, per step (empty where the trace has no
         device kernels, as on CPU):
           comm_ms            collective kernels (names with nccl, all_to_all, alltoall or
                              MultiGpuBarrier, the barrier of XLA's ragged all-to-all),
                              mean over the devices: a device whose peer is late spins
                              in them, so this counts waiting too;
           comm_ms_wait_free  the sum over collective launches (the i-th collective kernel
                              on each device) of the shortest of their durations across the
                              devices: the last device to arrive does not wait;
           gemm_ms            grouped GEMM kernels (CUTLASS's device_kernel), mean over the
                              devices;
           hidden             (other kernels + comm_ms_wait_free - fwd_bwd_ms) /
                              comm_ms_wait_free clipped to [0, 1], other kernels the
                              non-collective kernel time per device: a lower bound of the
                              share of the communication that ran under other kernels;
           host_syncs         device-to-host copies per step and device (_timing.host_syncs:
                              XLA:GPU reads a while loop's predicate back to the host).
memory   at the largest P and the smallest T: compile-time memory_analysis() per device
         (temp + arguments + outputs) of the step with worst-case exchange buffers
         (fwd_bwd_gib_worst) and with --capacity-factor (fwd_bwd_gib_cf<f>).
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--help" not in sys.argv and "-h" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path  # noqa: E402

from _timing import (CASES, compiled_memory_bytes, environment, fwd_bwd, gib, gpu_kernels, host_syncs,  # noqa: E402
                     moe_input_shapes, moe_inputs, routing_options, time_jax_batched, trace_events, write_results)
from ep_exchange import (ACT_BYTES, MIB, ROUTINGS, ideal_bytes, imbalance, redundant_placement, route_ids,  # noqa: E402
                         routing_logits, sent_bytes)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_xla  # noqa: E402
from moe_xla.ep.config import TRANSPORTS  # noqa: E402

COLLECTIVE_MARKERS = ("nccl", "all_to_all", "alltoall", "all-to-all", "multigpubarrier")
GEMM_MARKER = "device_kernel"  # cutlass::device_kernel<...>: the grouped GEMMs
TRACE_STEPS = 5
LINK_CALLS = 20
ON_CPU = jax.devices()[0].platform == "cpu"


def _dims(case, scale):
    shrink = lambda v: max(8, int(round(v * scale / 8)) * 8)  # noqa: E731
    return shrink(case["H"]), shrink(case["F"]), case["E"], case["top_k"]


@functools.cache
def _mesh(peers):
    return Mesh(np.array(jax.devices()[:peers]), ("ep",))


def _split(peers):
    """Tokens and experts split over the expert axis of `peers` devices, as the layer wants them."""
    return NamedSharding(_mesh(peers), P("ep"))


def _inputs(case, tokens, scale, sharding):
    """(x, logits ~ N(0, 1), w_in, w_out, ct) at the case's scaled dims, placed by `sharding`."""
    hidden, ffn, experts, _ = _dims(case, scale)
    (x, logits, w_in, w_out), ct = moe_inputs(jax.random.key(0), tokens, hidden, ffn, experts)
    return jax.device_put((x, logits, w_in, w_out, ct), sharding)


def _routed(inputs, routing):
    """inputs with the logits of `routing` (ep_exchange.routing_logits), placed as they were."""
    x, logits, *rest = inputs
    return (x, jax.device_put(routing_logits(logits, routing), logits.sharding), *rest)


def _options(transport="padded", dedup=True, capacity_factor=None, chunks=1, redundant_experts=None):
    """The EP layer's options, every one spelled out (a key of _program's cache)."""
    return dict(transport=transport, dedup=dedup, capacity_factor=capacity_factor, chunks=chunks,
                redundant_experts=redundant_experts)


def _placements(case, tokens, peers, routing, args):
    """[None], and with --redundant-experts at P > 1 the placement of the module docstring."""
    if not args.redundant_experts or peers == 1:
        return [None]
    return [None, redundant_placement(case, tokens, peers, routing, args.redundant_experts)]


def _slots(placement):
    """Replicas per rank of a placement (0 for None)."""
    return 0 if placement is None else len(placement[0])


_PROGRAMS = {}


def _program(case, peers, kind, like, options=None):
    """`kind` ("fwd" or "step") of moe() without a mesh (options None) or of the EP layer
    on `peers` devices with `options`, compiled for arguments shaped and placed like `like`
    (arrays or ShapeDtypeStructs); compiled once per configuration."""
    key = (case["name"], peers, kind, like[0].shape, None if options is None else tuple(options.items()))
    if key not in _PROGRAMS:
        kw = routing_options(case)
        if options is None:
            layer = lambda *a: moe_xla.moe(*a, **kw)  # noqa: E731
        else:
            layer = lambda *a: moe_xla.moe(*a, mesh=_mesh(peers), expert_axis="ep", **kw, **options)  # noqa: E731
        fn, args = (layer, like[:4]) if kind == "fwd" else (fwd_bwd(layer, 4), like)
        _PROGRAMS[key] = jax.jit(fn).lower(*args).compile()
    return _PROGRAMS[key]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(case, peers, args):
    """The check rows of the module docstring at EP size `peers`."""
    tokens = peers * min(args.tokens_per_device)
    local = _inputs(case, tokens, args.scale, jax.devices()[0])
    split = jax.device_put(local, _split(peers))
    rows = []
    for routing in ROUTINGS:
        one, many = _routed(local, routing), _routed(split, routing)
        y_one = _program(case, 1, "fwd", one)(*one[:4])
        g_one = _program(case, 1, "step", one)(*one)[1]
        placements = _placements(case, tokens, peers, routing, args)
        for transport in args.transports:
            configs = [(None, None), (args.check_capacity_factor, None)] + [(None, p) for p in placements[1:]]
            for cf, placement in configs:
                opts = dict(capacity_factor=cf, redundant_experts=placement)
                plain = _program(case, peers, "fwd", many, _options(transport, False, **opts))(*many[:4])
                y, grads = _program(case, peers, "step", many, _options(transport, True, **opts))(*many)
                row = {"section": "check", "case": case["name"], "tokens_per_device": tokens // peers, "peers": peers,
                       "routing": routing, "transport": transport, "capacity_factor": cf,
                       "redundant_slots": _slots(placement),
                       "bitwise_fwd": bool(np.array_equal(np.asarray(plain), np.asarray(y_one))),
                       "rel_err_fwd_dedup": _rel(y.astype(jnp.float32), y_one.astype(jnp.float32))}
                for name, g, r in zip(("dx", "dlogits", "dw_in", "dw_out"), grads, g_one):
                    row[f"rel_err_{name}"] = _rel(jnp.asarray(g, jnp.float32), jnp.asarray(r, jnp.float32))
                rows.append(row)
                print(row, flush=True)
    return rows


def _is_collective(name):
    name = name.lower()
    return any(m in name for m in COLLECTIVE_MARKERS)


def _wait_free_ms(kernels, calls):
    """Sum over collective launches of the shortest duration across devices, per call (ms)
    ({device: kernels} from _timing.gpu_kernels, the i-th collective of each device matched)."""
    launches = [[e["dur"] for e in ks if _is_collective(e["name"])] for ks in kernels.values()]
    if len({len(d) for d in launches}) > 1:
        print(f"ep_scaling: collective launches per device differ ({[len(d) for d in launches]}): "
              f"the first {min(map(len, launches))} matched", flush=True)
    return sum(min(durations) for durations in zip(*launches)) / calls / 1e3


def _trace_columns(events, wall_ms):
    """The trace columns of the module docstring from trace_events of TRACE_STEPS steps;
    {} where the trace has no device kernels."""
    kernels = gpu_kernels(events)
    if not kernels:
        return {}
    per_step = lambda us: us / len(kernels) / TRACE_STEPS / 1e3  # noqa: E731  mean over devices, ms
    every = [e for ks in kernels.values() for e in ks]
    comm = per_step(sum(e["dur"] for e in every if _is_collective(e["name"])))
    wait_free = _wait_free_ms(kernels, TRACE_STEPS)
    other = per_step(sum(e["dur"] for e in every)) - comm
    top = collections.Counter()
    for e in every:
        top[e["name"][:80]] += e["dur"] / len(kernels) / TRACE_STEPS
    return {"comm_ms": comm, "comm_ms_wait_free": wait_free,
            "gemm_ms": per_step(sum(e["dur"] for e in every if GEMM_MARKER in e["name"].lower())),
            "hidden": min(1.0, max(0.0, (other + wait_free - wall_ms) / wait_free)) if wait_free else None,
            "host_syncs": host_syncs(events, TRACE_STEPS)["d2h_copies"] / len(kernels),
            "kernels": {k: round(v, 1) for k, v in top.most_common(12)}}


def _timed(program, inputs, args):
    """fwd_bwd_ms and the trace columns of `program` on `inputs`."""
    ms = time_jax_batched(program, *inputs, reps=args.reps) * 1e3
    return {"fwd_bwd_ms": ms, **_trace_columns(trace_events(program, inputs, TRACE_STEPS), ms)}


def _link_gbps(peers, rows, hidden):
    """GB/s per rank of one jax.lax.all_to_all of a bf16 [peers rows, hidden] buffer per rank
    under shard_map (module docstring); None where the trace has no device kernels."""
    mesh = _mesh(peers)
    a2a = jax.jit(jax.shard_map(lambda b: jax.lax.all_to_all(b, "ep", 0, 0, tiled=True), mesh=mesh,
                                in_specs=P("ep"), out_specs=P("ep")))
    buffer = jax.device_put(jnp.ones((peers * peers * rows, hidden), jnp.bfloat16), _split(peers))
    kernels = gpu_kernels(trace_events(a2a, (buffer,), LINK_CALLS))
    ms = _wait_free_ms(kernels, LINK_CALLS) if kernels else 0.0
    return (peers - 1) * rows * hidden * ACT_BYTES / ms / 1e6 if ms else None


def _wire_columns(case, peers, hidden, ids, ideal, transport, chunks, placement):
    """imbalance, ideal and sent bytes (module docstring) of the routing ids [P T, k], ideal
    the ranks' ideal bytes (ep_exchange.ideal_bytes); with a placement of redundant
    experts, imbalance alone."""
    bound = imbalance(ids, peers, case["E"], placement)
    cols = {"imbalance": bound, "ideal_efficiency": 1 / bound}
    if peers == 1 or placement is not None:
        return cols
    cols["ideal_mib"] = float(ideal.max()) / MIB
    sent = sent_bytes(transport, ids, peers, case["E"], hidden, case["top_k"], dedup=True, chunks=chunks)
    if sent is not None:
        cols.update(sent_mib=float(sent.forward().max()) / MIB,
                    sent_mib_fwd_bwd=float(sent.forward_backward().max()) / MIB,
                    sent_ratio=float(np.max(sent.forward() / ideal)) if ideal.min() > 0 else None)
    return cols


def scaling(case, peers_list, args):
    """The scaling rows of the module docstring, at the EP sizes peers_list (each divides E)."""
    hidden = _dims(case, args.scale)[0]
    transports = [t for t in args.transports if not (ON_CPU and t == "ragged")]
    rows = []
    for tokens in args.tokens_per_device:
        base = {}
        local = _inputs(case, tokens, args.scale, jax.devices()[0])
        for routing in ROUTINGS:
            one = _routed(local, routing)
            row = {"section": "scaling", "case": case["name"], "tokens_per_device": tokens, "routing": routing,
                   "peers": 1, "transport": "moe()", **_timed(_program(case, 1, "step", one), one, args)}
            row["tokens_per_s"] = tokens / row["fwd_bwd_ms"] * 1e3
            base[routing] = row["tokens_per_s"]
            rows.append(row)
            print(row, flush=True)
        del local, one  # before the next inputs are made: device memory
        for peers in peers_list:
            split = _inputs(case, peers * tokens, args.scale, _split(peers))
            for routing in ROUTINGS:
                many = _routed(split, routing)
                ids = route_ids(case, many[1])
                ideal = ideal_bytes(ids, peers, case["E"], hidden)
                link = None
                if peers > 1:  # the busiest rank's ideal rows, one direction, per peer
                    link = _link_gbps(peers, math.ceil(ideal.max() / (hidden * ACT_BYTES) / 2 / (peers - 1)), hidden)
                placements = _placements(case, peers * tokens, peers, routing, args)
                for transport in transports:
                    for chunks, placement in [(c, p) for c in args.chunks for p in placements]:
                        program = _program(case, peers, "step", many,
                                           _options(transport, chunks=chunks, redundant_experts=placement))
                        row = {"section": "scaling", "case": case["name"], "tokens_per_device": tokens,
                               "routing": routing, "peers": peers, "transport": transport, "chunks": chunks,
                               "redundant_slots": _slots(placement), **_timed(program, many, args), "link_gbps": link,
                               **_wire_columns(case, peers, hidden, ids, ideal, transport, chunks, placement)}
                        row["tokens_per_s"] = peers * tokens / row["fwd_bwd_ms"] * 1e3
                        row["efficiency"] = row["tokens_per_s"] / (peers * base[routing])
                        if row.get("comm_ms_wait_free") and "ideal_mib" in row:
                            row["exch_gbps"] = 2 * row["ideal_mib"] * MIB / row["comm_ms_wait_free"] / 1e6
                            row["exch_vs_link"] = row["exch_gbps"] / link if link else None
                        rows.append(row)
                        print(row, flush=True)
            del split, many
    return rows


def memory(case, peers, args):
    """The memory row of the module docstring at EP size `peers`."""
    tokens = peers * min(args.tokens_per_device)
    hidden, ffn, experts, _ = _dims(case, args.scale)
    inputs, ct = moe_input_shapes(tokens, hidden, ffn, experts, _split(peers))
    row = {"section": "memory", "case": case["name"], "tokens_per_device": tokens // peers, "peers": peers}
    for name, cf in (("worst", None), (f"cf{args.capacity_factor:g}", args.capacity_factor)):
        program = _program(case, peers, "step", (*inputs, ct), _options(capacity_factor=cf))
        row[f"fwd_bwd_gib_{name}"] = gib(compiled_memory_bytes(program))
    print(row, flush=True)
    return [row]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", default=["qwen3-30b-a3b", "deepseek-v3-like"])
    parser.add_argument("--peers", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--tokens-per-device", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--scale", type=float, default=1.0, help="scale H and F (smoke runs)")
    parser.add_argument("--transports", nargs="*", default=[t for t in TRANSPORTS if t != "auto"],
                        choices=[t for t in TRANSPORTS if t != "auto"])
    parser.add_argument("--chunks", type=int, nargs="*", default=[1])
    parser.add_argument("--check-capacity-factor", type=float, default=0.25)
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="of the memory section")
    parser.add_argument("--reps", type=int, default=20, help="timed batches per step time")
    parser.add_argument("--skip", nargs="*", default=[], choices=["check", "scaling", "memory"])
    parser.add_argument("--redundant-experts", type=int, default=0, metavar="S",
                        help="also run the layer with min(S, E / P) replicas per rank (check and scaling); 0: never")
    args = parser.parse_args()
    peers = [p for p in args.peers if p <= len(jax.devices())]
    if len(peers) < len(args.peers):
        print(f"ep_scaling: {len(jax.devices())} devices: EP sizes {peers} only", flush=True)
    if ON_CPU and "ragged" in args.transports:
        print("ep_scaling: XLA:CPU has no ragged_all_to_all: the ragged transport runs its all_to_all stand-in "
              "in check and is not timed", flush=True)
    rows = []
    for case in CASES["moe_layer"]:
        if case["name"] not in args.cases:
            continue
        fit = [p for p in peers if case["E"] % p == 0]
        if "check" not in args.skip:
            for p in fit:
                if p > 1:
                    rows += check(case, p, args)
        if "scaling" not in args.skip:
            rows += scaling(case, fit, args)
        if "memory" not in args.skip and fit:
            rows += memory(case, max(fit), args)
        _PROGRAMS.clear()
    columns = ["section", "case", "tokens_per_device", "routing", "peers", "transport", "chunks", "capacity_factor",
               "redundant_slots",
               "bitwise_fwd", "rel_err_fwd_dedup", "rel_err_dx", "rel_err_dw_in", "fwd_bwd_ms", "tokens_per_s",
               "efficiency", "imbalance", "ideal_efficiency", "ideal_mib", "sent_mib", "sent_ratio", "link_gbps",
               "exch_gbps", "exch_vs_link", "comm_ms", "comm_ms_wait_free", "gemm_ms", "hidden", "host_syncs",
               "fwd_bwd_gib_worst", f"fwd_bwd_gib_cf{args.capacity_factor:g}"]
    write_results(args.out, f"ep_scaling_{jax.devices()[0].platform}{len(jax.devices())}", environment(), rows, columns)


if __name__ == "__main__":
    main()
