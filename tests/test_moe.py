"""moe() against the loop-over-experts reference: outputs, gradients, determinism, HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla
from moe_xla import reference
from moe_xla._lib import target_name
from conftest import ON_GPU, assert_close, normal

T, H, F, E = 37, 16, 8, 8  # T*k is not a multiple of 8 for k in {1, 3, 5}


def _layer(rng, *, activation="swiglu", dtype=jnp.float32, t=T, e=E, shared=False, lead=None):
    gated = activation in ("swiglu", "geglu")
    x = normal(rng, (lead or (t,)) + (H,), dtype)
    logits = normal(rng, x.shape[:-1] + (e,), jnp.float32)
    w_in = (normal(rng, (e, H, 2 * F if gated else F), jnp.float32) / np.sqrt(H)).astype(dtype)
    w_out = (normal(rng, (e, F, H), jnp.float32) / np.sqrt(F)).astype(dtype)
    kw = {}
    if shared:
        kw["shared_experts"] = ((normal(rng, (H, 2 * 12 if gated else 12), jnp.float32) / 4).astype(dtype),
                                (normal(rng, (12, H), jnp.float32) / 4).astype(dtype))
    return (x, logits, w_in, w_out), kw


CASES = [
    dict(top_k=2),
    dict(top_k=1),
    dict(top_k=E),
    dict(top_k=3, score="sigmoid", bias=True, scale=2.0),
    dict(top_k=3, score="sigmoid", bias=True, n_groups=4, topk_groups=2),
    dict(top_k=5, renormalize=False),
]


def _kw(rng, case):
    kw = dict(case)
    if kw.pop("bias", False):
        kw["bias"] = normal(rng, (E,), jnp.float32)
    return kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_moe_matches_reference(rng, case):
    args, _ = _layer(rng)
    kw = _kw(rng, case)
    y = jax.jit(lambda *a: moe_xla.moe(*a, **kw))(*args)
    assert_close(y, jax.jit(lambda *a: reference.moe(*a, **kw))(*args), jnp.float32)


@pytest.mark.parametrize("activation", moe_xla.moe.__globals__["ACTIVATIONS"])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_activations_and_shared_experts(rng, activation, shared):
    args, extra = _layer(rng, activation=activation, shared=shared)
    y = jax.jit(lambda *a: moe_xla.moe(*a, top_k=2, activation=activation, **extra))(*args)
    assert_close(y, jax.jit(lambda *a: reference.moe(*a, top_k=2, activation=activation, **extra))(*args), jnp.float32)


def test_moe_all_tokens_to_one_expert_and_batched_input(rng):
    args, _ = _layer(rng, lead=(3, 13))
    x, logits, w_in, w_out = args
    logits = logits.at[..., 5].add(100.0)  # every token picks expert 5 first
    y, aux = moe_xla.moe(x, logits, w_in, w_out, top_k=2, return_aux=True)
    assert y.shape == x.shape
    assert_close(y, jax.jit(lambda *a: reference.moe(*a, top_k=2))(x, logits, w_in, w_out), jnp.float32)
    assert int(aux.tokens_per_expert[5]) == 39 and int(aux.tokens_per_expert.sum()) == 78


def test_moe_bf16(rng):
    # Both backends have bf16 kernels (the CPU ones convert to float32 and round once);
    # element-wise bounds for the CPU path are in test_bf16.py.
    args, _ = _layer(rng, dtype=jnp.bfloat16, t=512 if ON_GPU else 96, e=16)
    assert_close(jax.jit(lambda *a: moe_xla.moe(*a, top_k=4))(*args),
                 jax.jit(lambda *a: reference.moe(*a, top_k=4))(*args), jnp.bfloat16)


def test_moe_aux(rng):
    args, _ = _layer(rng)
    x, logits, w_in, w_out = args
    _, aux = moe_xla.moe(*args, top_k=2, return_aux=True)
    _, ids = reference.route(logits, top_k=2)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    np.testing.assert_allclose(aux.load_balance_loss, E * np.sum(counts / (2 * T) * probs.mean(0)), rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, np.mean(np.asarray(jax.nn.logsumexp(logits, axis=-1)) ** 2), rtol=1e-5)


@pytest.mark.parametrize("case", [dict(top_k=2), dict(top_k=3, score="sigmoid", bias=True, n_groups=4, topk_groups=2)])
def test_moe_grad_matches_reference(rng, case):
    args, extra = _layer(rng, shared=True)
    kw = {**_kw(rng, case), **extra}
    ct = normal(rng, (T, H), jnp.float32)

    def loss(fn, *a):
        return jnp.sum(fn(*a, **kw) * ct)

    ours = jax.jit(jax.grad(lambda *a: loss(moe_xla.moe, *a), argnums=(0, 1, 2, 3)))(*args)
    ref = jax.jit(jax.grad(lambda *a: loss(reference.moe, *a), argnums=(0, 1, 2, 3)))(*args)
    for name, o, r in zip(("x", "router_logits", "w_in", "w_out"), ours, ref):
        assert o.shape == r.shape, name
        assert_close(o, r, jnp.float32, scale=10)


def test_moe_stack_under_scan_and_checkpoint(rng):
    layers = 3
    x = normal(rng, (T, H), jnp.float32)
    router = normal(rng, (layers, H, E), jnp.float32) * 0.3
    w_in = normal(rng, (layers, E, H, 2 * F), jnp.float32) / 4
    w_out = normal(rng, (layers, E, F, H), jnp.float32) / 4

    def model(params, fn):
        @jax.checkpoint
        def block(h, p):
            r, wi, wo = p
            return h + fn(h, jnp.dot(h, r, precision="highest"), wi, wo, top_k=2), None

        h, _ = jax.lax.scan(block, x, params)
        return jnp.sum(h**2)

    params = (router, w_in, w_out)
    ours = jax.jit(jax.grad(lambda p: model(p, moe_xla.moe)))(params)
    ref = jax.jit(jax.grad(lambda p: model(p, reference.moe)))(params)
    for o, r in zip(ours, ref):
        assert_close(o, r, jnp.float32, scale=10)


def test_moe_is_bitwise_deterministic(rng):
    args, _ = _layer(rng, t=300)
    f = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(moe_xla.moe(*a, top_k=3) ** 2), argnums=(0, 1, 2, 3)))
    first, second = f(*args), f(*args)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


def test_moe_hlo_reads_as_the_algorithm(rng):
    args, _ = _layer(rng)
    platform = "cuda" if ON_GPU else "cpu"
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(moe_xla.moe(*a, top_k=2)), argnums=(0, 2))).lower(*args).compile().as_text()
    for op in ("route", "permute", "gmm", "unpermute", "tgmm"):
        assert f'custom_call_target="{target_name(op, platform)}"' in hlo, op
    for stage in ("route", "dispatch", "gmm_in", "act", "gmm_out", "combine"):
        assert f"moe_xla/{stage}" in hlo, stage
    for collective in ("all-gather", "all-to-all", "all-reduce"):
        assert collective not in hlo


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: (a[0][:, :5],) + a[1:], ValueError, r"w_in.shape\[1\] \(H of x\) = 5, got 16"),
    (lambda a: (a[0], a[1][:, :4]) + a[2:], ValueError, r"router_logits of shape \(37, 8\)"),
    (lambda a: a[:3] + (a[3][:, :3],), ValueError, r"w_out of shape \(8, 8, 16\)"),
    (lambda a: (a[0], a[1], a[2].astype(jnp.bfloat16), a[3]), TypeError, "w_in of the dtype of x"),
])
def test_moe_bad_input(rng, change, exc, match):
    args, _ = _layer(rng)
    with pytest.raises(exc, match=match):
        moe_xla.moe(*change(args), top_k=2)
    with pytest.raises(ValueError, match="activation in"):
        moe_xla.moe(*args, top_k=2, activation="tanh")
