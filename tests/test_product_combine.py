"""product_combine.activate_gmm_combine: the expert activation, the second expert product
and the weighted combine, whose derivative moves the routing weights in front of the
product.

Forward, gradients (h, w_out, routing weights), forward mode, vmap and second order against
a dense formula that shares nothing with it (the activation of tests/independent.py,
one-hot matrices and einsum in float32), for every activation, on row maps with entries
naming no row, rows no entry names and rows past the groups, with the cotangent gathered
into c and read through the row map (product_combine.forced, "copy" and "gather"); moe()'s
step keeps neither the product's output nor a, has no scatter-add and runs the fused
activation backward, and gathers no c where its backward gathers.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, normal, rel_err
from independent import ACTIVATIONS, GATED_ACTIVATIONS, activation_fn
from jax.test_util import check_grads

import moe_xla
from moe_xla import product_combine
from moe_xla.product_combine import activate_gmm_combine

T, K, F, H = 24, 3, 8, 12
SIZES = np.array([20, 0, 31, 9], np.int32)  # 60 of the 72 rows: the last 12 are past the groups


def _row_map(rng, kind):
    """[T*K] int32: a permutation of the rows, or one with entries naming no row (-1, T*K,
    INT32 extremes), which leaves as many rows unnamed."""
    rm = rng.permutation(T * K).astype(np.int64)
    if kind == "holes":
        rm[rng.choice(T * K, 8, replace=False)] = [-1, T * K, T * K + 5, -(2**31), 2**31 - 1, -7, T * K, -1]
    return jnp.asarray(rm.astype(np.int32))


@pytest.fixture(params=["copy", "gather"])
def combined(request):
    """activate_gmm_combine as _dense's signature, its derivative reading the cotangent's
    rows gathered into c ("copy") or through the row map ("gather": gathered_backward)."""
    gathered = request.param == "gather"

    def combine(h, w_out, weights, row_map, activation="swiglu"):
        return activate_gmm_combine(h, w_out, jnp.asarray(SIZES), row_map, weights, _row_pairs(row_map), activation,
                                    gathered)

    return combine


def _row_pairs(row_map):
    """row_map's inverse by comparison: the entry naming each row, -1 where none does."""
    hits = row_map[None, :] == jnp.arange(T * K, dtype=jnp.int32)[:, None]
    return jnp.where(jnp.any(hits, axis=1), jnp.argmax(hits, axis=1), -1).astype(jnp.int32)


def _inputs(rng, dtype, activation="swiglu"):
    h = normal(rng, (T * K, 2 * F if activation in GATED_ACTIVATIONS else F), dtype)
    w_out = (normal(rng, (len(SIZES), F, H), jnp.float32) / np.sqrt(F)).astype(dtype)
    weights = jnp.asarray(rng.uniform(0.05, 1.0, (T, K)), jnp.float32)
    return h, w_out, weights


def _dense(h, w_out, weights, row_map, activation="swiglu"):
    """y = P @ (act(h) @ W[group of row]) with P[t, r] = weights[t, j] where
    row_map[t*K + j] = r and the rows past the groups 0, in float32 from one-hot matrices."""
    rows = T * K
    a = activation_fn(activation)(h.astype(jnp.float32))
    group = np.repeat(np.arange(len(SIZES)), SIZES)
    member = jnp.asarray(np.arange(len(SIZES))[None, :] == np.pad(group, (0, rows - len(group)),
                                                                  constant_values=-1)[:, None], jnp.float32)
    out = jnp.einsum("rf,rg,gfh->rh", a.astype(jnp.float32), member, w_out.astype(jnp.float32), precision="highest")
    picks = (row_map[:, None] == jnp.arange(rows)[None, :]).astype(jnp.float32).reshape(T, K, rows)
    return jnp.einsum("tk,tkr,rh->th", weights, picks, out, precision="highest")


