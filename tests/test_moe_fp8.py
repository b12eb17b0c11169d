"""moe(quantization="fp8_blockwise"): the layer with both expert products in FP8 blockwise.

Forward and gradients within FP8 accuracy of the bf16 layer; pre-quantised weights give
the same forward as arrays; the expert-parallel layer on 8 CPU devices, which sends the
tokens' FP8 rows, equals the one-device FP8 layer bitwise in the forward (rows are
quantised one by one, so every element sees the same operands) and in its gradients
within 1% of that layer's on the rows it multiplied; jit, grad and checkpoint; bad options
named.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normal, rel_err, requires_8_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla
from moe_xla.ep.sizing import exchange_sizes

T, H, F, E, K = 256, 256, 128, 8, 2


def _inputs(rng, dtype=jnp.bfloat16, h=H):
    x = normal(rng, (T, h), dtype)
    logits = normal(rng, (T, E), jnp.float32)
    w_in = normal(rng, (E, h, 2 * F), dtype) * (1 / 16)
    w_out = normal(rng, (E, F, h), dtype) * (1 / 12)
    return x, logits, w_in, w_out


def _loss(quantization, **kw):
    def f(x, logits, w_in, w_out, ct):
        y = moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization=quantization, **kw)
        return jnp.sum(y.astype(jnp.float32) * ct)
    return f


@pytest.mark.parametrize("quantization", ["fp8_blockwise", "fp8_blockwise_fp8_wgrad"])
def test_fp8_layer_within_fp8_accuracy_of_bf16(rng, quantization):
    args = _inputs(rng)
    ct = normal(rng, (T, H), jnp.float32)
    y8 = jax.jit(lambda *a: moe_xla.moe(*a, top_k=K, quantization=quantization))(*args)
    y16 = jax.jit(lambda *a: moe_xla.moe(*a, top_k=K))(*args)
    assert y8.dtype == jnp.bfloat16
    assert rel_err(y8, y16) < 0.1  # E4M3 keeps 3 mantissa bits: ~5% per product on random data
    g8 = jax.jit(jax.grad(jax.checkpoint(_loss(quantization)), argnums=(0, 1, 2, 3)))(*args, ct)
    g16 = jax.jit(jax.grad(_loss(None), argnums=(0, 1, 2, 3)))(*args, ct)
    for name, a, b in zip(("dx", "dlogits", "dw_in", "dw_out"), g8, g16):
        assert rel_err(a, b) < 0.12, name


def test_prequantised_weights_give_the_same_forward(rng):
    x, logits, w_in, w_out = _inputs(rng)
    arrays = moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise")
    pre = moe_xla.moe(x, logits, moe_xla.quantize_fp8_weights(w_in), moe_xla.quantize_fp8_weights(w_out), top_k=K,
                      quantization="fp8_blockwise")
    np.testing.assert_array_equal(np.asarray(arrays, np.float32), np.asarray(pre, np.float32))
    with pytest.raises(TypeError, match="w_in is an Fp8Weights"):
        moe_xla.moe(x, logits, moe_xla.quantize_fp8_weights(w_in), w_out, top_k=K)
    with pytest.raises(ValueError, match=r"expected quantization in \(None, 'fp8_blockwise', "):
        moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="int8")


def test_quantized_weights_are_used_and_the_arrays_get_the_gradients(rng):
    """quantized_weights made once outside: forward and gradients bitwise those of quantising
    inside, no weight quantisation in the step; quantised from other weights, the forward
    follows them while the gradients stay those of the arrays passed."""
    x, logits, w_in, w_out = _inputs(rng)
    ct = normal(rng, (T, H), jnp.float32)
    qw = (moe_xla.quantize_fp8_weights(w_in), moe_xla.quantize_fp8_weights(w_out))

    def loss(x, logits, w_in, w_out, qw):
        y = moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise", quantized_weights=qw)
        return jnp.sum(y.astype(jnp.float32) * ct)

    inside = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out, None)
    outside = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out, qw)
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(outside)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    step = lambda qw: jax.jit(jax.grad(loss, argnums=(2, 3))).lower(x, logits, w_in, w_out, qw).as_text()  # noqa: E731
    assert "moe_xla_quantize_fp8_weights" in step(None)  # quantised inside: the weights' one call
    assert "moe_xla_quantize_fp8_weights" not in step(qw) and "moe_xla_quantize_fp8_blocks" not in step(qw)

    stale = (moe_xla.quantize_fp8_weights(w_in * 2), qw[1])  # e.g. quantised before an update
    y_stale = moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise", quantized_weights=stale)
    y_twice = moe_xla.moe(x, logits, w_in * 2, w_out, top_k=K, quantization="fp8_blockwise")
    np.testing.assert_array_equal(np.asarray(y_stale, np.float32), np.asarray(y_twice, np.float32))

    with pytest.raises(TypeError, match=r"quantized_weights needs an FP8 quantization \('fp8_blockwise'\)"):
        moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantized_weights=qw)
    with pytest.raises(ValueError, match=r"expected quantized_weights' w_out of shape \(8, 128, 256\)"):
        moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise", quantized_weights=(qw[0], qw[0]))
    with pytest.raises(TypeError, match="expected quantized_weights = "):
        moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise", quantized_weights=qw[0])


def _ep_layer(**options):
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    split = NamedSharding(mesh, P("ep"))
    return split, {"mesh": mesh, "expert_axis": "ep", "dedup": False, **options}


def _unfused_loss(quantization):
    """_loss's one-device layer with the unfused backward (_mlp_then_unpermute)."""
    wgrad = moe_xla.fp8.QUANTIZATION_WGRAD[quantization]

    def f(x, logits, w_in, w_out, ct):
        weights, ids = moe_xla.route(logits, K)
        rows, group_sizes, row_map = moe_xla.permute(x, ids, E)
        y = _mlp_then_unpermute(rows, w_in, w_out, group_sizes, row_map, weights, wgrad)
        return jnp.sum(y.astype(jnp.float32) * ct)
    return f


