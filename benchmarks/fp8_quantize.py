"""Benchmark: the FP8 blockwise quantisation kernels (moe_xla.quantize_fp8_rows and
quantize_fp8_blocks) in GB/s of compulsory traffic, against a copy-like elementwise op
(y = -x, which reads and writes every element once) on the same bytes, in the same run.

Ops: rows (quantize_fp8_rows), blocks (quantize_fp8_blocks), weights
(quantize_fp8_weights: the blocks in both layouts, q and q transposed, from one kernel),
group_cols (quantize_fp8_group_cols of the activations with the case's G uniform groups:
the FP8 wgrad's 128-row column tiles, written transposed), and on the gate_up cases'
products h [M, N] = gate | up: swiglu_rows (activate_quantize_fp8: swiglu and its row
quantisation in one kernel, what the FP8 expert MLP runs) and swiglu_then_rows (XLA's
swiglu, then quantize_fp8_rows of it); their backward with da [M, N/2]: swiglu_grad_rows
(activate_grad_quantize_fp8: d h and its row quantisation in one kernel, what the FP8
expert MLP's backward runs) and swiglu_grad_then_rows (XLA's derivative of swiglu, then
quantize_fp8_rows of d h).

    python benchmarks/fp8_quantize.py [--out benchmarks/results] [--name fp8_quantize] [--ops rows group_cols ...]

Shapes: the activations of the grouped_matmul cases of cases.json (rows [M, K], bf16),
their weights (blocks [G, K, N], bf16) and their products (swiglu [M, N], bf16). Bytes =
input read + q written (1 byte per element, 2 with a transposed copy) + scales written (4
bytes per tile); for swiglu, h read (2 bytes per element) + a written (2 bytes per
output element) + q and scales of a; for its backward, h and da read, d h written with its
q and scales. The copy moves 2 x the input's bytes (h's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _timing import CASES, environment, normal, time_jax, write_results

import jax
import jax.numpy as jnp

import moe_xla
from moe_xla.activations import activate
from moe_xla.primitives.activate_grad_quantize_fp8 import activate_grad_quantize_fp8
from moe_xla.primitives.activate_quantize_fp8 import activate_quantize_fp8


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="fp8_quantize")
    parser.add_argument("--ops", nargs="*", help="ops to measure (default: all)")
    args = parser.parse_args()
    negate = jax.jit(jnp.negative)
    def swiglu_then_rows(h):
        a = activate(h, "swiglu")
        return (a, *moe_xla.quantize_fp8_rows(a))

    def swiglu_grad_then_rows(h, da):
        dh = jax.vjp(lambda v: activate(v, "swiglu"), h)[1](da)[0]
        return (dh, *moe_xla.quantize_fp8_rows(dh))

    ops = {"rows": moe_xla.quantize_fp8_rows, "blocks": moe_xla.quantize_fp8_blocks,
           "weights": moe_xla.quantize_fp8_weights, "swiglu_rows": lambda h: activate_quantize_fp8(h, "swiglu"),
           "swiglu_then_rows": swiglu_then_rows,
           "swiglu_grad_rows": lambda h, da: activate_grad_quantize_fp8(h, da, "swiglu"),
           "swiglu_grad_then_rows": swiglu_grad_then_rows}
    if args.ops:
        ops = {name: fn for name, fn in ops.items() if name in args.ops}
    rows = []
    for i, case in enumerate(CASES["grouped_matmul"]):
        m, g, k, n = case["M"], case["G"], case["K"], case["N"]
        gs = jnp.full((g,), m // g, jnp.int32)
        ops_here = dict(ops)
        if not args.ops or "group_cols" in args.ops:
            ops_here["group_cols"] = lambda x: moe_xla.quantize_fp8_group_cols(x, gs)
        for kind in ops_here:
            swiglu = kind.startswith("swiglu")
            if swiglu and not case["name"].endswith("gate_up"):
                continue
            activation = kind in ("rows", "group_cols")
            shape = (m, k) if activation else (m, n) if swiglu else (g, k, n)
            x = normal(jax.random.fold_in(jax.random.key(1), 3 * i + (kind != "rows") + swiglu), shape, jnp.bfloat16)
            elems = x.size
            args_of = (x,)
            if kind.startswith("swiglu_grad"):  # h and da read, d h written with its q and scales
                args_of = (x, normal(jax.random.fold_in(jax.random.key(2), i), (m, n // 2), jnp.bfloat16))
                nbytes = 2 * elems + 2 * (elems // 2) + 2 * elems + elems + elems // 128 * 4
            elif swiglu:  # h read, a written, a's q and scales written
                nbytes = 2 * elems + 2 * (elems // 2) + elems // 2 + elems // 2 // 128 * 4
            else:
                tiles = elems // 128 if activation else elems // (128 * 128)
                nbytes = elems * 2 + elems * (1 if kind in ("rows", "blocks", "group_cols") else 2) + tiles * 4
            t = time_jax(jax.jit(ops_here[kind]), *args_of)
            t_copy = time_jax(negate, x)
            row = {"case": case["name"], "op": kind, "shape": "x".join(map(str, shape)), "ms": t * 1e3,
                   "gbps": _gbps(nbytes, t), "copy_gbps": _gbps(4 * elems, t_copy)}
            row["fraction_of_copy"] = row["gbps"] / row["copy_gbps"]
            rows.append(row)
            print(row, flush=True)
            del x, args_of
    write_results(args.out, args.name, environment(), rows,
                  ["case", "op", "shape", "ms", "gbps", "copy_gbps", "fraction_of_copy"])


if __name__ == "__main__":
    main()
