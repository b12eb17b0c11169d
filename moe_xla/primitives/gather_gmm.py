"""gather_gmm: the grouped matrix product of MoE experts read through a row map.

    out[rows of g] = x[src[rows of g]] @ w[g]   = gmm(gather_rows(x, src), w, group_sizes)
    (x[src[rows of g]] @ w[g]^T with transpose_rhs: gmm(..., transpose_rhs=True))

x [T, K]; src [M] int32 (an entry outside [0, T) reads a zero row); w [G, K, N], or
[G, N, K] with transpose_rhs; group_sizes [G] int32, clamped to the M rows as gmm's; rows
past sum(group_sizes) are zero. Accumulation is float32; the output dtype is
preferred_element_type, or x.dtype. The first expert product of a MoE layer, without the
permuted copy of x in memory; with transpose_rhs, e.g. the combine's backward
dy[token(r)] @ w_out[e]^T with w_out [E, F, H] read as it is stored.

Where it runs: on CUDA the kernel of cuda/gather_gemm.h when it supports the case, decided
when lowering from the shapes and dtypes (kernel_supports: bf16 x and w, bf16 or float32
out, K and N multiples of 8; either layout of w) and the local GPUs (Hopper, compute
capability 9.0; with no local GPU the kernel is assumed and its handler checks the device).
Everywhere else (CPU, other GPUs, other cases) it lowers to its decomposition, gather_rows +
the gmm primitive (with transpose_rhs), so every platform computes the same contract.

gather_gmm is bilinear in (x, w):
    d w = gather_tgmm(x, src, ct, group_sizes)   (= tgmm(gather_rows(x, src), ct)), [G, K, N];
          with transpose_rhs its transpose: d w[g] = ct_g^T x[src]_g, [G, N, K], which
          gather_tgmm(..., transpose_out=True) writes in that layout
    d x = the rows of d x_sorted = gmm(ct, w, transpose_rhs = not transpose_rhs) summed
          back to tokens: d x[t] = sum_{r: src[r] = t} d x_sorted[r]
The sum is deterministic either way. With token_slots [T, k] int32, a promise that
token_slots[t, j] names the j-th row r with src[r] = t, or an index outside [0, M) where
token t has fewer rows (every row r with src[r] in [0, T) named once, as permute's row_map
reshaped to [T, k]), it is one gather-sum,
unpermute(d x_sorted, token_slots, ones); without, a sort-and-scan sum over src
(_rows.sum_rows_into), for any src.
gather_tgmm's transpose (see gather_tgmm.py: a gather_gmm in dy, the same sum to tokens in
x) is registered here too, so that gather_tgmm.py need not import this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._lib as _lib
import moe_xla._rows as _rows
from moe_xla.primitives import _ad, _batching, _checks, _gather_kernel, _impl, _lowering, _sharding
from moe_xla.primitives.gather_rows import gather_rows
from moe_xla.primitives.gather_tgmm import gather_tgmm_p
from moe_xla.primitives.gmm import gmm_p
from moe_xla.primitives.unpermute import unpermute_p

gather_gmm_p = Primitive("moe_xla_gather_gmm")


def gather_gmm(x, src, w, group_sizes, *, transpose_rhs=False, preferred_element_type=None, token_slots=None):
    """Grouped matmul of gathered rows: out[rows of g] = x[src[rows of g]] @ w[g] (w[g]^T
    with transpose_rhs, w [G, N, K]). See the module docstring; token_slots ([T, k], src's
    inverse) makes the gradient in x one gather-sum."""
    transpose_rhs = _checks.static_bool("gather_gmm", "transpose_rhs", transpose_rhs)
    out_dtype = _checks.out_dtype("gather_gmm", preferred_element_type, getattr(x, "dtype", jnp.float32))
    slots = () if token_slots is None else (token_slots,)
    return gather_gmm_p.bind(x, src, w, group_sizes, *slots, transpose_rhs=transpose_rhs,
                             preferred_element_type=out_dtype, has_token_slots=token_slots is not None)


def kernel_supports(x_shape, w_shape, m: int, in_dtype, out_dtype, transpose_rhs: bool = False) -> bool:
    """Whether the CUDA kernel computes this case: x [T, K] and w [G, K, N] ([G, N, K] with
    transpose_rhs) in bf16, M output rows in bf16 or float32, K and N multiples of 8
    (16-byte rows), every size at most 2^31 - 256."""
    (t, k), g = x_shape, w_shape[0]
    n = w_shape[1] if transpose_rhs else w_shape[2]
    return _gather_kernel.supports(t, m, k, n, g, in_dtype, out_dtype)


def _abstract_eval(x, src, w, group_sizes, *token_slots, transpose_rhs, preferred_element_type, has_token_slots):
    _checks.gather_inputs("gather_gmm", x, src, "w", w, 3, "[G, N, K]" if transpose_rhs else "[G, K, N]")
    k_axis = 2 if transpose_rhs else 1
    _checks.dim("gather_gmm", f"w.shape[{k_axis}] (K of x [T, K])", x.shape[1], w.shape[k_axis])
    _checks.group_sizes("gather_gmm", group_sizes, w.shape[0])
    m = src.shape[0]
    if has_token_slots:
        (slots,) = token_slots
        _checks.rank("gather_gmm", "token_slots", slots, 2, "[T, k]")
        _checks.int32("gather_gmm", "token_slots", slots)
        _checks.dim("gather_gmm", "token_slots.shape[0] (T of x [T, K])", x.shape[0], slots.shape[0])
    return jax.core.ShapedArray((m, w.shape[1] if transpose_rhs else w.shape[2]), preferred_element_type)


def _decomposition(x, src, w, group_sizes, *_token_slots, transpose_rhs, preferred_element_type, has_token_slots):
    """gmm(gather_rows(x, src), w, group_sizes, transpose_rhs): the contract from other
    primitives."""
    return gmm_p.bind(gather_rows(x, src), w, group_sizes, transpose_rhs=transpose_rhs,
                      preferred_element_type=preferred_element_type)


def _kernel_operands(x, src, w, group_sizes, *_token_slots, transpose_rhs, preferred_element_type,
                     has_token_slots):
    """The operands of the CUDA kernel call (x, src, w, group_sizes), or None where it does
    not apply (module docstring)."""
    if not (kernel_supports(x.shape, w.shape, src.shape[0], x.dtype, preferred_element_type, transpose_rhs)
            and _lib.local_gpus_hopper()):
        return None
    return (0, 1, 2, 3)


def _cuda_workspace(x, src, w, group_sizes, **_) -> int:
    return _lib.cuda_workspace_bytes("MoeXlaGatherGmmWorkspaceBytes", src.shape[0], group_sizes.shape[0])


def _sum_to_tokens(d_sorted, src, token_slots, num_tokens: int):
    """d x [T, K] from the rows' gradients d x_sorted [M, K]: d x[t] = sum_{r: src[r] = t}
    d x_sorted[r], rows whose src is outside [0, T) dropped; one gather-sum through
    token_slots ([T, k], src's inverse) when given, else a sort-and-scan sum over src."""
    if token_slots:
        (slots,) = token_slots
        return unpermute_p.bind(d_sorted, slots.reshape(-1), unique_rows=True, has_row_pairs=False,
                                unit_k=slots.shape[1])
    return _rows.sum_rows_into(d_sorted, src[:, None], jnp.ones((src.shape[0], 1), jnp.float32), num_rows=num_tokens)


def _transpose(ct, x, src, w, group_sizes, *token_slots, transpose_rhs, preferred_element_type, has_token_slots):
    if any(ad.is_undefined_primal(a) for a in (src, group_sizes, *token_slots)):
        raise ValueError("gather_gmm: src, group_sizes and token_slots are integers and cannot be differentiated")
    none = (None,) * (3 + len(token_slots))
    if ad.is_undefined_primal(x):
        if type(ct) is ad.Zero:
            return (ad.Zero(x.aval), *none)
        x_dtype = jnp.dtype(x.aval.dtype)
        d_sorted = gmm_p.bind(ct.astype(w.dtype), w, group_sizes, transpose_rhs=not transpose_rhs,
                              preferred_element_type=x_dtype)
        return (_sum_to_tokens(d_sorted, src, token_slots, x.aval.shape[0]).astype(x_dtype), *none)
    w_aval = w.aval
    if type(ct) is ad.Zero:
        return None, None, ad.Zero(w_aval), *none[2:]
    # [G, K, N]: x[src]_g^T ct_g; with transpose_rhs w is [G, N, K]: ct_g^T x[src]_g.
    d_w = gather_tgmm_p.bind(x, src, ct.astype(x.dtype), group_sizes, transpose_out=transpose_rhs,
                             preferred_element_type=jnp.dtype(w_aval.dtype))
    return None, None, d_w, *none[2:]


def _gather_tgmm_transpose(ct, x, src, dy, group_sizes, *, transpose_out, preferred_element_type):
    # ct [G, K, N], or [G, N, K] with transpose_out: the products' transpose_rhs reads either
    # layout as stored (gather_tgmm.py's module docstring).
    if ad.is_undefined_primal(src) or ad.is_undefined_primal(group_sizes):
        raise ValueError("gather_tgmm: src and group_sizes are integers and cannot be differentiated")
    if ad.is_undefined_primal(x):
        if type(ct) is ad.Zero:
            return ad.Zero(x.aval), None, None, None
        x_dtype = jnp.dtype(x.aval.dtype)
        d_sorted = gmm_p.bind(dy, ct.astype(dy.dtype), group_sizes, transpose_rhs=not transpose_out,
                              preferred_element_type=x_dtype)
        return _sum_to_tokens(d_sorted, src, (), x.aval.shape[0]).astype(x_dtype), None, None, None
    if type(ct) is ad.Zero:
        return None, None, ad.Zero(dy.aval), None
    d_dy = gather_gmm_p.bind(x, src, ct.astype(x.dtype), group_sizes, transpose_rhs=transpose_out,
                             preferred_element_type=jnp.dtype(dy.aval.dtype), has_token_slots=False)
    return None, None, d_dy, None


def _batch(args, dims, *, transpose_rhs, preferred_element_type, has_token_slots):
    x, src, w, folded, token_slots, b, m, t = _batching.fold_gather(args, dims)
    if t is not None:
        token_slots = [_batching.folded_rows(s, m).reshape(b * t, s.shape[2]) for s in token_slots]
    else:
        # Every element reads the one x; token_slots would then name rows of several
        # elements, so d x takes the sum over src instead.
        token_slots = []
    out = gather_gmm_p.bind(x, src, w, folded, *token_slots, transpose_rhs=transpose_rhs,
                            preferred_element_type=preferred_element_type, has_token_slots=bool(token_slots))
    return _batching.zero_spacer_rows(out, folded, b, m), 0


_impl.def_jitted_impl(gather_gmm_p)
gather_gmm_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gather_gmm_p] = _ad.bilinear_jvp(gather_gmm_p, 0, 2)
ad.primitive_transposes[gather_gmm_p] = _transpose
ad.primitive_transposes[gather_tgmm_p] = _gather_tgmm_transpose
batching.primitive_batchers[gather_gmm_p] = _batch
_lowering.register_decomposed(gather_gmm_p, "gather_gmm", _decomposition, _kernel_operands,
                              lambda transpose_rhs, **_: {"transpose_rhs": transpose_rhs}, _cuda_workspace,
                              sharding=_sharding.GATHER_GMM)