@requires_8_devices
@pytest.mark.parametrize("quantization,options", [
    ("fp8_blockwise", {}), ("fp8_blockwise", {"dedup": True}), ("fp8_blockwise", {"capacity_factor": 0.25}),
    ("fp8_blockwise", {"transport": "ragged", "chunks": 2}),
    ("fp8_blockwise_fp8_wgrad", {}), ("fp8_blockwise_fp8_wgrad", {"dedup": True})],
    # Not the FP8 wgrad with rounds: each round's wgrad quantises its own rows of an expert
    # in 128-row tiles, other tiles than one device's, so it differs at FP8 accuracy.
    ids=["plain", "dedup", "rounds", "ragged-chunks", "fp8_wgrad", "fp8_wgrad-dedup"])
def test_expert_parallel_fp8_equals_one_device(rng, quantization, options):
    """The EP layer sends the tokens' FP8 rows (ep/fp8_dispatch.py). Its forward is the
    one-device layer's bitwise (each rank receives the FP8 rows that layer quantises; with
    dedup a token's results are summed in another order, so within rounding; with
    capacity_factor the rows travel in several rounds, each sending its FP8 rows). Its
    gradients are those of the one-device layer on the values it multiplied, x_hat =
    dequantize(quantize(x)), within 1% (with either wgrad: a rank's rows of an expert come
    in token order, as on one device, so the FP8 wgrad's tiles match), by the rule its
    expert ranks' combine (fp8.mlp_combine_fp8) amounts to: without dedup a row's weight
    there is 1 and the routing weight is applied at the token's rank, so the FP8 dgrad
    quantises the weighted cotangent, the unfused rule (the products' own, then
    unpermute's: _unfused_loss); with dedup the expert rank applies the routing weights
    and quantises the unweighted cotangent, as the one-device moe() does. d x is the
    straight-through estimate. The weight gradient d w_in, x_hat^T d h, is nearer the
    x_hat layer's than the x layer's (x^T d h) by far: it multiplies the rows that travelled."""
    x, logits, w_in, w_out = _inputs(rng)
    split, kw = _ep_layer(**options)
    dedup = options.get("dedup", False)
    one = moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization=quantization)
    placed = [jax.device_put(a, split) for a in (x, logits, w_in, w_out)]
    ep = jax.jit(lambda *a: moe_xla.moe(*a, top_k=K, quantization=quantization, **kw))(*placed)
    if dedup:  # a token's results are summed per rank first, then across ranks: another order
        assert rel_err(ep, one) < 1e-2
    else:
        np.testing.assert_array_equal(np.asarray(ep, np.float32), np.asarray(one, np.float32))
    ct = normal(rng, (T, H), jnp.float32)
    grads = (0, 2, 3)
    g_ep = jax.jit(jax.grad(_loss(quantization, **kw), argnums=grads))(*placed, jax.device_put(ct, split))
    x_hat = moe_xla.dequantize_fp8_rows(*moe_xla.quantize_fp8_rows(x), x.dtype)
    one_device = _loss(quantization) if dedup else _unfused_loss(quantization)
    g_hat = jax.grad(one_device, argnums=grads)(x_hat, logits, w_in, w_out, ct)
    for a, b in zip(g_ep, g_hat):
        assert rel_err(a, b) < 1e-2
    g_x = jax.grad(one_device, argnums=2)(x, logits, w_in, w_out, ct)
    assert rel_err(g_ep[1], g_hat[1]) < 0.25 * rel_err(g_ep[1], g_x)


