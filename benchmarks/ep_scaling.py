"""Benchmark: the expert-parallel moe_xla.moe on several devices: correctness
against one device, weak scaling, communication / overlap and memory per device.

    python benchmarks/ep_scaling.py [--cases NAME ...] [--peers 1 2 4 8] [--tokens-per-device 4096]
        [--scale 1.0] [--chunks 1 2 4] [--capacity-factor 1.25] [--out DIR] [--skip check scaling overlap memory]

Inputs are bf16, weights ~ N(0, 1/fan_in); --scale shrinks H and F (multiples of 8) for
smoke runs on CPU devices. On GPUs NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0
unless set). Sections, each over the moe_layer cases of cases.json:

  check     at every EP size P > 1, for "balanced" routing (every expert gets T k / E
            assignments) and "skewed" routing (logits + log of zipf(1.2) expert
            probabilities), for each transport: the layer on P devices against the same
            layer on one device, same global tokens (P x tokens-per-device): forward with
            dedup off bitwise (bitwise_fwd), and relative errors of y with dedup on and of
            the gradients w.r.t. x, router logits, w_in, w_out (dedup on).
  scaling   weak scaling: forward+backward ms and tokens/s at each P and transport with a
            fixed token count per device (dedup on, the first --chunks value: 1, moe's
            default); from a profiler trace, per call and summed over the devices, comm_ms:
            the collective kernels (names with nccl, all_to_all, alltoall or
            MultiGpuBarrier, the barrier of XLA's ragged all-to-all) and their share of the
            wall time, gemm_ms: the grouped GEMMs (CUTLASS's device_kernel).
  overlap   at the largest P, per transport, each --chunks value: wall ms, collective,
            grouped-GEMM and all other kernel ms as above; hidden = (kernels + collectives
            - wall) / collectives, clipped to [0, 1]: the part of the collectives' time that
            ran under other kernels (NCCL's kernels spin while they wait, which inflates it).
  memory    at the largest P, compile-time memory_analysis() per device (temp + arguments
            + outputs) of forward+backward with worst-case buffers and with capacity_factor.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--help" not in sys.argv and "-h" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path  # noqa: E402

from _timing import (CASES, device_kernels, environment, fwd_bwd, fwd_bwd_memory_bytes, gib, moe_input_shapes,  # noqa: E402
                     moe_inputs, routing_options, time_jax, write_results)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_xla  # noqa: E402

COLLECTIVE_MARKERS = ("nccl", "all_to_all", "alltoall", "all-to-all", "multigpubarrier")
GEMM_MARKER = "device_kernel"  # cutlass::device_kernel<...>: the grouped GEMMs


def _dims(case, scale):
    shrink = lambda v: max(8, int(round(v * scale / 8)) * 8)  # noqa: E731
    return shrink(case["H"]), shrink(case["F"]), case["E"], case["top_k"]


def _inputs(case, tokens, scale, routing):
    hidden, ffn, experts, _ = _dims(case, scale)
    (x, logits, w_in, w_out), ct = moe_inputs(jax.random.key(0), tokens, hidden, ffn, experts)
    if routing == "balanced":  # token t prefers experts t, t+1, ..., t+k-1 (mod E)
        rank = (jnp.arange(experts)[None, :] - jnp.arange(tokens)[:, None]) % experts
        logits = -rank.astype(jnp.float32) + 0.3 * jax.nn.sigmoid(logits)
    elif routing == "skewed":
        logits = logits - 1.2 * jnp.log1p(jnp.arange(experts, dtype=jnp.float32))
    return (x, logits, w_in, w_out), ct


def _layer(case, mesh=None, **ep):
    kw = routing_options(case)
    if mesh is None:
        return lambda *a: moe_xla.moe(*a, **kw)
    return lambda *a: moe_xla.moe(*a, mesh=mesh, expert_axis="ep", **kw, **ep)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _place(args, mesh):
    """Tokens and experts split over the expert axis, as the layer wants them."""
    split = NamedSharding(mesh, P("ep"))
    return tuple(jax.device_put(a, split) for a in args)


def check(case, peers, args):
    rows = []
    for routing in ("balanced", "skewed"):
        inputs, ct = _inputs(case, peers * args.tokens_per_device, args.scale, routing)
        one_dev = jax.devices()[0]
        local = jax.device_put((inputs, ct), one_dev)
        y_one = jax.jit(_layer(case))(*local[0])
        g_one = jax.jit(fwd_bwd(_layer(case), 4))(*local[0], local[1])
        mesh = Mesh(np.array(jax.devices()[:peers]), ("ep",))
        placed, ct_placed = _place(inputs, mesh), jax.device_put(ct, NamedSharding(mesh, P("ep")))
        for transport in args.transports:
            plain = jax.jit(_layer(case, mesh, transport=transport, dedup=False))(*placed)
            dedup = _layer(case, mesh, transport=transport, dedup=True)
            grads = jax.jit(fwd_bwd(dedup, 4))(*placed, ct_placed)
            row = {"section": "check", "case": case["name"], "peers": peers, "routing": routing,
                   "transport": transport, "bitwise_fwd": bool(np.array_equal(np.asarray(plain), np.asarray(y_one))),
                   "rel_err_fwd_dedup": _rel(jax.jit(dedup)(*placed).astype(jnp.float32), y_one.astype(jnp.float32))}
            for name, g, r in zip(("dx", "dlogits", "dw_in", "dw_out"), grads, g_one):
                row[f"rel_err_{name}"] = _rel(jnp.asarray(g, jnp.float32), jnp.asarray(r, jnp.float32))
            rows.append(row)
            print(row, flush=True)
    return rows


def _trace_split(compiled, call_args, calls=10):
    """Kernel time per call, summed over the devices, from a profiler trace: (collective ms,
    ms of every other kernel, of which grouped-GEMM ms (CUTLASS's device_kernel), the 12
    largest {name[:80]: us})."""
    _, kernels = device_kernels(compiled, call_args, calls)

    def total(pick):
        return sum(v for k, v in kernels.items() if pick(k.lower())) / calls / 1e3

    comm = total(lambda k: any(m in k for m in COLLECTIVE_MARKERS))
    gemm = total(lambda k: GEMM_MARKER in k)
    top = collections.Counter()
    for k, v in kernels.items():
        top[k[:80]] += v / calls
    other = sum(kernels.values()) / calls / 1e3 - comm
    return comm, other, gemm, {k: round(v, 1) for k, v in top.most_common(12)}


_TIMED = {}


def _timed(case, peers, args, transport, chunks):
    """(fwd_bwd ms, collective ms, other kernel ms, grouped-GEMM ms, top kernels) of the
    skewed layer on `peers` devices, measured once per (case, peers, transport, chunks):
    scaling and overlap share a configuration."""
    key = (case["name"], peers, transport, chunks)
    if key not in _TIMED:
        mesh = Mesh(np.array(jax.devices()[:peers]), ("ep",))
        inputs, ct = _inputs(case, peers * args.tokens_per_device, args.scale, "skewed")
        placed = _place((*inputs, ct), mesh)
        layer = _layer(case, mesh, transport=transport, chunks=chunks)
        compiled = jax.jit(fwd_bwd(layer, 4)).lower(*placed).compile()
        _TIMED[key] = (time_jax(compiled, *placed) * 1e3, *_trace_split(compiled, placed))
    return _TIMED[key]


def scaling(case, peers, args):
    rows = []
    for transport in args.transports:
        ms, comm_ms, _, gemm_ms, top = _timed(case, peers, args, transport, chunks=args.chunks[0])
        row = {"section": "scaling", "case": case["name"], "peers": peers, "transport": transport,
               "chunks": args.chunks[0], "tokens_per_device": args.tokens_per_device, "fwd_bwd_ms": ms,
               "tokens_per_s": peers * args.tokens_per_device / ms * 1e3, "comm_ms": comm_ms or None,
               "comm_share": comm_ms / ms if comm_ms else None, "gemm_ms": gemm_ms or None, "kernels": top}
        rows.append(row)
        print(row, flush=True)
    return rows


def overlap(case, peers, args):
    rows = []
    for transport in args.transports:
        for chunks in args.chunks:
            ms, comm_ms, kernels_ms, gemm_ms, top = _timed(case, peers, args, transport, chunks)
            hidden = min(1.0, max(0.0, (comm_ms + kernels_ms - ms) / comm_ms)) if comm_ms else None
            row = {"section": "overlap", "case": case["name"], "peers": peers, "transport": transport,
                   "chunks": chunks, "fwd_bwd_ms": ms, "comm_ms": comm_ms or None, "gemm_ms": gemm_ms or None,
                   "kernels_ms": kernels_ms or None, "hidden": hidden, "kernels": top}
            rows.append(row)
            print(row, flush=True)
    return rows


def memory(case, peers, args):
    mesh = Mesh(np.array(jax.devices()[:peers]), ("ep",))
    hidden, ffn, experts, _ = _dims(case, args.scale)
    inputs, ct = moe_input_shapes(peers * args.tokens_per_device, hidden, ffn, experts, NamedSharding(mesh, P("ep")))
    row = {"section": "memory", "case": case["name"], "peers": peers}
    for name, cf in (("worst", None), (f"cf{args.capacity_factor:g}", args.capacity_factor)):
        layer = _layer(case, mesh, capacity_factor=cf)
        row[f"fwd_bwd_gib_{name}"] = gib(fwd_bwd_memory_bytes(layer, inputs, ct))
    print(row, flush=True)
    return [row]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", default=["qwen3-30b-a3b", "deepseek-v3-like"])
    parser.add_argument("--peers", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--tokens-per-device", type=int, default=4096)
    parser.add_argument("--scale", type=float, default=1.0, help="scale H and F (smoke runs)")
    parser.add_argument("--transports", nargs="*", default=["padded", "ragged"])
    parser.add_argument("--chunks", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--skip", nargs="*", default=[], choices=["check", "scaling", "overlap", "memory"])
    args = parser.parse_args()
    peers = [p for p in args.peers if p <= len(jax.devices())]
    if len(peers) < len(args.peers):
        print(f"ep_scaling: {len(jax.devices())} devices: EP sizes {peers} only", flush=True)
    rows = []
    for case in CASES["moe_layer"]:
        if case["name"] not in args.cases:
            continue
        if "check" not in args.skip:
            for p in peers:
                if p > 1 and case["E"] % p == 0:
                    rows += check(case, p, args)
        if "scaling" not in args.skip:
            for p in peers:
                if case["E"] % p == 0:
                    rows += scaling(case, p, args)
        if "overlap" not in args.skip and max(peers) > 1:
            rows += overlap(case, max(peers), args)
        if "memory" not in args.skip:
            rows += memory(case, max(peers), args)
    columns = ["section", "case", "peers", "routing", "transport", "chunks", "bitwise_fwd", "rel_err_fwd_dedup",
               "rel_err_dx", "rel_err_dw_in", "fwd_bwd_ms", "tokens_per_s", "comm_ms", "comm_share", "gemm_ms",
               "hidden",
               "fwd_bwd_gib_worst", f"fwd_bwd_gib_cf{args.capacity_factor:g}"]
    write_results(args.out, f"ep_scaling_{jax.devices()[0].platform}{len(jax.devices())}", environment(), rows, columns)


if __name__ == "__main__":
    main()
