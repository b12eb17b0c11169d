"""gather_gmm_activate: the first expert product of a MoE layer with the expert activation
in its epilogue, read through a row map.

    h = x[src[rows of g]] @ w_in[g]     in float32, not rounded       h [M, N]
    gated (swiglu, geglu; N = 2F, w_in = gate | up):  a = g(h[:, :F]) * h[:, F:]    a [M, F]
    plain (gelu, silu, relu):                         a = g(h)                      a [M, N]
    rounded once to x.dtype;  g: silu(v) = v * sigmoid(v), gelu in its tanh approximation
    (jax.nn.gelu(approximate=True)), relu (primitives/_activation.py).

x [T, K]; src [M] int32 (an entry outside [0, T) reads a zero row); w_in [G, K, N];
group_sizes [G] int32, clamped to the M rows as gmm's; rows past sum(group_sizes) are zero
(g(0) = 0 for every g). It equals gather_gmm(x, src, w_in, group_sizes, preferred_element_type
=float32), then the activation in float32, then a cast to x.dtype; it differs from the
unfused path, gather_gmm followed by the activation, only by the rounding of h to x.dtype
(bf16 in a bf16 layer) that it no longer does.

Where it runs: on CUDA the kernel of cuda/gather_gemm.h with the activation epilogue
(GatherGemmParams.activated: the activation is applied to the float32 accumulators in
registers) when it supports the case, decided when lowering (kernel_supports: bf16 x and
w_in, K and N multiples of 8, gated F a multiple of 128) and the local GPUs (Hopper);
everywhere else (CPU, other GPUs, other cases, e.g. F % 128 != 0) it lowers to the
decomposition above, with the same one rounding.

Derivatives: the JVP is that of the decomposition, d a = act'(h) (gather_gmm(dx, src, w_in)
+ gather_gmm(x, src, d w_in)) in float32 (h recomputed in float32 by gather_gmm), rounded
to x.dtype; gather_gmm's transpose makes it reverse-differentiable. That rule runs a second
product and keeps a float32 [M, N] residual, so training is better served by the unfused
path: moe() runs this primitive only where nothing differentiates it
(experts._fused_forward_mlp).

vmap folds the batch into the tokens, rows and groups as gather_gmm's batching does
(_batching.fold_gather). Over a mesh (the kernel's call) a plain activation splits along N
as gather_gmm does; a gated one keeps N whole (_sharding.GATHER_GMM_ACTIVATE); K stays
whole, the activation needing the whole sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import moe_xla._lib as _lib
from moe_xla.primitives import _batching, _checks, _gather_kernel, _impl, _lowering, _sharding
from moe_xla.primitives._activation import ACTIVATIONS, GATED, activate_f32
from moe_xla.primitives.gather_gmm import gather_gmm_p

OP = "gather_gmm_activate"
# The gated kernel's column tile holds 128 gate and 128 up columns of w_in.
GATED_KERNEL_F_MULTIPLE = 128

gather_gmm_activate_p = Primitive("moe_xla_gather_gmm_activate")


def gather_gmm_activate(x, src, w_in, group_sizes, activation: str):
    """a[rows of g] = act(x[src[rows of g]] @ w_in[g]), h kept in float32 until the one
    rounding to x.dtype: [M, F] for gated activations (w_in [G, K, 2F] = gate | up), [M, N]
    for plain ones. See the module docstring."""
    return gather_gmm_activate_p.bind(x, src, w_in, group_sizes, activation=activation)


def out_cols(n: int, activation: str) -> int:
    """Columns of a for N columns of w_in: F = N / 2 when gated, N otherwise."""
    return n // 2 if activation in GATED else n


def kernel_supports(x_shape, w_shape, m: int, dtype, activation: str) -> bool:
    """Whether the CUDA kernel computes this case: x [T, K] and w_in [G, K, N] in bf16 (the
    output too), M rows, K and N multiples of 8, every size at most 2^31 - 256, and for a
    gated activation F = N / 2 a multiple of 128."""
    (t, k), (g, _, n) = x_shape, w_shape
    if activation in GATED and n % (2 * GATED_KERNEL_F_MULTIPLE) != 0:
        return False
    return _gather_kernel.supports(t, m, k, n, g, dtype, dtype)


def _abstract_eval(x, src, w_in, group_sizes, *, activation):
    _checks.gather_inputs(OP, x, src, "w_in", w_in, 3, "[G, K, N]")
    _checks.dim(OP, "w_in.shape[1] (K of x [T, K])", x.shape[1], w_in.shape[1])
    _checks.group_sizes(OP, group_sizes, w_in.shape[0])
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: expected activation in {ACTIVATIONS}, got {activation!r}")
    n = w_in.shape[2]
    if activation in GATED and n % 2:
        raise ValueError(f"{OP}: gated activation {activation!r} needs w_in [G, K, 2F] (gate | up), "
                         f"got an odd N = {n}")
    return jax.core.ShapedArray((src.shape[0], out_cols(n, activation)), x.dtype)


def _activated_f32(x, src, w_in, group_sizes, activation):
    """act(h) in float32 of h = gather_gmm(x, src, w_in, group_sizes) in float32, neither
    rounded."""
    h = gather_gmm_p.bind(x, src, w_in, group_sizes, transpose_rhs=False,
                          preferred_element_type=jnp.dtype(jnp.float32), has_token_slots=False)
    return activate_f32(h, activation)


def _decomposition(x, src, w_in, group_sizes, *, activation):
    """The activation of the float32 gather_gmm, in float32, rounded once to x.dtype."""
    return _activated_f32(x, src, w_in, group_sizes, activation).astype(x.dtype)


def _kernel_operands(x, src, w_in, group_sizes, *, activation):
    """The operands of the CUDA kernel call (all four), or None where it does not apply
    (module docstring)."""
    if not (kernel_supports(x.shape, w_in.shape, src.shape[0], x.dtype, activation) and _lib.local_gpus_hopper()):
        return None
    return (0, 1, 2, 3)


def _cuda_workspace(x, src, w_in, group_sizes, **_) -> int:
    return _lib.cuda_workspace_bytes("MoeXlaGatherGmmWorkspaceBytes", src.shape[0], group_sizes.shape[0])


def _jvp(primals, tangents, *, activation):
    x, src, w_in, group_sizes = primals
    out = gather_gmm_activate_p.bind(*primals, activation=activation)
    dx, dw = (ad.instantiate_zeros(t) for t in (tangents[0], tangents[2]))
    # The decomposition's tangent in float32: act'(h) applied to gather_gmm's (bilinear) one.
    _, d_out = jax.jvp(lambda x, w: _activated_f32(x, src, w, group_sizes, activation), (x, w_in), (dx, dw))
    return out, d_out.astype(out.dtype)


def _batch(args, dims, *, activation):
    x, src, w_in, folded, _, b, m, _ = _batching.fold_gather(args, dims)
    out = gather_gmm_activate_p.bind(x, src, w_in, folded, activation=activation)
    return _batching.zero_spacer_rows(out, folded, b, m), 0


_impl.def_jitted_impl(gather_gmm_activate_p)
gather_gmm_activate_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[gather_gmm_activate_p] = _jvp
batching.primitive_batchers[gather_gmm_activate_p] = _batch
_lowering.register_decomposed(gather_gmm_activate_p, OP, _decomposition, _kernel_operands,
                              lambda activation: {"activation": np.int32(ACTIVATIONS.index(activation))},
                              _cuda_workspace, sharding=_sharding.GATHER_GMM_ACTIVATE)