@requires_8_devices
def test_expert_parallel_fp8_dedup_rounds_equals_one_device(rng):
    """With dedup and capacity_factor together an expert rank's grouped rows (P C pairs per
    round) are fewer than its received rows times their slots (P rows mult): the FP8 MLP and
    combine run on the P C rows, the row map names rows past them. Forward and gradients
    against the one-device layer on x_hat (the values the ranks multiplied), as with dedup."""
    x, logits, w_in, w_out = _inputs(rng)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    sizes = exchange_sizes(T // 4, K, E, 4, capacity_factor=0.5)
    assert sizes.rounds > 1 and sizes.pairs < sizes.peers * sizes.rows * sizes.mult
    kw = dict(mesh=mesh, expert_axis="ep", capacity_factor=0.5)
    split = NamedSharding(mesh, P("ep"))
    placed = [jax.device_put(a, split) for a in (x, logits, w_in, w_out)]
    ep = jax.jit(lambda *a: moe_xla.moe(*a, top_k=K, quantization="fp8_blockwise", **kw))(*placed)
    assert rel_err(ep, moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise")) < 1e-2
    ct = normal(rng, (T, H), jnp.float32)
    g_ep = jax.jit(jax.grad(_loss("fp8_blockwise", **kw), argnums=(0, 2, 3)))(*placed, jax.device_put(ct, split))
    x_hat = moe_xla.dequantize_fp8_rows(*moe_xla.quantize_fp8_rows(x), x.dtype)
    g_hat = jax.grad(_loss("fp8_blockwise"), argnums=(0, 2, 3))(x_hat, logits, w_in, w_out, ct)
    for a, b in zip(g_ep, g_hat):
        assert rel_err(a, b) < 1e-2


def _all_to_all_operands(text):
    """(last dimension, element type) of every all_to_all operand of a lowered program."""
    return re.findall(r"all_to_all.*\(tensor<(?:\d+x)*(\d+)x(\w+)>\)", text)


@requires_8_devices
@pytest.mark.parametrize("quantization", [None, "fp8_blockwise"])
def test_expert_parallel_dispatch_sends_fp8_rows(rng, quantization):
    """With FP8 products the forward's dispatch moves the tokens as FP8 bytes (u8, H per row)
    and their scales (f32, H / 128 per row); only the results coming back are bf16 rows.
    Without, the tokens travel as bf16 rows too."""
    x, logits, w_in, w_out = _inputs(rng)
    split, kw = _ep_layer()
    placed = [jax.device_put(a, split) for a in (x, logits, w_in, w_out)]
    text = jax.jit(lambda *a: moe_xla.moe(*a, top_k=K, quantization=quantization, **kw)).lower(*placed).as_text()
    rows = sorted(t for n, t in _all_to_all_operands(text) if int(n) in (H, H // 128))
    if quantization is None:
        assert rows == ["bf16", "bf16"]
    else:
        assert rows == ["bf16", "f32", "ui8"]


@pytest.mark.parametrize("h", [H, 129], ids=["even_H", "odd_H"])
def test_token_order_quantisation_equals_quantising_the_sorted_rows(rng, h):
    """moe() writes the sorted rows and their FP8 rows in one pass over the tokens; the
    result must be bitwise that of permuting, then quantising the T*k sorted rows in the
    same expert MLP and combine (forward and gradients)."""
    from moe_xla.experts import expert_mlp

    x, logits, w_in, w_out = _inputs(rng, h=h)
    ct = normal(rng, (T, h), jnp.float32)

    def sorted_rows_layer(x, logits, w_in, w_out):
        weights, ids = moe_xla.route(logits, K)
        x_sorted, group_sizes, row_map, row_pairs = moe_xla.permute(x, ids, E, return_row_pairs=True)
        return expert_mlp(x_sorted, w_in, w_out, group_sizes, "swiglu", "fp8_blockwise",
                          combine=(row_map, weights, row_pairs))

    def loss(layer):
        return lambda *a: jnp.sum(layer(*a).astype(jnp.float32) * ct)

    moe_layer = lambda *a: moe_xla.moe(*a, top_k=K, quantization="fp8_blockwise")  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.jit(moe_layer)(x, logits, w_in, w_out), np.float32),
                                  np.asarray(jax.jit(sorted_rows_layer)(x, logits, w_in, w_out), np.float32))
    g_moe = jax.jit(jax.grad(loss(moe_layer), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
    g_ref = jax.jit(jax.grad(loss(sorted_rows_layer), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
    for a, b in zip(g_moe, g_ref):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    hlo = jax.jit(moe_layer).lower(x, logits, w_in, w_out).as_text()
    assert hlo.count("moe_xla_expand_quantize_fp8_rows") == 1, "x read once for the sorted rows and their FP8 rows"
    assert hlo.count("moe_xla_quantize_fp8_rows") == 0, "no second quantisation of x or x_sorted"
    assert hlo.count("moe_xla_activate_quantize_fp8") == 1, "act(h) and its rows in one kernel"
    with moe_xla.first_product.forced("gather"):  # FP8 keeps its path
        forced = jax.jit(lambda *a: moe_layer(*a)).lower(x, logits, w_in, w_out).as_text()  # traced anew
    assert forced == hlo


def test_sorted_rows_in_one_pass_are_permute_and_its_quantisation(rng):
    """moe._sorted_rows_fp8: permute's rows, group sizes and row map (entries below 2^-126
    in magnitude as zeros), quantize_fp8_rows of those rows bitwise, and permute's
    cotangent in x."""
    from moe_xla.moe import _sorted_rows_fp8

    x = normal(rng, (T, H), jnp.bfloat16)
    tiny = jnp.asarray(np.ldexp(np.float32(1.5), -130), jnp.bfloat16)  # a bf16 subnormal of float32's range
    x = x.at[3, 5].set(tiny).at[7, 200].set(-tiny)
    _, ids = moe_xla.route(normal(rng, (T, E), jnp.float32), K)
    x_sorted, group_sizes, row_map, row_pairs, (q, scales) = jax.jit(_sorted_rows_fp8, static_argnums=2)(x, ids, E)
    flushed = np.asarray(x, np.float32)
    flushed = np.where(np.abs(flushed) < np.ldexp(np.float32(1), -126), np.copysign(np.float32(0), flushed), flushed)
    want_rows, want_sizes, want_map, want_pairs = moe_xla.permute(jnp.asarray(flushed, jnp.bfloat16), ids, E,
                                                                  return_row_pairs=True)
    np.testing.assert_array_equal(np.asarray(group_sizes), np.asarray(want_sizes))
    np.testing.assert_array_equal(np.asarray(row_map), np.asarray(want_map))
    np.testing.assert_array_equal(np.asarray(row_pairs), np.asarray(want_pairs))
    np.testing.assert_array_equal(np.asarray(x_sorted, np.float32), np.asarray(want_rows, np.float32))
    want_q, want_scales = moe_xla.quantize_fp8_rows(want_rows)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want_q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
    ct = normal(rng, x_sorted.shape, jnp.float32)
    dx = jax.grad(lambda x: jnp.sum(_sorted_rows_fp8(x, ids, E)[0].astype(jnp.float32) * ct))(x)
    dx_permute = jax.grad(lambda x: jnp.sum(moe_xla.permute(x, ids, E)[0].astype(jnp.float32) * ct))(x)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_permute, np.float32))


def _mlp_then_unpermute(x, w_in, w_out, group_sizes, row_map, weights, wgrad):
    """The FP8 expert MLP through gmm_activate_fp8 and gmm_fp8_blockwise, then unpermute:
    each with its own rule (the unweighted d out's FP8 rows, the weights' gradient from the
    product's output)."""
    a, *a_q = moe_xla.fp8.gmm_activate_fp8(x, w_in, group_sizes, "swiglu", wgrad=wgrad)
    out = moe_xla.fp8.gmm_fp8_blockwise(a, w_out, group_sizes, lhs_quantized=tuple(a_q), wgrad=wgrad)
    return moe_xla.unpermute(out, row_map, weights, unique_rows=True)


@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_fused_mlp_combine_equals_the_product_then_unpermute(rng, wgrad):
    """mlp_combine_fp8 against the expert MLP followed by unpermute. With routing weights
    that are powers of two, quantising omega c or c gives the same codes with scales
    omega times apart, so the forward and the gradients of x, w_in and w_out are bitwise
    those of the unfused path; d weights = <g, act(h)> differs from <dy, out> by the two
    paths' different FP8 roundings only (3.2-3.5% here; each is 6% from the bf16 layer's).
    Assignments to an expert id outside [0, E) name rows past every group."""
    x, logits, w_in, w_out = _inputs(rng)
    weights, ids = moe_xla.route(logits, K)
    weights = 2.0 ** jnp.round(jnp.log2(weights))
    ids = ids.at[::7, 1].set(E)  # dropped assignments: rows past the groups
    rows, group_sizes, row_map, row_pairs = moe_xla.permute(x, ids, E, return_row_pairs=True)
    ct = normal(rng, (T, H), jnp.float32)

    def fused(x, w_in, w_out, weights):
        return moe_xla.fp8.mlp_combine_fp8(x, w_in, w_out, group_sizes, row_map, weights, row_pairs, "swiglu",
                                           wgrad=wgrad)

    def unfused(x, w_in, w_out, weights):
        return _mlp_then_unpermute(x, w_in, w_out, group_sizes, row_map, weights, wgrad)

    args = (rows, w_in, w_out, weights)
    outs = [jax.jit(f)(*args) for f in (fused, unfused)]
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * ct), argnums=(0, 1, 2, 3)))(*args)
             for f in (fused, unfused)]
    for name, a, b in zip(("x", "w_in", "w_out"), grads[0][:3], grads[1][:3]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    assert np.any(np.asarray(grads[0][0], np.float32) != 0)
    d_weights, d_weights_unfused = (np.asarray(g[3], np.float32) for g in grads)
    assert np.all(d_weights[::7, 1] == 0) and np.all(d_weights_unfused[::7, 1] == 0)  # rows past the groups
    assert rel_err(d_weights, d_weights_unfused) < 0.05


def test_fused_mlp_combine_is_as_accurate_as_the_unfused_rule(rng):
    """With routing weights that are not powers of two: every gradient of mlp_combine_fp8
    is as near the bf16 layer's as the unfused rule's is (about 5-6% for both; an omega
    applied twice or not at all, or d omega read from the wrong rows, is far off)."""
    from moe_xla.experts import expert_mlp

    x, logits, w_in, w_out = _inputs(rng)
    weights, ids = moe_xla.route(logits, K)
    rows, group_sizes, row_map, row_pairs = moe_xla.permute(x, ids, E, return_row_pairs=True)
    ct = normal(rng, (T, H), jnp.float32)
    layers = (
        lambda x, w_in, w_out, weights: moe_xla.fp8.mlp_combine_fp8(x, w_in, w_out, group_sizes, row_map, weights,
                                                                    row_pairs, "swiglu"),
        lambda x, w_in, w_out, weights: _mlp_then_unpermute(x, w_in, w_out, group_sizes, row_map, weights, "bf16"),
        lambda x, w_in, w_out, weights: expert_mlp(x, w_in, w_out, group_sizes, "swiglu",
                                                   combine=(row_map, weights, row_pairs)))
    fused, unfused, bf16 = (jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * ct),
                                             argnums=(0, 1, 2, 3)))(rows, w_in, w_out, weights) for f in layers)
    for name, a, b, c in zip(("x", "w_in", "w_out", "weights"), fused, unfused, bf16):
        assert rel_err(a, c) <= 1.1 * rel_err(b, c) + 0.005, name
        assert rel_err(a, b) < 0.05, name


