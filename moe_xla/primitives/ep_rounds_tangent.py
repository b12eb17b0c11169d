"""ep_rounds_tangent: the tangent of the EP layer's capacity rounds 1 .. R-1.

    out = sum_{r = 1 .. R-1} J_r d_floats      [T*k, H]

J_r is the Jacobian in `floats` of round r, spec.round_fn(r, floats, ints) (zero for a
round with no rows). Arguments: the leaves of floats, of ints, then of d_floats.
Linear in d_floats, the only arguments it transposes in:
    impl       a loop of R - 1 iterations (static bounds) over jax.jvp of each round
    transpose  d floats = sum_r J_r^T ct, the same loop over jax.vjp of each round
               (recomputed: no round's buffers are stacked or kept)
    batching   `levels` records the vmaps around it (see _vmapped); lowered through jnp.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from moe_xla.primitives._batching import batched_to_front

rounds_tangent_p = Primitive("moe_xla_ep_rounds_tangent")


class RoundsSpec(NamedTuple):
    """Static description of a chunk's rounds 1 .. R-1 (a hashable primitive parameter)."""

    round_fn: object          # (r, floats, ints) -> [T*k, H]
    rounds: int               # R
    floats_tree: object       # pytree structures of floats and ints
    ints_tree: object
    out: jax.core.ShapedArray  # one round's result


def rounds_loop(spec: RoundsSpec, body, init):
    """acc = body(r, acc) for r = 1 .. R-1, from acc = init: a loop whose trip count, R - 1,
    XLA knows (static bounds), so no predicate is read back to the host."""
    return jax.lax.fori_loop(1, spec.rounds, body, init)


def _split_args(spec: RoundsSpec, args):
    n_f, n_i = spec.floats_tree.num_leaves, spec.ints_tree.num_leaves
    floats = jax.tree.unflatten(spec.floats_tree, args[:n_f])
    ints = jax.tree.unflatten(spec.ints_tree, args[n_f:n_f + n_i])
    return floats, ints, args[n_f + n_i:]


# Under vmap, `levels`, outermost first, holds one (size, in_axes) per vmap around the
# primitive, in_axes[i] = 0 where argument i carries that level's batch axis (the leading
# one of those it carries), None where it does not: unbatched arguments (the expert
# weights, in vmap(linearize)) are not broadcast to the batch.

def _vmapped(fn, levels, lead=()):
    """fn vmapped over `levels`; `lead` are the in_axes of extra leading arguments."""
    for _, in_axes in reversed(levels):
        fn = jax.vmap(fn, in_axes=tuple(lead) + tuple(in_axes))
    return fn


def _impl(*args, spec: RoundsSpec, levels):
    def one(*a):
        floats, ints, d_leaves = _split_args(spec, a)
        d_floats = jax.tree.unflatten(spec.floats_tree, d_leaves)

        def body(r, acc):
            return acc + jax.jvp(lambda f: spec.round_fn(r, f, ints), (floats,), (d_floats,))[1]

        return rounds_loop(spec, body, jnp.zeros(spec.out.shape, spec.out.dtype))

    return _vmapped(one, levels)(*args)


def _transpose(ct, *args, spec: RoundsSpec, levels):
    n_known = spec.floats_tree.num_leaves + spec.ints_tree.num_leaves
    known = args[:n_known]
    if any(ad.is_undefined_primal(a) for a in known):
        raise ValueError("moe: the capacity rounds are linear in the tangents of their floats only")
    d_avals = [a.aval for a in args[n_known:]]
    if type(ct) is ad.Zero:
        return [None] * n_known + [ad.Zero(a) for a in d_avals]

    def one(ct, *a):
        floats, ints, _ = _split_args(spec, a)

        def body(r, acc):
            pull = jax.vjp(lambda f: spec.round_fn(r, f, ints), floats)[1]
            return jax.tree.map(jnp.add, acc, pull(ct)[0])

        return jax.tree.leaves(rounds_loop(spec, body, jax.tree.map(jnp.zeros_like, floats)))

    known_levels = tuple((size, in_axes[:n_known]) for size, in_axes in levels)
    d_floats = _vmapped(one, known_levels, lead=(0,))(ct, *known)  # batched at every level
    # A tangent a level does not batch gets the sum of its cotangent over that level.
    return [None] * n_known + [
        jnp.sum(d, axis=tuple(i for i, (_, in_axes) in enumerate(levels) if in_axes[n_known + j] is None))
        for j, d in enumerate(d_floats)]


def _batch(args, dims, *, spec: RoundsSpec, levels):
    args, size = batched_to_front(args, dims)
    in_axes = tuple(None if d is None else 0 for d in dims)
    return rounds_tangent_p.bind(*args, spec=spec, levels=((size, in_axes),) + levels), 0


rounds_tangent_p.def_impl(_impl)
rounds_tangent_p.def_abstract_eval(lambda *args, spec, levels: jax.core.ShapedArray(
    tuple(size for size, _ in levels) + spec.out.shape, spec.out.dtype))
ad.primitive_transposes[rounds_tangent_p] = _transpose
batching.primitive_batchers[rounds_tangent_p] = _batch
mlir.register_lowering(rounds_tangent_p, mlir.lower_fun(_impl, multiple_results=False))
