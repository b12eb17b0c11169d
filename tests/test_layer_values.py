"""moe() on one device against the MoE layer written in tests/independent.py (no code shared
with moe_xla or its reference): outputs for every activation and both scores, shared
experts, the aux values, and gradients of all of them (aux losses and shared-expert
weights included).

A combined loss sum(y * ct) + A * load_balance_loss + B * z_loss is differentiated once
per case; its router-logit gradient is the oracle's layer gradient plus the closed-form
aux-loss gradients (independent.aux_grads), so a cut or wrong aux gradient shows there.
A and B are chosen so each term moves the logit gradient by far more than the tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla
import independent as ind
from conftest import normal

T, H, F, FS, E = 21, 12, 6, 5, 8  # T*k = 63 for k = 3: not a multiple of 8
A_BALANCE, B_Z = float(T), 0.5


def close(out, ref, what, tol=2e-5):
    """Every element within tol of the reference, relative to the reference's largest entry."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(np.abs(ref).max(), 1e-30), err_msg=what)


ROUTINGS = {
    "softmax": dict(top_k=2),
    "softmax_k3_no_renorm": dict(top_k=3, renormalize=False),
    "sigmoid_bias_groups": dict(top_k=3, score="sigmoid", bias=True, n_groups=4, topk_groups=2, scale=2.5),
}


def inputs(rng, activation, routing, *, t=T, e=E, shared=True, lead=None):
    """(x, logits, w_in, w_out, shared_experts or None, route kwargs) for moe()."""
    kw = dict(routing)
    if kw.pop("bias", False):
        kw["bias"] = jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32)
    width = 2 * F if activation in ind.GATED_ACTIVATIONS else F
    x = normal(rng, (lead or (t,)) + (H,), jnp.float32)
    logits = ind.separated_logits(rng, x.shape[:-1] + (e,), kw["top_k"], score=kw.get("score", "softmax"),
                                  bias=kw.get("bias"), n_groups=kw.get("n_groups"), topk_groups=kw.get("topk_groups"))
    w_in = normal(rng, (e, H, width), jnp.float32) / np.sqrt(H)
    w_out = normal(rng, (e, F, H), jnp.float32) / np.sqrt(F)
    sh = None
    if shared:
        s_width = 2 * FS if activation in ind.GATED_ACTIVATIONS else FS
        sh = (normal(rng, (H, s_width), jnp.float32) / np.sqrt(H), normal(rng, (FS, H), jnp.float32) / np.sqrt(FS))
    return x, logits, w_in, w_out, sh, kw


def combined_loss(fn, ct, activation, kw):
    """(x, logits, w_in, w_out, shared) -> (loss, (y, aux)) of fn = moe() or the EP layer."""

    def loss(x, logits, w_in, w_out, shared):
        y, aux = fn(x, logits, w_in, w_out, activation=activation, shared_experts=shared, return_aux=True, **kw)
        return jnp.sum(y * ct) + A_BALANCE * aux.load_balance_loss + B_Z * aux.z_loss, (y, aux)

    return loss


def check_against_oracle(args, ct, activation, kw, result, tol=2e-5):
    """Compares (y, aux), grads of the combined loss with the independent layer (grads
    None: the forward values only)."""
    (y, aux), grads = result
    x, logits, w_in, w_out, shared = args
    score = kw.get("score", "softmax")
    _, ids = ind.np_route(logits.reshape(-1, E), **kw)
    opts = dict(activation=activation, score=score, renormalize=kw.get("renormalize", True),
                scale=kw.get("scale", 1.0))
    with jax.enable_x64(True):
        a64, ct64 = ind.f64(args), ind.f64(ct)
        y_ref, pull = jax.vjp(lambda *a: ind.layer(*a[:4], ids, shared_experts=a[4], **opts), *a64)
        layer_grads = pull(ct64)
    close(y, y_ref, f"y ({activation}, {score})", tol)
    counts, balance, z = ind.aux(logits, ids, score)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts, err_msg="tokens_per_expert")
    close(aux.load_balance_loss, balance, "load_balance_loss", tol)
    close(aux.z_loss, z, "z_loss", tol)
    if grads is None:
        return
    d_balance, d_z = ind.aux_grads(logits, ids, score)
    layer_grads = list(layer_grads)
    layer_grads[1] = np.asarray(layer_grads[1]) + A_BALANCE * d_balance + B_Z * d_z
    names = ("x", "router_logits", "w_in", "w_out", "shared_experts")
    for name, g, g_ref in zip(names, grads, layer_grads):
        for i, (leaf, leaf_ref) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(g_ref))):
            close(leaf, leaf_ref, f"d loss / d {name}[{i}] ({activation}, {score})", 10 * tol)