def test_the_layer_quantises_each_cotangent_in_the_pass_that_makes_it(rng):
    """One forward+backward of the FP8 layer: x's rows quantised as they are expanded into
    expert order, d out as the combine's transpose expands it, d h in the activation's
    backward: no other row quantisation."""
    x, logits, w_in, w_out = _inputs(rng)
    ct = normal(rng, (T, H), jnp.float32)
    hlo = jax.jit(jax.grad(_loss("fp8_blockwise"), argnums=(0, 1, 2, 3))).lower(
        x, logits, w_in, w_out, ct).as_text()
    assert hlo.count("moe_xla_quantize_fp8_rows") == 0
    assert hlo.count("moe_xla_expand_quantize_fp8_rows") == 2
    assert hlo.count("moe_xla_activate_grad_quantize_fp8") == 1


def _custom_calls(hlo):
    """{primitive name: custom calls of it} in a lowered module's text."""
    calls = re.findall(r"custom_call @moe_xla_(\w+?)_(?:cpu|cuda)_v\d+\(", hlo)
    return {name: calls.count(name) for name in set(calls)}


def test_the_fp8_wgrad_layer_makes_column_tiles_where_it_makes_the_rows(rng):
    """With the FP8 wgrad the layer makes the column tiles of x's sorted rows (forward) and
    of d out = omega c (backward) straight from the token rows (gather_quantize_fp8_group_cols)
    and a's in the activation's kernel (activate_quantize_fp8_group_cols), writing none of
    the three: one forward+backward has two gathers, one activation, no expansion, no
    activation writing a, and column tiles of their own made only for d h (the fused kernel
    that would make them with d h's rows is slower: fp8._mlp_combine_bwd)."""
    x, logits, w_in, w_out = _inputs(rng)
    ct = normal(rng, (T, H), jnp.float32)
    hlo = jax.jit(jax.grad(_loss("fp8_blockwise_fp8_wgrad"), argnums=(0, 1, 2, 3))).lower(
        x, logits, w_in, w_out, ct).as_text()
    counts = _custom_calls(hlo)
    assert counts.get("gather_quantize_fp8_group_cols") == 2, counts
    assert counts.get("activate_quantize_fp8_group_cols") == 1, counts
    assert counts.get("quantize_fp8_group_cols") == 1, counts
    for name in ("expand_quantize_fp8_rows", "activate_quantize_fp8", "quantize_fp8_rows_group_cols"):
        assert name not in counts, counts


