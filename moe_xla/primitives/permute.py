"""permute: dispatch of MoE tokens into expert order (definition in common/routing.h).

    x [T, H], expert_ids [T, k] int32, num_experts E
      -> x_sorted [T*k, H], group_sizes [E] int32, row_map [T*k] int32 (, row_pairs [T*k] int32)
    x_sorted[row_map[t*k + j]] = x[t]; rows grouped by expert, in token order within an
    expert (a stable counting sort); assignments to ids outside [0, E) go past every group.
    row_map is a permutation of [0, T*k); row_pairs is its inverse, row_pairs[row_map[i]] = i:
    the assignment t*k + j each sorted row holds (the sort's order). The kernels write it with
    row_map, so that a consumer of the inverse (a gather from the tokens, the combine's
    transpose) needs no scatter to compute it.

permute is linear in x (for fixed expert_ids):
    d x[t] = sum_j ct[row_map[t*k + j]] = unpermute(ct, row_map, ones)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._lib as _lib
import moe_xla._rows as _rows
from moe_xla.primitives import _ad, _batching, _checks, _impl, _lowering, _sharding

permute_p = Primitive("moe_xla_permute")
permute_p.multiple_results = True


def permute(x, expert_ids, num_experts, *, return_row_pairs=False):
    """Groups the T*k (token, expert) assignments by expert: (x_sorted, group_sizes, row_map),
    and row_pairs, the inverse of row_map, with return_row_pairs. See the module docstring."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"permute: expected a positive int num_experts, got {num_experts!r}")
    out = tuple(permute_p.bind(x, expert_ids, num_experts=num_experts))
    return out if _checks.static_bool("permute", "return_row_pairs", return_row_pairs) else out[:3]


def _abstract_eval(x, expert_ids, *, num_experts):
    _checks.rank("permute", "x", x, 2, "[T, H]")
    _checks.rank("permute", "expert_ids", expert_ids, 2, "[T, k]")
    _checks.float_dtype("permute", "x", x)
    _checks.int32("permute", "expert_ids", expert_ids)
    _checks.dim("permute", "expert_ids.shape[0] (T of x [T, H])", x.shape[0], expert_ids.shape[0])
    rows = expert_ids.shape[0] * expert_ids.shape[1]
    return [jax.core.ShapedArray((rows, x.shape[1]), x.dtype),
            jax.core.ShapedArray((num_experts,), jnp.int32),
            jax.core.ShapedArray((rows,), jnp.int32),
            jax.core.ShapedArray((rows,), jnp.int32)]


def _jvp(primals, tangents, *, num_experts):
    x, expert_ids = primals
    d_x, _ = tangents
    out = permute_p.bind(x, expert_ids, num_experts=num_experts)
    if type(d_x) is ad.Zero:
        d_sorted = _ad.zero_tangent(out[0])
    else:
        d_sorted = permute_p.bind(d_x, expert_ids, num_experts=num_experts)[0]
    return out, [d_sorted, *(_ad.zero_tangent(o) for o in out[1:])]


def _transpose(cts, x, expert_ids, *, num_experts):
    from moe_xla.primitives.unpermute import unpermute_p  # unpermute's rules use permute

    ct_sorted = cts[0]
    if type(ct_sorted) is ad.Zero:
        return ad.Zero(x.aval), None
    t, k = expert_ids.shape
    # row_map and its inverse again, from a zero-width permute: the sort alone, no rows to move.
    _, _, row_map, row_pairs = permute_p.bind(jnp.zeros((t, 0), x.aval.dtype), expert_ids, num_experts=num_experts)
    return unpermute_p.bind(ct_sorted, row_map, row_pairs, unique_rows=True, has_row_pairs=True, unit_k=k), None


def _batch(args, dims, *, num_experts):
    (x, ids), _ = _batching.all_to_front(args, dims)
    b, t, k = ids.shape
    # Batch element b owns experts [b (E+1), (b+1) (E+1)); its last one collects the
    # invalid assignments, so each element's rows stay in its own block of T*k rows.
    folded = _batching.folded_rows(jnp.where(_rows.names_row(ids, num_experts), ids, num_experts), num_experts + 1)
    x_sorted, group_sizes, row_map, row_pairs = permute_p.bind(
        x.reshape(b * t, x.shape[-1]), folded.reshape(b * t, k), num_experts=b * (num_experts + 1))
    rows = t * k
    # Element b's assignments and rows are both the block [b * rows, (b + 1) * rows).
    offset = (jnp.arange(b, dtype=jnp.int32) * rows)[:, None]
    return [x_sorted.reshape(b, rows, x.shape[-1]), group_sizes.reshape(b, num_experts + 1)[:, :num_experts],
            row_map.reshape(b, rows) - offset, row_pairs.reshape(b, rows) - offset], [0, 0, 0, 0]


def _cuda_workspace(x, expert_ids, *, num_experts):
    return _lib.cuda_workspace_bytes("MoeXlaPermuteWorkspaceBytes", x.shape[0], x.shape[1],
                                     expert_ids.shape[1], num_experts)


_impl.def_jitted_impl(permute_p)
permute_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[permute_p] = _jvp
ad.primitive_transposes[permute_p] = _transpose
batching.primitive_batchers[permute_p] = _batch
_lowering.register(permute_p, "permute", lambda **_: {}, cuda_workspace=_cuda_workspace,
                   sharding=_sharding.PERMUTE)
