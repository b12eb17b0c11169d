"""Benchmark: the FP8 blockwise quantisation kernels (moe_xla.quantize_fp8_rows and
quantize_fp8_blocks) in GB/s of compulsory traffic, against a device-to-device copy of
the same bytes in the same run (jnp.copy, which XLA:GPU runs as a memcpy; an elementwise
y = -x, this benchmark's baseline until session 21, moves only about 0.8 of its GB/s).

Ops: rows (quantize_fp8_rows), blocks (quantize_fp8_blocks), weights
(quantize_fp8_weights: the blocks in both layouts, q and q transposed, from one kernel),
group_cols (quantize_fp8_group_cols of the activations with the case's G uniform groups:
the FP8 wgrad's 128-row column tiles, written transposed), rows_group_cols
(quantize_fp8_rows_group_cols: both from one read, what gmm's FP8 wgrad runs on x and dy)
and rows_then_group_cols (the two kernels one after the other; the same compulsory bytes
counted), and on the gate_up cases'
products h [M, N] = gate | up: swiglu_rows (activate_quantize_fp8: swiglu and its row
quantisation in one kernel, what the FP8 expert MLP runs) and swiglu_then_rows (XLA's
swiglu, then quantize_fp8_rows of it); their routing-weighted backward with g [M, N/2] and
omega [M]: swiglu_grad_rows (activate_grad_quantize_fp8: d h, its row quantisation and
d omega in one kernel, what the FP8 expert MLP's backward runs) and swiglu_grad_then_rows
(XLA's derivative of omega * swiglu, then quantize_fp8_rows of d h); on the rows [M, K] of every case as the combine's backward
makes them from M / 8 token rows (each token's 8 rows at random places, or as
--row-order says: row_slots; a weight each): expand_rows (expand_quantize_fp8_rows: each
token row read once, its weighted rows and the row quantisation of its unweighted ones
written, in one kernel, what the FP8 layer's backward runs) and expand_then_rows (XLA's
weighted and unweighted expansions, _rows.expand_rows, then quantize_fp8_rows of the
unweighted); and from the same token rows and slots the FP8 wgrad's operands of the
rows: gather_group_cols (gather_quantize_fp8_group_cols with each row's weight: every row
read from its token, the row tiles of the unweighted rows and the column tiles of the
weighted ones written, no rows; what the FP8-wgrad layer's backward runs), its forward's
gather_group_cols_unit (no weights) and expand_then_group_cols (expand_quantize_fp8_rows,
then quantize_fp8_group_cols of its weighted rows: what that layer ran before; the same
compulsory bytes counted); on the gate_up products with the case's G uniform groups:
swiglu_group_cols (activate_quantize_fp8_group_cols: a's row and group column tiles from
one read of h, a never written; what the FP8-wgrad layer's forward runs) and
swiglu_then_group_cols (activate_quantize_fp8, then quantize_fp8_group_cols of its a: what
that layer ran before; the same compulsory bytes counted, a's write and read not).

    python benchmarks/fp8_quantize.py [--out benchmarks/results] [--name fp8_quantize] [--ops rows group_cols ...]
                                       [--row-order random|routed|tokens]

Shapes: the activations of the grouped_matmul cases of cases.json (rows [M, K], bf16),
their weights (blocks [G, K, N], bf16) and their products (swiglu [M, N], bf16). Bytes =
input read + q written (1 byte per element, 2 with a transposed copy) + scales written (4
bytes per tile); for swiglu, h read (2 bytes per element) + a written (2 bytes per
output element) + q and scales of a; for its backward, h, g and omega read, d h written with its
q and scales; for the expansions, the M / 8 token rows read once (2 bytes per element),
the rows written with their q and scales (for the group-column ops: q and q_t with their
scales, no rows). The copy moves 2 x the input's bytes (h's; the
expansions: the rows' [M, K]).
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
import moe_xla._rows as _rows
from moe_xla.primitives.expand_quantize_fp8_rows import expand_quantize_fp8_rows


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


ROW_ORDERS = ("random", "routed", "tokens")


def row_slots(order: str, m: int, groups: int):
    """The expansions' slots [m / 8, 8]: the rows of each of m / 8 tokens. "random", a
    token's 8 rows at random places; "routed", as moe() orders them: each token routed to 8
    distinct random experts of the case's groups, rows sorted by expert, tokens ascending
    within one; "tokens", a token's 8 rows adjacent."""
    tokens = m // 8
    if order == "random":
        token_of_row = jax.random.permutation(jax.random.key(3), m) // 8
    elif order == "tokens":
        token_of_row = jnp.arange(m) // 8
    else:
        experts = jnp.argsort(jax.random.uniform(jax.random.key(3), (tokens, groups)), axis=1)[:, :8]
        token_of_row = jnp.argsort(experts.reshape(-1), stable=True) // 8
    return jnp.argsort(token_of_row, stable=True).reshape(tokens, 8).astype(jnp.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="fp8_quantize")
    parser.add_argument("--ops", nargs="*", help="ops to measure (default: all)")
    parser.add_argument("--row-order", choices=ROW_ORDERS, default="random",
                        help="where the expansions' rows of a token lie (see row_slots)")
    args = parser.parse_args()
    copy = jax.jit(jnp.copy)
    def swiglu_then_rows(h):
        a = activate(h, "swiglu")
        return (a, *moe_xla.quantize_fp8_rows(a))

    def swiglu_grad_then_rows(h, g, omega):
        # The weighted activation in h's dtype, as the layer stores it (and as g comes).
        weighted = lambda v, w: (w[:, None] * activate(v, "swiglu")).astype(v.dtype)
        dh, d_omega = jax.vjp(weighted, h, omega)[1](g)
        return (dh, *moe_xla.quantize_fp8_rows(dh), d_omega)

    def expand_then_rows(values, slots, factor):
        rows = _rows.expand_rows(values, slots, factor, num_pairs=slots.size)
        unweighted = _rows.expand_rows(values, slots, jnp.ones_like(factor), num_pairs=slots.size)
        return (rows, *moe_xla.quantize_fp8_rows(unweighted))

    def sources(slots, factor):  # each row's token and weight
        return _rows.expansion_sources(slots, factor.reshape(slots.shape), num_pairs=slots.size)

    ops = {"rows": moe_xla.quantize_fp8_rows, "blocks": moe_xla.quantize_fp8_blocks,
           "weights": moe_xla.quantize_fp8_weights, "swiglu_rows": lambda h: activate_quantize_fp8(h, "swiglu"),
           "swiglu_then_rows": swiglu_then_rows,
           "swiglu_grad_rows": lambda h, g, omega: activate_grad_quantize_fp8(h, g, omega, "swiglu"),
           "swiglu_grad_then_rows": swiglu_grad_then_rows,
           "expand_rows": lambda v, s, f: expand_quantize_fp8_rows(v, s, f, s.size), "expand_then_rows": expand_then_rows}
    if args.ops:
        ops = {name: fn for name, fn in ops.items() if name in args.ops}
    rows = []
    for i, case in enumerate(CASES["grouped_matmul"]):
        m, g, k, n = case["M"], case["G"], case["K"], case["N"]
        gs = jnp.full((g,), m // g, jnp.int32)
        ops_here = dict(ops)
        gathered = {
            "gather_group_cols": lambda v, src, k: moe_xla.gather_quantize_fp8_group_cols(v, src, k, gs),
            "gather_group_cols_unit": lambda v, src, k: moe_xla.gather_quantize_fp8_group_cols(v, src, None, gs),
            "expand_then_group_cols": lambda v, s, f: (lambda rows, q, scales: (
                q, scales, *moe_xla.quantize_fp8_group_cols(rows, gs)))(*expand_quantize_fp8_rows(v, s, f, s.size))}
        cols = {**gathered, "group_cols": lambda x: moe_xla.quantize_fp8_group_cols(x, gs),
                "rows_group_cols": lambda x: moe_xla.quantize_fp8_rows_group_cols(x, gs),
                "rows_then_group_cols": lambda x: (*moe_xla.quantize_fp8_rows(x), *moe_xla.quantize_fp8_group_cols(x, gs)),
                "swiglu_group_cols": lambda h: moe_xla.activate_quantize_fp8_group_cols(h, gs, "swiglu"),
                "swiglu_then_group_cols": lambda h: (lambda a, q, scales: (
                    q, scales, *moe_xla.quantize_fp8_group_cols(a, gs)))(*activate_quantize_fp8(h, "swiglu"))}
        ops_here.update({name: fn for name, fn in cols.items() if not args.ops or name in args.ops})
        for kind in ops_here:
            swiglu = kind.startswith("swiglu")
            if swiglu and not case["name"].endswith("gate_up"):
                continue
            activation = not swiglu and kind in ("rows", "expand_rows", "expand_then_rows", *cols)
            expansion = kind.startswith("expand") or kind in gathered
            shape = (m, k) if activation else (m, n) if swiglu else (g, k, n)
            x = normal(jax.random.fold_in(jax.random.key(1), 3 * i + (kind != "rows") + swiglu), shape, jnp.bfloat16)
            elems = x.size
            args_of = (x,)
            if kind.startswith("swiglu_grad"):  # h, g and omega read, d h written with its q and scales
                args_of = (x, normal(jax.random.fold_in(jax.random.key(2), i), (m, n // 2), jnp.bfloat16),
                           jax.random.uniform(jax.random.key(3), (m,)))
                nbytes = 2 * elems + 2 * (elems // 2) + 4 * m + 2 * elems + elems + elems // 128 * 4
            elif expansion:  # token rows read, rows written with their q and scales (or q and q_t)
                tokens = m // 8
                args_of = (x[:tokens], row_slots(args.row_order, m, g), jax.random.uniform(jax.random.key(4), (tokens, 8)))
                if kind.startswith("gather"):
                    args_of = (x[:tokens], *sources(*args_of[1:]))
                nbytes = 2 * tokens * k + elems + elems // 128 * 4  # token rows, q and its scales
                nbytes += elems + elems // 128 * 4 if kind in gathered else 2 * elems  # q_t and scales, or rows
            elif swiglu and kind.endswith("group_cols"):  # h read, a's q and q_t with their scales written
                nbytes = 2 * elems + 2 * (elems // 2) + 2 * (elems // 2 // 128) * 4
            elif swiglu:  # h read, a written, a's q and scales written
                nbytes = 2 * elems + 2 * (elems // 2) + elems // 2 + elems // 2 // 128 * 4
            elif kind in ("rows_group_cols", "rows_then_group_cols"):  # x read, q and q_t with their scales written
                nbytes = 2 * elems + 2 * elems + 2 * (elems // 128) * 4
            else:
                tiles = elems // 128 if activation else elems // (128 * 128)
                nbytes = elems * 2 + elems * (1 if kind in ("rows", "blocks", "group_cols") else 2) + tiles * 4
            t = time_jax(jax.jit(ops_here[kind]), *args_of)
            t_copy = time_jax(copy, x)
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