def test_the_fp8_wgrad_layer_makes_no_column_tiles_in_a_forward_alone(rng):
    """Without a derivative the FP8-wgrad layer runs the bf16-wgrad layer's forward: x's
    sorted rows quantised by the expansion, no column tiles of any operand (fp8.TokenRows),
    and bitwise the same output."""
    args = _inputs(rng)

    def forward(quantization):
        return jax.jit(lambda *a: moe_xla.moe(*a, top_k=K, quantization=quantization))

    counts = _custom_calls(forward("fp8_blockwise_fp8_wgrad").lower(*args).as_text())
    assert counts.get("expand_quantize_fp8_rows") == 1, counts
    assert counts.get("activate_quantize_fp8") == 1, counts
    for name in ("gather_quantize_fp8_group_cols", "activate_quantize_fp8_group_cols", "quantize_fp8_group_cols",
                 "quantize_fp8_rows_group_cols"):
        assert name not in counts, counts
    np.testing.assert_array_equal(np.asarray(forward("fp8_blockwise_fp8_wgrad")(*args)),
                                  np.asarray(forward("fp8_blockwise")(*args)))


def test_gathered_column_tiles_give_the_layer_of_the_sorted_rows(rng):
    """The FP8-wgrad layer with x's column tiles gathered from the tokens is bitwise the
    layer that expands x into its sorted rows (expand_quantize_fp8_rows: entries of
    magnitude at most 2^-126 flushed, as the gather flushes them) and quantises those:
    forward and the gradients of x, the logits, w_in and w_out."""
    from moe_xla.moe import _sorted_rows_fp8

    x, logits, w_in, w_out = _inputs(rng)
    tiny = jnp.asarray(np.ldexp(np.float32(1.5), -130), jnp.bfloat16)  # flushed by both
    x = x.at[3, 5].set(tiny).at[7, 200].set(jnp.asarray(-2.0 ** -126, jnp.bfloat16))
    ct = normal(rng, (T, H), jnp.float32)

    def sorted_rows_layer(x, logits, w_in, w_out):
        weights, ids = moe_xla.route(logits, K)
        x_sorted, group_sizes, row_map, row_pairs, x_q = _sorted_rows_fp8(x, ids, E)
        assert len(x_q) == 2  # the rows' FP8 row tiles alone: the product makes the column tiles
        return moe_xla.fp8.mlp_combine_fp8(x_sorted, w_in, w_out, group_sizes, row_map, weights, row_pairs,
                                           "swiglu", x_quantized=x_q, wgrad="fp8")

    def layer(x, logits, w_in, w_out):
        return moe_xla.moe(x, logits, w_in, w_out, top_k=K, quantization="fp8_blockwise_fp8_wgrad")

    args = (x, logits, w_in, w_out)
    outs = [jax.jit(f)(*args) for f in (layer, sorted_rows_layer)]
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * ct), argnums=(0, 1, 2, 3)))(*args)
             for f in (layer, sorted_rows_layer)]
    for name, a, b in zip(("x", "logits", "w_in", "w_out"), *grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
        assert np.any(np.asarray(a, np.float32) != 0), name


def _expand_operand_producers(hlo):
    """[(operand count, the producers' text with their fused computations)] of every
    expand_quantize_fp8_rows custom call in compiled HLO text."""
    bodies = dict(re.findall(r"^%?([\w.-]+) \(.*\{\n(.*?)\n\}", hlo, re.M | re.S))
    defs = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = (.*)$", hlo, re.M))
    calls = []
    for line in hlo.splitlines():
        call = re.search(r"custom-call\(([^)]*)\).*custom_call_target=\"moe_xla_expand_quantize_fp8_rows_", line)
        if call:
            producers = [defs[name] for name in re.findall(r"%([\w.-]+)", call.group(1))]
            fused = [bodies.get(c, "") for p in producers for c in re.findall(r"calls=%?([\w.-]+)", p)]
            calls.append((len(producers), "\n".join(producers + fused)))
    return calls


def test_the_dispatch_expands_x_with_no_factor(rng):
    """moe()'s FP8 dispatch expands x with no factor (every factor 1): in the optimised HLO
    of a forward+backward step the dispatch's expand call reads x and the row map alone and
    no broadcast (of ones) feeds an expand call; the combine's transpose passes the routing
    weights."""
    x, logits, w_in, w_out = _inputs(rng)
    ct = normal(rng, (T, H), jnp.float32)
    hlo = jax.jit(jax.grad(_loss("fp8_blockwise"), argnums=(0, 1, 2, 3))).lower(
        x, logits, w_in, w_out, ct).compile().as_text()
    calls = _expand_operand_producers(hlo)
    assert sorted(n for n, _ in calls) == [2, 3], calls
    for _, producers in calls:
        assert "broadcast(" not in producers, producers


def test_fused_products_name_themselves_in_errors(rng):
    x, logits, w_in, w_out = _inputs(rng)
    weights, ids = moe_xla.route(logits, K)
    rows, group_sizes, row_map, row_pairs = moe_xla.permute(x, ids, E, return_row_pairs=True)
    with pytest.raises(ValueError, match=r"mlp_combine_fp8: expected row_pairs of shape \(511,\) \(one per row"):
        moe_xla.fp8.mlp_combine_fp8(rows[:-1], w_in, w_out, group_sizes, row_map, weights, row_pairs, "swiglu")
    with pytest.raises(ValueError, match=r"mlp_combine_fp8: expected row_pairs of shape \(512,\)"):
        moe_xla.fp8.mlp_combine_fp8(rows, w_in, w_out, group_sizes, row_map, weights, row_pairs[:-1], "swiglu")
    with pytest.raises(ValueError, match="mlp_combine_fp8: expected wgrad in"):
        moe_xla.fp8.mlp_combine_fp8(rows, w_in, w_out, group_sizes, row_map, weights, row_pairs, "swiglu",
                                    wgrad="f32")
    with pytest.raises(ValueError, match="mlp_combine_fp8: expected rhs of rank 3"):
        moe_xla.fp8.mlp_combine_fp8(rows, w_in, w_out[0], group_sizes, row_map, weights, row_pairs, "swiglu")
    with pytest.raises(ValueError, match="gmm_activate_fp8: expected rhs of rank 3"):
        moe_xla.fp8.gmm_activate_fp8(x, w_in[0], group_sizes, "swiglu")
