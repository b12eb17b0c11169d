"""The expert MLP's activation, second product and weighted combine, with a backward that
needs neither the product's output nor a weighted copy of the cotangent:

    y[t] = sum_j weights[t, j] out[row_map[t*k + j]],   out = gmm(act(h), w_out, group_sizes)   [T*k, H]

The forward is unpermute(gmm(activate(h), w_out)) as written. The derivative is written
through omega[r] = weights[t, j] (the entry t*k + j = row_pairs[r] with row_map[t*k + j] =
r, a gather through permute's row_pairs; 0 for rows no entry names),
using out[r] = a[r] @ w_out[e] (a = act(h)) to move the weights in front of the
product: with b = omega * a,

    d y[t] = sum_j d b[r] @ w_out[e] + b[r] @ d w_out[e],   d b = omega act'(h) d h + d omega a

so its transpose, with c[r] = dy[t] the cotangent gathered unweighted (unpermute's
transpose with weights 1: one gather_rows pass), is

    g = c @ w_out[e]^T                    [T*k, F]   (one grouped GEMM)
    d h = act'(h)^T (omega g),  d omega = <g, a>,  b     (one pass over h and g, b written
                                           where g was: activate_weighted_grad)
    d weights[t, j] = d omega[r]          (F wide; = <dy[t], out[r]>)
    d w_out[e] = b_e^T c_e                (one tgmm, reading that b)

The tangent is one linear primitive (primitives/activate_gmm_combine_tangent.py) whose
transpose is this sequence; forward mode evaluates its formula.

With `backward_gathers`, c is never written: the tangent's product and combine are one
bilinear primitive (primitives/gmm_unpermute.py) whose transposes read dy through the row
map, g = gather_gmm(dy, src, w_out, transpose_rhs=True) and d w_out = gather_tgmm(dy, src,
b, transpose_out=True) (b_e^T c_e written as [E, F, H]; src[r] the token of row r);
otherwise c is gathered once and read by gmm and tgmm.
The usual rule (unpermute's transpose, then gmm's, then the activation's) keeps out
[T*k, H] for d weights and reads it, and writes the weighted cotangent. Roundings: the
tangent rounds b and d b to h's dtype, g is rounded to it, and omega g is not (d h is
rounded once); in float16, g has 1 / omega less headroom below the overflow than the
weighted cotangent's product had.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import moe_xla._choice as _choice
import moe_xla._lib as _lib
import moe_xla._rows as _rows
from moe_xla.activations import activate
from moe_xla.primitives.activate_gmm_combine_tangent import activate_gmm_combine_tangent
from moe_xla.primitives.gather_gmm import kernel_supports as gather_gmm_supports
from moe_xla.primitives.gather_tgmm import kernel_supports as gather_tgmm_supports
from moe_xla.primitives.gmm import gmm
from moe_xla.primitives.unpermute import unpermute

MODES = _choice.MODES
# Largest F (w_out [E, F, H]) whose backward gathers under "auto". The gathered products
# replace the [T*k, H] pass that writes c (and its memory); on the H200 the layer's step is
# faster with them up to F = 1024 and slower from F = 2048 on, where the products' own time
# outweighs the pass they save (benchmarks/results/LOG.md, session 33).
GATHER_MAX_F = 1024

_override = _choice.Override("product_combine")


def forced(mode: str):
    """Within the block `backward_gathers` answers as `mode` says: "gather"
    (the cotangent read through the row map), "copy" (gathered once into c), or "auto"
    (`backward_gathers`). For tests and benchmarks; a function jitted under one mode keeps
    it in its compiled programs."""
    return _override.forced(mode)


def backward_gathers(h, w_out, num_tokens: int) -> bool:
    """Whether the derivative of activate_gmm_combine(h, w_out, ...) should read the
    cotangent through the row map (module docstring), unless `forced`: on Hopper GPUs in
    bf16 where both gather kernels run, for F <= GATHER_MAX_F."""
    if _override.mode != "auto":
        return _override.mode == "gather"
    m, (e, f, hidden) = h.shape[0], w_out.shape
    dtype = h.dtype
    return (jax.default_backend() == "gpu" and _lib.local_gpus_hopper() and jnp.dtype(dtype) == jnp.bfloat16
            and f <= GATHER_MAX_F
            and gather_gmm_supports((num_tokens, hidden), w_out.shape, m, dtype, dtype, transpose_rhs=True)
            and gather_tgmm_supports((num_tokens, hidden), (m, f), e, dtype, dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7))
def activate_gmm_combine(h, w_out, group_sizes, row_map, weights, row_pairs, activation: str,
                         gathered_backward: bool):
    """unpermute(gmm(activate(h, activation), w_out, group_sizes), row_map, weights,
    row_pairs=row_pairs): h [T*k, 2F] (gated) or [T*k, F] grouped by expert, w_out [E, F, H],
    row_map and row_pairs permute's (row_map naming each row at most once, row_pairs its
    inverse), weights [T, k] float32 -> y [T, H] in h's dtype. Differentiable w.r.t. h,
    w_out and weights by the rule of the module docstring (jvp, grad, vmap), reading the
    cotangent through the row map where
    gathered_backward (the caller's choice, e.g. `backward_gathers`; an argument, so that
    traces of the rule made under one choice are not reused for the other)."""
    with jax.named_scope("moe_xla/act"):
        a = activate(h, activation)
    return gmm_combine(a, w_out, group_sizes, row_map, weights, row_pairs)


def gmm_combine(a, w_out, group_sizes, row_map, weights, row_pairs):
    """unpermute(gmm(a, w_out, group_sizes), row_map, weights, row_pairs=row_pairs), under the
    gmm_out and combine scopes: the forward of activate_gmm_combine after the activation."""
    with jax.named_scope("moe_xla/gmm_out"):
        out = gmm(a, w_out, group_sizes)
    with jax.named_scope("moe_xla/combine"):
        return unpermute(out, row_map, weights, row_pairs=row_pairs)


@activate_gmm_combine.defjvp
def _activate_gmm_combine_jvp(activation, gathered_backward, primals, tangents):
    h, w_out, group_sizes, row_map, weights, row_pairs = primals
    d_h, d_w_out, _, _, d_weights, _ = tangents
    y = activate_gmm_combine(h, w_out, group_sizes, row_map, weights, row_pairs, activation, gathered_backward)
    with jax.named_scope("moe_xla/combine"):
        src, omega = _rows.pair_sources(row_pairs, weights.shape, weights)  # gathers through row_pairs
        # Linear in d_weights, written as the scatter through row_map so that its transpose,
        # the weights' cotangent, is a gather.
        d_omega = _rows.row_weights(row_map, d_weights, h.shape[0])
    return y, activate_gmm_combine_tangent(h, omega, w_out, group_sizes, row_map.reshape(weights.shape), src,
                                           row_pairs, d_h, d_omega, d_w_out, activation, gathered_backward)
