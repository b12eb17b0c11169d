"""gather_tgmm: the weight gradient of the gathered first expert product.

    out[g] = sum_{r in rows of g} x_r (outer) dy[r] = x[src]_g^T dy_g     [K, N]
           = tgmm(gather_rows(x, src), dy, group_sizes)[g]
    with transpose_out, each block's transpose:
    out[g] = sum_{r in rows of g} dy[r] (outer) x_r = dy_g^T x[src]_g     [N, K]
           = tgmm(dy, gather_rows(x, src), group_sizes)[g]

x [T, K]; src [M] int32 (x_r = x[src[r]], a zero row where src[r] is outside [0, T);
x[src]_g and dy_g are the rows of group g); dy [M, N]; group_sizes [G] int32, clamped to
the M rows as tgmm's -> out [G, K, N], or [G, N, K] with transpose_out (written in that
layout, not transposed afterwards). Groups with no rows give zero blocks; rows past
sum(group_sizes) take no part (no group's block reads them, so non-finite values there never
reach out). Accumulation is float32; the output dtype is preferred_element_type, or
x.dtype. It is gather_gmm's gradient in w (out = d w for ct = dy; with transpose_out, that
of w [G, N, K] under transpose_rhs), without the permuted copy of x in memory.

Where it runs: on CUDA the kernel of cuda/gather_tgmm.h when it supports the case, decided
when lowering from the shapes and dtypes (kernel_supports: bf16 x and dy, bf16 or float32
out, K and N multiples of 8) and the local GPUs (Hopper, compute capability 9.0; with no
local GPU the kernel is assumed and its handler checks the device). Everywhere else (CPU,
other GPUs, other cases) it lowers to its decomposition, gather_rows + the tgmm primitive,
so every platform computes the same contract. The kernel is deterministic: each output
element is summed by one CTA over the group's rows in order.

gather_tgmm is bilinear in (x, dy). At a cotangent ct [G, K, N] ([G, N, K] with
transpose_out), read in the layout it is stored in (the products' transpose_rhs does the
transposing, no swapped copy of ct is written):
    d dy_g       = x[src]_g ct[g]   (x[src]_g ct[g]^T with transpose_out; rows past the groups 0)
                 = gather_gmm(x, src, ct, group_sizes, transpose_rhs=transpose_out)
    d x_sorted_g = dy_g ct[g]^T     (dy_g ct[g] with transpose_out)
                 = gmm(dy, ct, group_sizes, transpose_rhs=not transpose_out),
    summed back to tokens: d x[t] = sum_{r: src[r] = t} d x_sorted[r]  (deterministic:
    _rows.sum_rows_into).
That transpose is registered in gather_gmm.py: gather_gmm's transpose in w is a
gather_tgmm, so one of the two files holds both directions and imports the other, and the
imports stay acyclic (as gmm.py does for tgmm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._lib as _lib
from moe_xla.primitives import _ad, _batching, _checks, _gather_kernel, _impl, _lowering, _sharding
from moe_xla.primitives.gather_rows import gather_rows
from moe_xla.primitives.tgmm import tgmm_p

gather_tgmm_p = Primitive("moe_xla_gather_tgmm")


def gather_tgmm(x, src, dy, group_sizes, *, transpose_out=False, preferred_element_type=None):
    """Grouped transposed matmul of gathered rows: out[g] = x[src[rows of g]]^T @ dy[rows of g]
    [G, K, N], or its transpose dy[rows of g]^T @ x[src[rows of g]] [G, N, K] with
    transpose_out. See the module docstring; G is the length of group_sizes."""
    transpose_out = _checks.static_bool("gather_tgmm", "transpose_out", transpose_out)
    out_dtype = _checks.out_dtype("gather_tgmm", preferred_element_type, getattr(x, "dtype", jnp.float32))
    return gather_tgmm_p.bind(x, src, dy, group_sizes, transpose_out=transpose_out, preferred_element_type=out_dtype)


def kernel_supports(x_shape, dy_shape, num_groups: int, in_dtype, out_dtype) -> bool:
    """Whether the CUDA kernel computes this case: x [T, K] and dy [M, N] in bf16, G blocks
    in bf16 or float32, K and N multiples of 8 (16-byte rows), every size at most
    2^31 - 256. Either output layout (transpose_out) has the same conditions."""
    (t, k), (m, n) = x_shape, dy_shape
    return _gather_kernel.supports(t, m, k, n, num_groups, in_dtype, out_dtype)


def _abstract_eval(x, src, dy, group_sizes, *, transpose_out, preferred_element_type):
    _checks.gather_inputs("gather_tgmm", x, src, "dy", dy, 2, "[M, N]")
    _checks.dim("gather_tgmm", "dy.shape[0] (M of src [M])", src.shape[0], dy.shape[0])
    _checks.group_sizes("gather_tgmm", group_sizes)
    k, n = x.shape[1], dy.shape[1]
    block = (n, k) if transpose_out else (k, n)
    return jax.core.ShapedArray((group_sizes.shape[0], *block), preferred_element_type)


def _decomposition(x, src, dy, group_sizes, *, transpose_out, preferred_element_type):
    """tgmm(gather_rows(x, src), dy, group_sizes), or with transpose_out tgmm(dy,
    gather_rows(x, src), group_sizes) (tgmm's out[g] = lhs_g^T rhs_g, so the operands'
    order picks the layout): the contract from other primitives."""
    rows = gather_rows(x, src)
    lhs, rhs = (dy, rows) if transpose_out else (rows, dy)
    return tgmm_p.bind(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def _kernel_operands(x, src, dy, group_sizes, *, transpose_out, preferred_element_type):
    """The operands of the CUDA kernel call (x, src, dy, group_sizes), or None where it
    does not apply (module docstring)."""
    if not (kernel_supports(x.shape, dy.shape, group_sizes.shape[0], x.dtype, preferred_element_type)
            and _lib.local_gpus_hopper()):
        return None
    return (0, 1, 2, 3)


def _cuda_workspace(x, src, dy, group_sizes, **_) -> int:
    return _lib.cuda_workspace_bytes("MoeXlaGatherTgmmWorkspaceBytes", group_sizes.shape[0])


def _batch(args, dims, *, transpose_out, preferred_element_type):
    x_batched = dims[0] is not None
    args, b = _batching.batched_to_front(args, dims)
    # x is stacked only where it is batched; every other operand gets the batch dimension.
    x, src, dy, group_sizes = [a if d is not None or i == 0 else jnp.broadcast_to(a, (b,) + a.shape)
                               for i, (a, d) in enumerate(zip(args, dims))]
    m = src.shape[1]
    if x_batched:
        t = x.shape[1]
        x = x.reshape(b * t, x.shape[2])
        src = _batching.folded_rows(src, t)  # entries naming no row go past the stacked tokens
    g = group_sizes.shape[1]
    out = gather_tgmm_p.bind(x, src.reshape(b * m), dy.reshape(b * m, dy.shape[2]),
                             _batching.folded_group_sizes(group_sizes, m), transpose_out=transpose_out,
                             preferred_element_type=preferred_element_type)
    # Drop each batch element's spacer group.
    return out.reshape(b, g + 1, out.shape[1], out.shape[2])[:, :g], 0


_impl.def_jitted_impl(gather_tgmm_p)
gather_tgmm_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gather_tgmm_p] = _ad.bilinear_jvp(gather_tgmm_p, 0, 2)
batching.primitive_batchers[gather_tgmm_p] = _batch
_lowering.register_decomposed(gather_tgmm_p, "gather_tgmm", _decomposition, _kernel_operands,
                              lambda transpose_out, **_: {"transpose_out": transpose_out}, _cuda_workspace,
                              sharding=_sharding.GATHER_TGMM)
