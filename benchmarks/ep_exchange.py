"""Benchmark: what the expert-parallel layer sends and holds per rank, with and without
token deduplication and capacity_factor, on the moe_layer cases of cases.json.

    python benchmarks/ep_exchange.py [--out benchmarks/results] [--cases NAME ...] [--peers 8]
                                     [--tokens-per-rank 4096] [--capacity-factor 1.25]

Runs on any backend; on a machine without GPUs it makes --peers CPU devices itself.

Wire traffic. The benchmark routing (normal router logits, the case's score / groups, bf16
activations, seed 0) is computed with moe_xla.route for peers x tokens-per-rank tokens;
rank r holds tokens [r T_r, (r+1) T_r). A row is sent to destination rank d != r (rows to
the own rank cross no link) and comes back once:
  no dedup  one row per (token, j) whose expert lives on d;
  dedup     one row per (token, d) with at least one of the token's experts on d;
bytes = rows * (2 H * 2 (bf16 there and back) + m), m the dispatch's per-row metadata: the
local expert id (int32), with dedup ids and routing weights (float32) of min(k, E/P)
experts. These are the ragged transport's bytes; the padded transport sends whole slabs
of activations whatever the routing (padded_*: one chunk, both directions, other ranks).

Memory per rank: XLA's compile-time memory_analysis() (temp + arguments + outputs) of the
EP layer's forward and forward+backward (jax.grad of sum(y * ct), the cotangent ct an f32
argument) programs on the mesh, per device, inputs split as the layer wants them (tokens
and experts over the expert axis), for each (dedup, capacity_factor) setting; nothing is
run, so full-size cases compile on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--help" not in sys.argv and "-h" not in sys.argv:
    _peers = int(sys.argv[sys.argv.index("--peers") + 1]) if "--peers" in sys.argv else 8
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_peers}")

from pathlib import Path  # noqa: E402

from _timing import (CASES, compiled_memory_bytes, environment, fwd_bwd_memory_bytes, gib, moe_input_shapes,  # noqa: E402
                     routing_options, write_results)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_xla  # noqa: E402
from moe_xla.ep import sizing  # noqa: E402

MIB = 2**20


def _routing(case, tokens):
    logits = jax.random.normal(jax.random.key(0), (tokens, case["E"]), jnp.float32)
    _, ids = moe_xla.route(logits, **routing_options(case))
    return np.asarray(ids)


def wire_rows(ids, peers, num_experts):
    """Rows that cross a link, summed over ranks: (without dedup, with dedup)."""
    tokens = ids.shape[0]
    dest = ids // (num_experts // peers)
    home = (np.arange(tokens) // (tokens // peers))[:, None]
    plain = int(np.sum(dest != home))
    distinct = np.zeros((tokens, peers), bool)
    np.put_along_axis(distinct, dest, True, axis=1)
    distinct[np.arange(tokens), home[:, 0]] = False
    return plain, int(distinct.sum())


def _memory(case, mesh, tokens, dedup, capacity_factor):
    inputs, ct = moe_input_shapes(tokens, case["H"], case["F"], case["E"], NamedSharding(mesh, P("ep")))

    def layer(*a):
        return moe_xla.moe(*a, **routing_options(case), mesh=mesh, expert_axis="ep", transport="padded",
                           dedup=dedup, capacity_factor=capacity_factor)

    return compiled_memory_bytes(jax.jit(layer).lower(*inputs).compile()), fwd_bwd_memory_bytes(layer, inputs, ct)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--no-memory", action="store_true", help="skip the compile-time memory figures")
    args = parser.parse_args()
    peers, per_rank = args.peers, args.tokens_per_rank
    if len(jax.devices()) < peers:
        sys.exit(f"ep_exchange: needs {peers} devices, found {len(jax.devices())}")
    mesh = Mesh(np.array(jax.devices()[:peers]), ("ep",))
    rows = []
    for case in CASES["moe_layer"]:
        if args.cases and case["name"] not in args.cases:
            continue
        tokens, hidden, k, experts = peers * per_rank, case["H"], case["top_k"], case["E"]
        mult = min(k, experts // peers)
        plain, dedup = wire_rows(_routing(case, tokens), peers, experts)
        row_bytes = hidden * 2
        row = {"case": case["name"], "peers": peers, "tokens_per_rank": per_rank,
               "rows_no_dedup": plain, "rows_dedup": dedup, "row_ratio": dedup / plain if plain else None,
               "wire_mib_per_rank_no_dedup": plain * (2 * row_bytes + 4) / peers / MIB,
               "wire_mib_per_rank_dedup": dedup * (2 * row_bytes + 8 * mult) / peers / MIB}
        row["wire_ratio"] = row["wire_mib_per_rank_dedup"] / row["wire_mib_per_rank_no_dedup"] if plain else None
        for name, on in (("no_dedup", False), ("dedup", True)):
            sizes = sizing.exchange_sizes(per_rank, k, experts, peers, dedup=on)  # one chunk (moe's default)
            row[f"padded_mib_per_rank_{name}"] = 2 * sizes.rows * (peers - 1) * row_bytes / MIB
        if not args.no_memory:
            for name, on in (("no_dedup", False), ("dedup", True)):
                for cf_name, cf in (("worst", None), (f"cf{args.capacity_factor:g}", args.capacity_factor)):
                    fwd, bwd = _memory(case, mesh, tokens, on, cf)
                    row[f"mem_gib_fwd_{name}_{cf_name}"] = gib(fwd)
                    row[f"mem_gib_fwdbwd_{name}_{cf_name}"] = gib(bwd)
        rows.append(row)
        print(row, flush=True)
    columns = ["case", "rows_no_dedup", "rows_dedup", "wire_mib_per_rank_no_dedup", "wire_mib_per_rank_dedup",
               "wire_ratio", "padded_mib_per_rank_no_dedup", "padded_mib_per_rank_dedup"]
    columns += [c for c in (rows[0] if rows else {}) if c.startswith("mem_gib")]
    write_results(args.out, f"ep_exchange_{jax.devices()[0].platform}", environment(), rows, columns)


if __name__ == "__main__":
    main()
