"""The expert-parallel layer (moe(mesh=..., expert_axis=...)) on 8 CPU devices against the
independent MoE layer of tests/independent.py: every activation, both scores, shared
experts, the aux values and the gradients of a loss that uses all of them.

The cases rotate through the EP options that run on CPU (the padded and the ragged
transport, the latter through its all_to_all stand-in; dedup on and off; a 1-D mesh of
8 ranks and a 2 x 4 data x expert mesh; a capacity factor small enough to need further
rounds), so each activation and score meets a different exchange. The checks are those of
test_layer_values.py (check_against_oracle), so the EP layer is held to the same numbers
as the single-device layer, without trusting either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_xla
import independent as ind
from conftest import normal, requires_8_devices
from test_layer_values import ROUTINGS, check_against_oracle, combined_loss, inputs

pytestmark = requires_8_devices

T, H = 32, 12  # 32 tokens: 4 per device on 8 devices


def _mesh(shape):
    devices = jax.devices()[:8]
    if shape == (8,):
        return Mesh(np.array(devices), ("ep",))
    return Mesh(np.array(devices).reshape(shape), ("data", "ep"))


# (activation, routing, mesh shape, EP options, gradients too): every activation with both
# scores. The backward pass of the EP layer is the costly compile, so four cases take
# gradients: both scores, both transports, dedup on and off, and capacity rounds.
CASES = [
    ("swiglu", "softmax", (8,), dict(transport="padded", dedup=False), True),
    ("swiglu", "sigmoid_bias_groups", (2, 4), dict(transport="ragged", dedup=True), True),
    ("geglu", "softmax", (2, 4), dict(transport="padded", dedup=True, capacity_factor=0.5), False),
    ("geglu", "sigmoid_bias_groups", (8,), dict(transport="padded", dedup=False), False),
    ("gelu", "softmax", (8,), dict(transport="ragged", dedup=False), False),
    ("gelu", "sigmoid_bias_groups", (2, 4), dict(transport="padded", dedup=True), False),
    ("silu", "softmax", (2, 4), dict(transport="padded", dedup=False), False),
    ("silu", "sigmoid_bias_groups", (8,), dict(transport="padded", dedup=True, capacity_factor=0.5), True),
    ("relu", "softmax", (8,), dict(transport="padded", dedup=True), False),
    ("relu", "sigmoid_bias_groups", (2, 4), dict(transport="ragged", dedup=False), False),
]


@pytest.mark.parametrize("activation,routing,mesh_shape,ep,grads", CASES,
                         ids=[f"{a}-{r}-{'x'.join(map(str, m))}-" + "-".join(f"{k}={v}" for k, v in o.items())
                              + ("-grads" if g else "") for a, r, m, o, g in CASES])
def test_ep_layer_matches_independent_layer(rng, activation, routing, mesh_shape, ep, grads):
    x, logits, w_in, w_out, shared, kw = inputs(rng, activation, ROUTINGS[routing], t=T)
    ct = normal(rng, (T, H), jnp.float32)
    mesh = _mesh(mesh_shape)

    def ep_moe(*a, **k):
        return moe_xla.moe(*a, mesh=mesh, expert_axis="ep", **ep, **k)

    args = (x, logits, w_in, w_out, shared)
    loss = combined_loss(ep_moe, ct, activation, kw)
    if grads:
        (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)
    else:
        out, g = jax.jit(lambda *a: loss(*a)[1])(*args), None
    check_against_oracle(args, ct, activation, kw, (out, g))


def _first_choice(logits, expert):
    """Rows of logits with `expert` raised to 1 above the row's largest logit."""
    logits = logits.copy()
    logits[:, expert] = logits.max(-1) + 1.0
    return logits


def test_ep_capacity_rounds_with_a_skewed_router(rng):
    """Every token's first choice is expert 5 (one rank gets 8x its balanced load), so the
    capacity factor forces further rounds; values still match the independent layer."""
    x, logits, w_in, w_out, shared, kw = inputs(rng, "swiglu", ROUTINGS["softmax"], t=T)
    logits = ind.separated_logits(rng, (T, 8), 2, transform=lambda a: _first_choice(a, 5))
    ct = normal(rng, (T, H), jnp.float32)
    mesh = _mesh((8,))

    def ep_moe(*a, **k):
        return moe_xla.moe(*a, mesh=mesh, expert_axis="ep", capacity_factor=1.0, **k)

    args = (x, logits, w_in, w_out, shared)
    grad = jax.value_and_grad(combined_loss(ep_moe, ct, "swiglu", kw), argnums=(0, 1, 2, 3, 4), has_aux=True)
    (_, out), grads = jax.jit(grad)(*args)
    assert int(out[1].tokens_per_expert[5]) == T
    check_against_oracle(args, ct, "swiglu", kw, (out, grads))


def _gathered_first_product(monkeypatch, mode: str):
    """Within the EP layer's experts: "copy" (the received rows copied into groups), "gather"
    (gather_gmm reads them where they arrived, and so does the derivative), or
    "gather_copy_derivative" (gathered forward, the copy path's derivative: what "auto"
    does on a Hopper GPU for w_in wider than GATHER_DERIVATIVE_MAX_N)."""
    if mode == "gather_copy_derivative":
        monkeypatch.setattr(moe_xla.first_product, "choose", lambda *a: "gather")
        monkeypatch.setattr(moe_xla.first_product, "derivative_gathers", lambda w: False)
        return moe_xla.first_product.forced("auto")
    return moe_xla.first_product.forced(mode)


@pytest.mark.parametrize("ep", [dict(dedup=True), dict(dedup=False, capacity_factor=0.5)], ids=["dedup", "rounds"])
def test_ep_gathered_first_product_equals_copied(rng, monkeypatch, ep):
    """The receiving rank's first product gathering its received rows (first_product.
    GatheredRows, with slots naming fewer or more rows than the grouped GEMMs' budget)
    gives the copied rows' values and gradients bitwise on CPU (gather_rows + gmm move the
    same rows; both derivatives sum them in the same order)."""
    # 4 experts per rank, 4 per token: a row asks for up to 4 of its rank's experts.
    x, logits, w_in, w_out, _, _ = inputs(rng, "swiglu", ROUTINGS["softmax"], t=T, e=32)
    ct = normal(rng, (T, H), jnp.float32)
    mesh = _mesh((8,))

    def layer(*a):
        return moe_xla.moe(*a, top_k=4, mesh=mesh, expert_axis="ep", **ep)

    def uses(f, primitive):
        return primitive in str(jax.make_jaxpr(f)(x, logits, w_in, w_out))

    results = {}
    for mode in ("copy", "gather", "gather_copy_derivative"):
        with monkeypatch.context() as m, _gathered_first_product(m, mode):
            # Fresh functions per mode: jit reuses a function's trace, made under one mode.
            fwd = jax.jit(lambda *a: layer(*a))
            grads = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a) * ct), (0, 1, 2, 3)))
            assert uses(fwd, "moe_xla_gather_gmm") == (mode != "copy"), mode
            # Differentiated, the first product is its derivative rule's.
            assert uses(grads, "moe_xla_gather_tgmm") == (mode == "gather"), mode
            results[mode] = (fwd(x, logits, w_in, w_out), grads(x, logits, w_in, w_out))
    for mode in ("gather", "gather_copy_derivative"):
        for a, b in zip(jax.tree.leaves(results[mode]), jax.tree.leaves(results["copy"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=mode)
