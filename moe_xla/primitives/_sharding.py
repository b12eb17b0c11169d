"""Sharding rules of the moe_xla primitives (custom_partitioning of their lowerings).

What each op splits without communication:
  gmm      along N (column-parallel expert weights); along K it ends in one all-reduce;
  gather_gmm  as gmm;
  gather_gmm_activate  along N for the plain activations (elementwise after the whole K
           sum, so K stays whole); gated ones keep N whole (a shard of w_in's gate | up
           columns would not hold both halves of its outputs);
  tgmm     along K and N of the weight gradient;
  gather_tgmm  as tgmm;
  route    along tokens T;
  permute, unpermute  along the hidden dimension H. Along tokens they cannot: x_sorted
           is one sort of all T*k assignments by expert, so a token-split permute would
           be a different op: the all-to-all dispatch of moe_xla.ep (expert
           parallelism). A T-sharded input is gathered (need_replication).
  ep_dedup_rows, ep_row_places  nothing: their outputs hold global row and token
           indices. The EP layer runs them inside shard_map on each rank's tokens;
           elsewhere a sharded input is gathered.

Under `jax.jit` with sharded inputs on a mesh of several devices (and outside a fully
manual `shard_map`), a primitive's FFI call is wrapped in
`jax.experimental.custom_partitioning`: Shardy propagates shardings through it with a
rule string (`sharding_rule`), and XLA's SPMD partitioner asks `partition` for the
per-shard program, which is the same primitive on local shapes (lowered to the same
`moe_xla_<op>_<platform>_v1` custom call) followed, for a sharded contraction factor,
by one `psum` over the mesh axes of that factor. Everywhere else (one device, inside
shard_map, the per-shard program itself) the FFI call is emitted directly.

AD and vmap stay on the primitives (their JVP / transpose / batching rules bind the
primitives again), so every derivative is partitioned by the same rules.

A rule is a `Rule`: an einsum-like Shardy rule string and `specs(arg_specs, **params)`,
which maps the operands' PartitionSpecs to the specs the op runs with
(operands, results, and the mesh axes to sum the results over).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_xla.primitives._activation import GATED

# Private JAX APIs (checked on 0.10.2): the lowering contexts that carry the mesh, and the
# registry of primitives that get the device assignment while lowering. Where a JAX
# version lacks them, the primitives lower without sharding rules (XLA then gathers
# around the calls) instead of failing to import.
try:
    from jax._src import dispatch as _dispatch
    from jax._src import sharding_impls as _sharding_impls

    _DEVICES_DURING_LOWERING = _dispatch.prim_requires_devices_during_lowering
    _SPMD_CONTEXT = _sharding_impls.SPMDAxisContext
    _SHARDING_CONTEXT = _sharding_impls.ShardingContext
except (ImportError, AttributeError):
    _DEVICES_DURING_LOWERING = None

Axes = tuple  # mesh axis names of one dimension, () when replicated
TILE = 128    # the FP8 tile edge (common/fp8_blockwise.h)


@dataclasses.dataclass(frozen=True)
class Rule:
    sharding_rule: Callable[..., str]          # (**params) -> Shardy rule string
    specs: Callable                            # (arg_axes, **params) -> (in_axes, out_axes, sum_axes)
    need_replication: tuple[str, ...] = ()   # those the rule string of a call's params uses are applied
    reduction: tuple[str, ...] = ()
    # (operand, dim) pairs split only into whole FP8 tiles of 128: a split that would cut a
    # tile (its scale belongs to one shard) is dropped, the dimension then stays whole.
    whole_tiles: tuple[tuple[int, int], ...] = ()


def axes(entry) -> Axes:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def entry(ax: Axes):
    return None if not ax else ax[0] if len(ax) == 1 else tuple(ax)


def _arg_axes(arg_shapes, whole_tiles=()):
    out = []
    for a in arg_shapes:
        spec = tuple(a.sharding.spec) if isinstance(a.sharding, NamedSharding) else ()
        spec = spec + (None,) * (len(a.shape) - len(spec))
        out.append([axes(e) for e in spec])
    for arg, dim in whole_tiles:
        ax = out[arg][dim]
        shards = math.prod(arg_shapes[arg].sharding.mesh.shape[name] for name in ax) if ax else 1
        if arg_shapes[arg].shape[dim] % (shards * TILE) != 0:
            out[arg][dim] = ()
    return [tuple(a) for a in out]


def needs_partitioning(ctx) -> bool:
    """Whether the call is lowered for SPMD partitioning over several devices.

    Mirrors jax's custom_partitioning lowering, which inlines its body on one device
    and in a fully manual context; there the FFI call is emitted directly.
    """
    if _DEVICES_DURING_LOWERING is None:
        return False
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _SPMD_CONTEXT):
        if set(axis_context.manual_axes) == set(axis_context.mesh.axis_names):
            return False
        devices = axis_context.mesh._flat_devices_tuple
    elif isinstance(axis_context, _SHARDING_CONTEXT):
        devices = axis_context.device_assignment
    else:
        devices = None
    return bool(devices) and len(devices) > 1


def _named(mesh, ax_per_dim):
    return NamedSharding(mesh, P(*(entry(a) for a in ax_per_dim)))


@functools.lru_cache(maxsize=None)
def partitioned(prim, rule: Rule, params: tuple):
    """A custom_partitioning function binding `prim` with `params` (sorted items)."""
    params = dict(params)
    multiple = prim.multiple_results

    def body(*args):
        out = prim.bind(*args, **params)
        return tuple(out) if multiple else out

    fn = custom_partitioning(body)

    def plan(arg_shapes):
        return rule.specs(_arg_axes(arg_shapes, rule.whole_tiles), **params)

    def shardings(mesh, out_axes):
        out = tuple(_named(mesh, a) for a in out_axes)
        return out if multiple else out[0]

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, plan(arg_shapes)[1])

    def partition(mesh, arg_shapes, result_shape):
        in_axes, out_axes, sum_axes = plan(arg_shapes)
        local_params = dict(params)
        out_dtype = params.get("preferred_element_type")
        if sum_axes and out_dtype is not None and jnp.dtype(out_dtype).itemsize < 4:
            local_params["preferred_element_type"] = jnp.dtype(jnp.float32)  # sum partials in f32

        def lower(*args):
            out = prim.bind(*args, **local_params)
            if sum_axes:
                out = jax.lax.psum(out, sum_axes)
                if out_dtype is not None:
                    out = out.astype(out_dtype)
            return tuple(out) if multiple else out

        return mesh, lower, shardings(mesh, out_axes), tuple(_named(mesh, a) for a in in_axes)

    rule_string = rule.sharding_rule(**params)
    used = set(rule_string.replace(",", " ").replace("->", " ").split())
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule_string,
                     need_replication_factors=tuple(f for f in rule.need_replication if f in used),
                     reduction_factors=rule.reduction)
    return fn


def lowering(prim, rule: Rule):
    """The lowering of `prim` that partitions it with `rule` (used when needs_partitioning)."""
    # custom_partitioning needs the device assignment while lowering, which jit passes
    # only for the primitives in this registry (jax's cuDNN attention does the same).
    if _DEVICES_DURING_LOWERING is not None:
        _DEVICES_DURING_LOWERING.add(prim)

    def lower(ctx, *args, **params):
        fn = partitioned(prim, rule, tuple(sorted(params.items())))
        return mlir.lower_fun(fn, multiple_results=prim.multiple_results)(ctx, *args)

    return lower


# --- the rules --------------------------------------------------------------------------

def _gmm_specs(arg_axes, *, transpose_rhs, **_):
    lhs, rhs, _gs = arg_axes
    n_dim, k_dim = (1, 2) if transpose_rhs else (2, 1)
    n = rhs[n_dim]
    k = lhs[1] or rhs[k_dim]
    if set(k) & set(n):
        k = ()
    rhs_out = [(), (), ()]
    rhs_out[n_dim], rhs_out[k_dim] = n, k
    return ([((), k), tuple(rhs_out), ((),)], [((), n)], k)


# M rows and groups stay whole: groups are contiguous global row ranges.
GMM = Rule(
    sharding_rule=lambda transpose_rhs, **_: "m k, g n k, g -> m n" if transpose_rhs else "m k, g k n, g -> m n",
    specs=_gmm_specs, need_replication=("m", "g"), reduction=("k",))


def _gather_gmm_specs(arg_axes, *, transpose_rhs, has_token_slots, **_):
    x, _src, w, gs = arg_axes[:4]
    (x_in, w_in, gs_in), out, sums = _gmm_specs([x, w, gs], transpose_rhs=transpose_rhs)
    return [x_in, ((),), w_in, gs_in] + [((), ())] * has_token_slots, out, sums


# As gmm with x in lhs's place: N of w and out split together, K ends in one all-reduce;
# tokens, rows, groups and token_slots stay whole.
GATHER_GMM = Rule(
    sharding_rule=lambda transpose_rhs, has_token_slots, **_: (
        "t k, m, " + ("g n k" if transpose_rhs else "g k n") + ", g" + ", t j" * has_token_slots + " -> m n"),
    specs=_gather_gmm_specs, need_replication=("t", "m", "g", "j"), reduction=("k",))


def _gather_gmm_activate_specs(arg_axes, *, activation):
    n = () if activation in GATED else arg_axes[2][2]
    return [((), ()), ((),), ((), (), n), ((),)], [((), n)], ()


# Gated: N (c) and F (f) are separate factors, both whole.
GATHER_GMM_ACTIVATE = Rule(
    sharding_rule=lambda activation: "t k, m, g k c, g -> m f" if activation in GATED else "t k, m, g k n, g -> m n",
    specs=_gather_gmm_activate_specs, need_replication=("t", "m", "g", "k", "c", "f"))


def _tgmm_specs(arg_axes, **_):
    lhs, rhs, _gs = arg_axes
    k, n = lhs[1], rhs[1]
    if set(k) & set(n):
        n = ()
    return ([((), k), ((), n), ((),)], [((), k, n)], ())


TGMM = Rule(sharding_rule=lambda **_: "m k, m n, g -> g k n", specs=_tgmm_specs,
            need_replication=("m", "g"))


def _gather_tgmm_specs(arg_axes, *, transpose_out, **_):
    x, _src, dy, gs = arg_axes
    (x_in, dy_in, gs_in), [(g, k, n)], sums = _tgmm_specs([x, dy, gs])
    return [x_in, ((),), dy_in, gs_in], [(g, n, k) if transpose_out else (g, k, n)], sums


# As tgmm with x in lhs's place: K of x and N of dy split the weight gradient's blocks
# ([G, N, K] with transpose_out) with no communication; tokens, rows and groups stay whole.
GATHER_TGMM = Rule(
    sharding_rule=lambda transpose_out, **_: "t k, m, m n, g -> " + ("g n k" if transpose_out else "g k n"),
    specs=_gather_tgmm_specs, need_replication=("t", "m", "g"))


def _route_specs(arg_axes, *, has_bias, **_):
    t = arg_axes[0][0]
    return ([(t, ())] + [((),)] * has_bias, [(t, ()), (t, ())], ())


# Tokens are independent: split along T, experts and the top_k slots stay whole.
ROUTE = Rule(sharding_rule=lambda has_bias, **_: "t e" + ", e" * has_bias + " -> t k, t k", specs=_route_specs,
             need_replication=("e", "k"))


def _route_grad_specs(arg_axes, **_):
    t = arg_axes[0][0]
    return ([(t, ()), (t, ()), (t, ())], [(t, ())], ())


# route's backward: tokens split along T, experts and the top_k slots stay whole.
ROUTE_GRAD = Rule(sharding_rule=lambda **_: "t e, t k, t k -> t e", specs=_route_grad_specs,
                  need_replication=("e", "k"))


def _permute_specs(arg_axes, **_):
    h = arg_axes[0][1]
    return ([((), h), ((), ())], [((), h), ((),), ((),), ((),)], ())


# Split along H only; the sort (group_sizes, row_map, row_pairs) is replicated work on every shard.
PERMUTE = Rule(sharding_rule=lambda **_: "t h, t k -> r h, e, r, r", specs=_permute_specs,
               need_replication=("t", "k", "r", "e"))


def _unpermute_specs(arg_axes, *, has_row_pairs, unit_k, **_):
    h = arg_axes[0][1]
    weights = [((), ())] * (unit_k is None)
    return ([((), h), ((),)] + weights + [((),)] * has_row_pairs, [((), h)], ())


UNPERMUTE = Rule(sharding_rule=lambda has_row_pairs, unit_k, **_: (
                     "s h, r" + ", t k" * (unit_k is None) + ", s" * has_row_pairs + " -> t h"),
                 specs=_unpermute_specs,
                 need_replication=("s", "r", "t", "k"))


def _replicated(arg_axes, results: tuple[int, ...]):
    """Every operand and result whole (results: their ranks)."""
    return [tuple(() for _ in a) for a in arg_axes], [tuple(() for _ in range(r)) for r in results], ()


# Global indices in the outputs (weight slots, grouped rows, senders): nothing splits.
EP_DEDUP_ROWS = Rule(sharding_rule=lambda **_: "t k, t k -> t k, r m, p, s",
                     specs=lambda arg_axes, **_: _replicated(arg_axes, (2, 2, 1, 1)),
                     need_replication=("t", "k", "r", "m", "p", "s"))
EP_ROW_PLACES = Rule(sharding_rule=lambda **_: "t k, p, r m -> t n, t n, p, p",
                     specs=lambda arg_axes, **_: _replicated(arg_axes, (2, 2, 1, 1)),
                     need_replication=("t", "k", "p", "r", "m", "n"))
