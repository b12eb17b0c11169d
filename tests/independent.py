"""An MoE layer written here, from the formulas of the README's semantics and common/routing.h,
for tests that must not share code with moe_xla (reference.py included): a bug planted in
the library's activation, routing weights or aux losses cannot leak into this oracle.

Routing decisions (which experts a token picks) are taken in numpy float64; the layer
itself is jnp, evaluated under float64 so that jax.grad gives an independent gradient.
Inputs come from `layer_inputs`, whose router logits keep every routing decision at
least `gap` away from a tie, so float32 kernels and this float64 oracle pick the same
experts whatever the random draw.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

GATED_ACTIVATIONS = ("swiglu", "geglu")
ACTIVATIONS = GATED_ACTIVATIONS + ("gelu", "silu", "relu")


def _silu(v):
    return v / (1.0 + jnp.exp(-v))


def _gelu_tanh(v):
    return 0.5 * v * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


def activation_fn(activation: str):
    """[rows, 2F] (gate | up) or [rows, F] -> [rows, F], from the formulas, not jax.nn."""
    plain = {"silu": _silu, "gelu": _gelu_tanh, "relu": lambda v: jnp.maximum(v, 0.0)}
    if activation in plain:
        return plain[activation]
    outer = _silu if activation == "swiglu" else _gelu_tanh

    def gated(h):
        f = h.shape[-1] // 2
        return outer(h[..., :f]) * h[..., f:]

    return gated


def gather_gmm(x, src, w, gs, transpose_rhs=False):
    """gather_gmm (x [T, K], src [M], w [G, K, N] or [G, N, K] with transpose_rhs,
    group_sizes [G] -> [M, N]) from its formula: each row's token row (zero for src outside
    [0, T)) times its group's matrix (sizes clamped to the M rows) by one einsum over all
    rows; rows past the groups 0."""
    t, m = x.shape[0], src.shape[0]
    valid = (src >= 0) & (src < t)
    rows = jnp.where(valid[:, None], x[jnp.clip(src, 0, max(t - 1, 0))], 0)
    ends = jnp.cumsum(jnp.clip(gs, 0, None))
    group = jnp.searchsorted(ends, jnp.arange(m), side="right")  # G for rows past the groups
    w_row = jnp.take(w, jnp.minimum(group, w.shape[0] - 1), axis=0)
    out = jnp.einsum("mk,mnk->mn" if transpose_rhs else "mk,mkn->mn", rows, w_row)
    return jnp.where((group < w.shape[0])[:, None], out, 0)


def np_sources(logits, score: str):
    """float64 [T, E]: softmax(logits) or sigmoid(logits), the values weights come from."""
    x = np.asarray(logits, np.float64)
    if score == "softmax":
        p = np.exp(x - x.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-x))


def np_selection(logits, score: str, bias=None, n_groups=None, topk_groups=None):
    """float64 [T, E] selection scores after the group limit (-inf outside the kept groups)."""
    select = np_sources(logits, score)
    if score == "sigmoid" and bias is not None:
        select = select + np.asarray(bias, np.float64)
    if n_groups and n_groups > 1:
        t, e = select.shape
        per = select.reshape(t, n_groups, e // n_groups)
        top2 = -np.sort(-per, axis=-1)[..., : min(2, e // n_groups)]
        group_score = top2.sum(-1)
        kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_groups]
        keep = np.zeros((t, n_groups), bool)
        np.put_along_axis(keep, kept, True, axis=-1)
        select = np.where(np.repeat(keep, e // n_groups, axis=1), select, -np.inf)
    return select


def np_route(logits, top_k, *, score="softmax", bias=None, n_groups=None, topk_groups=None, renormalize=True,
             scale=1.0):
    """(weights float64 [T, k], expert_ids int32 [T, k]): top_k by selection, descending,
    ties to the lower index; weights from the sources, renormalised, scaled."""
    select = np_selection(logits, score, bias, n_groups, topk_groups)
    ids = np.argsort(-select, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(np_sources(logits, score), ids, axis=-1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    return w * scale, ids


def _decision_gaps(logits, top_k, score, bias, n_groups, topk_groups):
    """Per token, the smallest distance between a kept and a dropped score, over the
    expert choice and (group-limited) the group choice."""
    select = np_selection(logits, score, bias, n_groups, topk_groups)
    s = -np.sort(-select, axis=-1)
    gaps = s[:, top_k - 1] - s[:, top_k] if top_k < s.shape[1] else np.full(s.shape[0], np.inf)
    if n_groups and n_groups > 1 and topk_groups < n_groups:
        raw = np_selection(logits, score, bias)
        t, e = raw.shape
        per = -np.sort(-raw.reshape(t, n_groups, e // n_groups), axis=-1)[..., : min(2, e // n_groups)]
        g = -np.sort(-per.sum(-1), axis=-1)
        gaps = np.minimum(gaps, g[:, topk_groups - 1] - g[:, topk_groups])
    # Exact ties among the kept experts are fine (ties go to the lower index on both sides),
    # but a near tie between kept experts would change their order only, never the sum.
    return np.where(np.isnan(gaps), np.inf, gaps)


def separated_logits(rng, shape, top_k, *, score="softmax", bias=None, n_groups=None, topk_groups=None,
                     gap=1e-3, scale=1.0, transform=None):
    """float32 normal logits of `shape` [..., E] (times scale, then `transform` on the
    [rows, E] numpy array if given), rows redrawn until every routing decision is at
    least `gap` from a tie."""
    e = shape[-1]
    draw = lambda n: (transform or (lambda a: a))((rng.standard_normal((n, e)) * scale).astype(np.float32))  # noqa: E731
    flat = draw(math.prod(shape[:-1]))
    for _ in range(100):
        bad = _decision_gaps(flat, top_k, score, bias, n_groups, topk_groups) < gap
        if not bad.any():
            return jnp.asarray(flat.reshape(shape))
        flat[bad] = draw(int(bad.sum()))
    raise AssertionError("could not draw well-separated router logits")


def layer(x, logits, w_in, w_out, ids, *, activation="swiglu", score="softmax", renormalize=True, scale=1.0,
          shared_experts=None):
    """y [T, H] of the MoE layer for fixed expert choices ids [T, k] (from np_route): a loop
    over experts in jnp, differentiable in every float input (logits through the weights)."""
    act = activation_fn(activation)
    lg = logits.reshape(-1, logits.shape[-1])
    if score == "softmax":
        z = jnp.exp(lg - jnp.max(lg, axis=-1, keepdims=True))
        src = z / jnp.sum(z, axis=-1, keepdims=True)
    else:
        src = 1.0 / (1.0 + jnp.exp(-lg))
    w = jnp.take_along_axis(src, jnp.asarray(ids), axis=-1)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    w = w * scale
    x2 = x.reshape(-1, x.shape[-1])
    y = jnp.zeros_like(x2)
    for e in range(w_in.shape[0]):
        coef = jnp.sum(jnp.where(jnp.asarray(ids) == e, w, 0.0), axis=-1)
        y = y + coef[:, None] * (act(x2 @ w_in[e]) @ w_out[e])
    if shared_experts is not None:
        s_in, s_out = shared_experts
        y = y + act(x2 @ s_in) @ s_out
    return y.reshape(x.shape)


def f64(tree):
    """Every array of a pytree as a float64 jnp array (call under jax.enable_x64)."""
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def aux(logits, ids, score: str):
    """(tokens_per_expert, load_balance_loss, z_loss) in numpy float64, per MoeAux's doc:
    E * sum_e f_e P_e with f_e = count_e / (T k), P_e the mean over tokens of the softmax
    (sigmoid: the sigmoid scores normalised per token); z = mean_t logsumexp(logits_t)^2."""
    x = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    t, e = x.shape
    counts = np.bincount(np.asarray(ids).ravel(), minlength=e)
    probs = _aux_probs(x, score)
    balance = e * np.sum(counts / ids.size * probs.mean(0))
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    return counts, balance, np.mean(lse**2)


def _aux_probs(x, score):
    if score == "softmax":
        return np_sources(x, "softmax")
    s = np_sources(x, "sigmoid")
    return s / s.sum(-1, keepdims=True)


def aux_grads(logits, ids, score: str):
    """Closed-form d load_balance_loss / d logits and d z_loss / d logits, float64 [T, E].

    With c_e = E f_e / T (f_e constant: counts do not depend on the logits):
      softmax p:            d/dl_tj sum_e c_e p_te = p_tj (c_j - sum_e c_e p_te)
      sigmoid q = s / S:    d/dl_tj sum_e c_e q_te = s_tj (1 - s_tj) / S_t (c_j - sum_e c_e q_te)
      z = mean_t lse_t^2:   d/dl_tj = 2 lse_t softmax_tj / T
    """
    x = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    t, e = x.shape
    counts = np.bincount(np.asarray(ids).ravel(), minlength=e)
    c = e * counts / ids.size / t
    probs = _aux_probs(x, score)
    centred = c[None, :] - np.sum(c * probs, axis=-1, keepdims=True)
    if score == "softmax":
        d_balance = probs * centred
    else:
        s = np_sources(x, "sigmoid")
        d_balance = s * (1 - s) / s.sum(-1, keepdims=True) * centred
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    d_z = 2 * lse[:, None] * np_sources(x, "softmax") / t
    return d_balance.reshape(logits.shape), d_z.reshape(logits.shape)
