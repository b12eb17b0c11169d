"""The expert MLP's second product and the weighted combine, with a backward that needs
neither the product's output nor a weighted copy of the cotangent:

    y[t] = sum_j weights[t, j] out[row_map[t*k + j]],   out = gmm(a, w_out, group_sizes)   [T*k, H]

The forward is unpermute(gmm(a, w_out)) as written. The derivative is written through
omega[r] = weights[t, j] (the entry with row_map[t*k + j] = r; 0 for rows no entry names),
using out[r] = a[r] @ w_out[e] to move the weights in front of the product:

    d y[t] = sum_j (omega d a + d omega a)[r] @ w_out[e] + (omega a)[r] @ d w_out[e]

so its transpose, with c[r] = dy[t] the cotangent gathered unweighted (unpermute's
transpose with weights 1: one gather_rows pass), is

    g = c @ w_out[e]^T                [T*k, F]   (one grouped GEMM)
    d a = omega * g
    d weights[t, j] = <g[r], a[r]>    (F wide; = <dy[t], out[r]>)
    d w_out[e] = (omega a)_e^T c_e    (one tgmm)

The usual rule (unpermute's transpose, then gmm's) keeps out [T*k, H] for d weights and
reads it, and writes the weighted cotangent; here the residuals are a, omega and omega * a
([T*k, F]; experts.py rematerialises them from the activation's input). The tangent rounds
omega * a and omega d a + d omega a to a's dtype, and g is rounded to it before the
weights scale it: in float16, g has 1 / omega less headroom below the overflow than the
weighted cotangent's product had.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import moe_xla._rows as _rows
from moe_xla.primitives.gmm import gmm
from moe_xla.primitives.unpermute import unpermute


def _row_weights(row_map, weights, num_rows: int):
    """omega [num_rows]: omega[row_map[t*k + j]] = weights[t, j], 0 for rows no entry names.
    A scatter of distinct places (entries naming no row are dropped), so that its transpose,
    the weights' cotangent, is a gather: no scatter-add."""
    place = jnp.where(_rows.names_row(row_map, num_rows), row_map, num_rows)
    return jnp.zeros((num_rows,), weights.dtype).at[place].set(weights.reshape(-1), mode="drop", unique_indices=True)


@jax.custom_jvp
def gmm_combine(a, w_out, group_sizes, row_map, weights):
    """unpermute(gmm(a, w_out, group_sizes), row_map, weights, unique_rows=True): a [T*k, F]
    grouped by expert, w_out [E, F, H], row_map permute's (naming each row at most once),
    weights [T, k] float32 -> y [T, H] in a's dtype. Differentiable w.r.t. a, w_out and
    weights by the rule of the module docstring (jvp, grad, vmap)."""
    with jax.named_scope("moe_xla/gmm_out"):
        out = gmm(a, w_out, group_sizes)
    with jax.named_scope("moe_xla/combine"):
        return unpermute(out, row_map, weights, unique_rows=True)


@gmm_combine.defjvp
def _gmm_combine_jvp(primals, tangents):
    a, w_out, group_sizes, row_map, weights = primals
    d_a, d_w_out, _, _, d_weights = tangents
    y = gmm_combine(a, w_out, group_sizes, row_map, weights)
    with jax.named_scope("moe_xla/combine"):
        omega = _row_weights(row_map, weights, a.shape[0])
        d_omega = _row_weights(row_map, d_weights, a.shape[0])
        d_rows = (omega[:, None] * d_a.astype(jnp.float32) + d_omega[:, None] * a.astype(jnp.float32)).astype(a.dtype)
        weighted = (omega[:, None] * a.astype(jnp.float32)).astype(a.dtype)
    with jax.named_scope("moe_xla/gmm_out"):
        d_out = gmm(d_rows, w_out, group_sizes) + gmm(weighted, d_w_out, group_sizes)
    with jax.named_scope("moe_xla/combine"):
        return y, unpermute(d_out, row_map, jnp.ones_like(weights), unique_rows=True)
