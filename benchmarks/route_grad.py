"""Benchmark: route's backward in logits (the route_grad kernel) in ms, against XLA's
derivative of the jnp weights (jax.vjp of moe_xla.reference.route_weights: softmax or
sigmoid, take_along_axis and its scatter-add transpose) and a plain device copy of the
same bytes, taking turns on the device in the same run (alternating_times).

    python benchmarks/route_grad.py [--out benchmarks/results] [--name route_grad] [--ops route_grad xla copy]

Shapes: benchmarks/route.py's (the router outputs of the benchmark layers), with the
selection of moe_xla.route. Bytes = the logits read and d logits written, the ids and
d weights read (2 T E b + 8 T k); fraction_of_copy = the copy's time / the op's time.
"""

from __future__ import annotations

from _timing import OP_COLUMNS, environment, normal, op_parser, op_rows, write_results
from route import SHAPES

import jax
import jax.numpy as jnp

import moe_xla
from moe_xla import reference
from moe_xla.primitives.route_grad import route_grad


def main():
    args = op_parser(__doc__, "route_grad").parse_args()
    rows = []
    for name, t, e, k, score, n_groups, topk_groups, dtype in SHAPES:
        keys = jax.random.split(jax.random.key(0), 2)
        logits = normal(keys[0], (t, e), dtype)
        groups = dict(n_groups=n_groups, topk_groups=topk_groups) if n_groups > 1 else {}
        _, ids = moe_xla.route(logits, k, score=score, **groups)
        g = normal(keys[1], (t, k), jnp.float32)
        params = dict(score=score, renormalize=True, scale=1.0)
        nbytes = 2 * t * e * jnp.dtype(dtype).itemsize + 8 * t * k
        copied = jnp.zeros((nbytes // 8,), jnp.float32)  # nbytes / 2 read + nbytes / 2 written
        ops = {
            "route_grad": lambda x, i, d, c: route_grad(x, i, d, **params),
            "xla": lambda x, i, d, c: jax.vjp(lambda l: reference.route_weights(l, i, **params), x)[1](d)[0],
            "copy": lambda x, i, d, c: c.copy(),
        }
        shape = f"T{t} E{e} k{k} {score} {jnp.dtype(dtype).name}"
        rows += op_rows(args, name, shape, ops, (logits, ids, g, copied), nbytes)
        del logits, copied
    write_results(args.out, args.name, environment(), rows, OP_COLUMNS)


if __name__ == "__main__":
    main()