def _grads(f, h, w_out, weights, row_map, ct, activation="swiglu"):
    loss = lambda *x: jnp.sum(f(*x, row_map, activation).astype(jnp.float32) * ct)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(h, w_out, weights)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["permutation", "holes"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_forward_and_gradients_match_the_dense_formula(rng, kind, dtype, activation, combined):
    h, w_out, weights = _inputs(rng, dtype, activation)
    row_map = _row_map(rng, kind)
    ct = normal(rng, (T, H), jnp.float32)
    y = jax.jit(combined, static_argnums=4)(h, w_out, weights, row_map, activation)
    assert y.dtype == dtype
    assert_close(y, _dense(h, w_out, weights, row_map, activation), dtype)
    got = _grads(combined, h, w_out, weights, row_map, ct, activation)
    want = _grads(_dense, h, w_out, weights, row_map, ct, activation)
    # bf16 / f16 gradients round a, g and omega * a where the dense formula does not.
    for name, x, y_ in zip(("d h", "d w_out", "d weights"), got, want):
        assert x.dtype == y_.dtype or name != "d weights"
        assert_close(x, y_, dtype, scale=2.0)
    # Rows no entry names and rows past the groups get no gradient in h.
    named = np.isin(np.arange(T * K), np.asarray(row_map))
    past = np.arange(T * K) >= SIZES.sum()
    assert np.all(np.asarray(got[0], np.float32)[~named | past] == 0)


def test_forward_mode_and_vmap_of_the_gradient(rng, combined):
    h, w_out, weights = _inputs(rng, jnp.float32)
    row_map = _row_map(rng, "holes")
    tangents = (normal(rng, h.shape, jnp.float32), normal(rng, w_out.shape, jnp.float32),
                normal(rng, weights.shape, jnp.float32))
    primals = (h, w_out, weights)
    y, dy = jax.jit(lambda p, t: jax.jvp(lambda *x: combined(*x, row_map), p, t))(primals, tangents)
    y_ref, dy_ref = jax.jvp(lambda *x: _dense(*x, row_map), primals, tangents)
    assert_close(y, y_ref, jnp.float32)
    assert_close(dy, dy_ref, jnp.float32)
    cts = normal(rng, (3, T, H), jnp.float32)

    def grads(f):
        return jax.jit(jax.vmap(lambda ct: jax.grad(lambda *x: jnp.sum(f(*x, row_map) * ct), argnums=(0, 1, 2))(
            *primals)))(cts)

    for x, y_ in zip(grads(combined), grads(_dense)):
        assert_close(x, y_, jnp.float32)

    def grads_of_vmap(f):  # the tangent primitive batched (its formula), then transposed
        def loss(hs, w, ws):
            return jnp.sum(jax.vmap(lambda a, b: f(a, w, b, row_map))(hs, ws) * cts[:2])
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.stack([h, 0.5 * h]), w_out,
                                                          jnp.stack([weights, weights[::-1]]))

    for x, y_ in zip(grads_of_vmap(combined), grads_of_vmap(_dense)):
        assert_close(x, y_, jnp.float32)
    check_grads(lambda *x: combined(*x, row_map), primals, order=2, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("argnums", [(2,), (0,), (1,), (0, 2), (1, 2)])
def test_gradient_in_some_inputs(rng, combined, argnums):
    """Differentiating only some of h, w_out and the routing weights (the others constants:
    the tangent's transpose computes only the wanted cotangents) gives the same."""
    primals = _inputs(rng, jnp.float32)
    row_map = _row_map(rng, "permutation")
    ct = normal(rng, (T, H), jnp.float32)

    def grads(f):
        return jax.jit(jax.grad(lambda *x: jnp.sum(f(*x, row_map) * ct), argnums=argnums))(*primals)

    for got, want in zip(grads(combined), grads(_dense)):
        assert rel_err(got, want) < 1e-5


def test_gradient_of_the_gradient(rng, combined):
    """Second order (the fused kernel's own derivative is its jnp formula's): a Hessian-vector
    product of a loss of the layer, forward over reverse, against the dense formula's."""
    h, w_out, weights = _inputs(rng, jnp.float32, "geglu")
    row_map = _row_map(rng, "holes")
    ct = normal(rng, (T, H), jnp.float32)
    v = (normal(rng, h.shape, jnp.float32), normal(rng, w_out.shape, jnp.float32),
         normal(rng, weights.shape, jnp.float32))

    def hvp(f):
        grad = jax.grad(lambda *x: jnp.sum(f(*x, row_map, "geglu") * ct) ** 2 / 100, argnums=(0, 1, 2))
        return jax.jit(lambda p, t: jax.jvp(lambda *x: grad(*x), p, t)[1])((h, w_out, weights), v)

    for x, y_ in zip(hvp(combined), hvp(_dense)):
        assert rel_err(x, y_) < 1e-4


def _layer_inputs(rng, t=32, h=40, f=24, e=4):
    return (normal(rng, (t, h), jnp.float32), normal(rng, (t, e), jnp.float32),
            normal(rng, (e, h, 2 * f), jnp.float32) / np.sqrt(h), normal(rng, (e, f, h), jnp.float32) / np.sqrt(f))


def test_the_step_keeps_neither_the_product_nor_a(rng):
    """moe()'s residuals for its backward: x_sorted [T*k, H] (w_in's gradient) is the only
    [T*k, H] array and no [T*k, F] array is kept (a is recomputed from h)."""
    args = _layer_inputs(rng)
    t, h = args[0].shape
    f, k = args[3].shape[1], 2
    _, vjp = jax.vjp(lambda *x: moe_xla.moe(*x, top_k=k), *args)
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    assert shapes.count((t * k, h)) == 1, shapes
    assert (t * k, f) not in shapes, shapes
    assert (t * k, 2 * f) in shapes, shapes  # h, which the activation's backward reads


def test_the_gradient_has_no_scatter_add_and_gathers_the_cotangent_once(rng, combined):
    """A float scatter-add sums in an order that varies on GPUs: the weights' cotangent is
    a gather, either way. moe()'s step (which copies on the CPU) gathers its cotangent into
    expert order in one gather_rows."""
    h, w_out, weights = _inputs(rng, jnp.float32)
    row_map = _row_map(rng, "holes")
    grad = jax.grad(lambda *x: jnp.sum(combined(*x, row_map)), argnums=(0, 1, 2))
    text = str(jax.make_jaxpr(grad)(h, w_out, weights))
    for banned in ("scatter-add", "scatter_add"):
        assert not re.search(rf"\b{banned}\[", text), f"{banned} in activate_gmm_combine's gradient"
    step = jax.grad(lambda *x: jnp.sum(moe_xla.moe(*x, top_k=2)), argnums=(0, 1, 2, 3))
    step_text = str(jax.make_jaxpr(step)(*_layer_inputs(rng)))
    assert step_text.count("moe_xla_gather_rows[") == 1
    # d h, the routing weights' d omega and w_out's gradient rows omega * a come from one
    # pass of the fused kernel: the step runs the activation (swiglu's logistic) once, in
    # the forward, and orders d h after w_out's gradient.
    assert step_text.count("moe_xla_activate_weighted_grad[") == 1
    assert step_text.count("logistic") == 1
    assert step_text.count("moe_xla_after[") == 1


def test_the_fused_backward_keeps_the_step_s_memory(rng, monkeypatch):
    """With w_out's gradient ordered before the first product's backward (primitives/after),
    the rows b = omega * a the activation's backward writes and the cotangent rows they pair
    with are freed before that product's operands are live: XLA:CPU's temporary memory of
    the step is below what it is without the ordering."""
    import moe_xla.primitives.activate_gmm_combine_tangent as tangent

    cpu = jax.devices("cpu")[0]
    args = tuple(jax.device_put(a, cpu) for a in (
        normal(rng, (512, 256), jnp.bfloat16), normal(rng, (512, 16), jnp.float32),
        normal(rng, (16, 256, 256), jnp.bfloat16), normal(rng, (16, 128, 256), jnp.bfloat16)))

    def temp_bytes():
        jax.clear_caches()  # the transposed remat jaxprs are cached
        step = jax.jit(jax.grad(lambda *x: jnp.sum(moe_xla.moe(*x, top_k=4).astype(jnp.float32)), (0, 1, 2, 3)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    ordered = temp_bytes()
    monkeypatch.setattr(tangent, "after", lambda x, dep: x)
    unordered = temp_bytes()
    jax.clear_caches()
    assert ordered < unordered, (ordered, unordered)


def test_a_gathering_backward_writes_no_gathered_cotangent(rng):
    """With the backward gathering, the step's only gathers of rows are inside the products:
    gather_gmm for d a and gather_tgmm for d w_out (written as [E, F, H]: transpose_out), no
    gather_rows of the cotangent."""
    step = jax.grad(lambda *x: jnp.sum(moe_xla.moe(*x, top_k=2)), argnums=(0, 1, 2, 3))
    with product_combine.forced("gather"):
        text = str(jax.make_jaxpr(step)(*_layer_inputs(rng)))
    assert text.count("moe_xla_gather_rows[") == 0
    assert text.count("moe_xla_gather_gmm[") == 1
    assert text.count("moe_xla_gather_tgmm[") == 1
    assert re.search(r"moe_xla_gather_tgmm\[[^\]]*transpose_out=True", text)


def test_the_choice_follows_forced_and_copies_on_the_cpu(rng):
    h, w_out, weights = _inputs(rng, jnp.bfloat16)
    assert not product_combine.backward_gathers(h, w_out, T)  # auto on the CPU: copies
    for mode, gathers in (("gather", True), ("copy", False)):
        with product_combine.forced(mode):
            assert product_combine.backward_gathers(h, w_out, T) is gathers
    with pytest.raises(ValueError, match="expected a mode in"):
        with product_combine.forced("scatter"):
            pass


def test_the_heuristic_on_a_hopper_gpu(rng, monkeypatch):
    """backward_gathers' GPU branch: bf16, both gather kernels applicable (rows of 16-byte multiples) and F within the bound."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(product_combine._lib, "local_gpus_hopper", lambda: True)
    monkeypatch.setattr(product_combine, "GATHER_MAX_F", 16)

    def ask(dtype, f=8, h=16):
        return product_combine.backward_gathers(jnp.zeros((T * K, 2 * f), dtype), jnp.zeros((4, f, h), dtype), T)
    assert ask(jnp.bfloat16)
    assert not ask(jnp.float32)
    assert not ask(jnp.bfloat16, f=24)  # F past GATHER_MAX_F
    assert not ask(jnp.bfloat16, h=12)  # H rows not 16-byte multiples: no gather kernel
    monkeypatch.setattr(product_combine._lib, "local_gpus_hopper", lambda: False)
    assert not ask(jnp.bfloat16)