@pytest.mark.parametrize("routing", ["softmax", "sigmoid_bias_groups"])
@pytest.mark.parametrize("activation", ind.ACTIVATIONS)
def test_moe_matches_independent_layer(rng, activation, routing):
    """Output, aux values and every gradient (aux losses and shared experts included) for
    each activation and both scores."""
    x, logits, w_in, w_out, shared, kw = inputs(rng, activation, ROUTINGS[routing])
    ct = normal(rng, (T, H), jnp.float32)
    args = (x, logits, w_in, w_out, shared)
    grad = jax.value_and_grad(combined_loss(moe_xla.moe, ct, activation, kw), argnums=(0, 1, 2, 3, 4), has_aux=True)
    (_, out), grads = jax.jit(grad)(*args)
    check_against_oracle(args, ct, activation, kw, (out, grads))


def test_moe_without_renormalisation_batched_and_no_shared_experts(rng):
    """renormalize=False and x [B, S, H]: the raw softmax weights, no shared expert."""
    x, logits, w_in, w_out, _, kw = inputs(rng, "geglu", ROUTINGS["softmax_k3_no_renorm"], shared=False, lead=(3, 7))
    y = jax.jit(lambda *a: moe_xla.moe(*a, activation="geglu", **kw))(x, logits, w_in, w_out)
    _, ids = ind.np_route(logits.reshape(-1, E), **kw)
    with jax.enable_x64(True):
        y_ref = ind.layer(*ind.f64((x, logits, w_in, w_out)), ids, activation="geglu", renormalize=False)
    close(y, y_ref, "y")


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_gradients_alone(rng, score):
    """d load_balance_loss / d logits and d z_loss / d logits, each on its own, against the
    closed form of independent.aux_grads (itself checked by finite differences here)."""
    kw = dict(top_k=2, score=score)
    x, logits, w_in, w_out, _, kw = inputs(rng, "relu", kw, shared=False)

    def aux_of(lg):
        return moe_xla.moe(x, lg, w_in, w_out, activation="relu", return_aux=True, **kw)[1]

    d_balance = jax.jit(jax.grad(lambda lg: aux_of(lg).load_balance_loss))(logits)
    d_z = jax.jit(jax.grad(lambda lg: aux_of(lg).z_loss))(logits)
    _, ids = ind.np_route(logits, **kw)
    ref_balance, ref_z = ind.aux_grads(logits, ids, score)
    # close() measures against the largest entry, so a cut (zero) gradient fails it.
    close(d_balance, ref_balance, "d load_balance_loss / d logits", 1e-4)
    close(d_z, ref_z, "d z_loss / d logits", 1e-4)
    # The closed form itself against central differences of the float64 formula (ids fixed).
    direction = rng.standard_normal(logits.shape)
    step = 1e-6
    lg = np.asarray(logits, np.float64)
    for k, ref in ((1, ref_balance), (2, ref_z)):
        fd = (ind.aux(lg + step * direction, ids, score)[k] - ind.aux(lg - step * direction, ids, score)[k]) / (2 * step)
        np.testing.assert_allclose(fd, np.vdot(ref, direction), rtol=1e-6)
