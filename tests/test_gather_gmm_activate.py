"""gather_gmm_activate against formulas that share no code with it (tests/independent.py:
the gathered product as one einsum, the activations from their formulas) and against
reference.py, on the default backend (CPU in CI: its decomposition; the H200: the CUDA
kernel's activation epilogue for bf16 with K, N multiples of 8 and, gated, F a multiple of
128), for every activation; its derivatives, batching, lowering and errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import moe_xla
import moe_xla._lib as _lib
from moe_xla import first_product, reference
from conftest import ON_GPU, assert_close, normal, requires_8_devices
import independent
from gather_inputs import cases, cuda_targets, group_sizes, src_with_bad_rows

GATED, PLAIN = independent.GATED_ACTIVATIONS, ("gelu", "silu", "relu")
ACTIVATIONS = GATED + PLAIN
# (T, M, K, N, G): F = N / 2 of 128 and 256 (the gated kernel's column tiles, one and two
# per F), F of 36 and 132 (not multiples of 128: the decomposition when gated), N = 264 (a
# tail of the plain kernel's 256-column tiles), M tails of the 128-row tiles, G = 1.
SHAPES = [(40, 96, 64, 256, 7), (300, 517, 128, 512, 5), (17, 33, 16, 72, 1), (30, 45, 16, 264, 4)]
SIZES = ("random", "zeros", "one_giant", "sum_below_m", "sum_above_m")

needs_cuda_kernel = pytest.mark.skipif(not _lib.has_kernel("gather_gmm_activate", "cuda"),
                                       reason="the library was built without CUDA")


def _src(rng, t: int, m: int):
    return src_with_bad_rows(rng, t, m, [-1, t, t + 7, -(2**31)])


def _formula(x, src, w, gs, activation):
    """act(x[src] @ w[g]) in float32 from tests/independent.py."""
    h = independent.gather_gmm(x.astype(jnp.float32), src, w.astype(jnp.float32), gs)
    return independent.activation_fn(activation)(h)


def _inputs(rng, t, m, k, n, g, dtype, sizes="random"):
    # w scaled by 1/sqrt(K): h of unit scale, where every activation is far from linear.
    x = normal(rng, (t, k), dtype)
    w = (normal(rng, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, _src(rng, t, m), w, group_sizes(rng, m, g, sizes)


def _cases():
    yield from cases(SHAPES, [jnp.bfloat16], SIZES)
    yield from cases(SHAPES, [jnp.float32], ("random",))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("t,m,k,n,g,dtype,sizes", list(_cases()))
def test_matches_formula(rng, t, m, k, n, g, dtype, sizes, activation):
    x, src, w, gs = _inputs(rng, t, m, k, n, g, dtype, sizes)
    out = jax.jit(moe_xla.gather_gmm_activate, static_argnums=4)(x, src, w, gs, activation)
    f = n // 2 if activation in GATED else n
    assert out.dtype == dtype and out.shape == (m, f)
    assert_close(out, _formula(x, src, w, gs, activation), dtype)
    assert_close(out, reference.gather_gmm_activate(x, src, w, gs, activation=activation).astype(jnp.float32),
                 dtype)
    tail = int(reference.group_ends(gs, m)[-1])
    assert np.all(np.asarray(out[tail:], np.float32) == 0), "rows past sum(group_sizes) must be zero"
    bad = ~((np.asarray(src) >= 0) & (np.asarray(src) < t))
    assert np.all(np.asarray(out, np.float32)[bad] == 0), "rows of src outside [0, T) must be zero"


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_one_rounding(rng, activation):
    # The product stays float32 until the activation: the result is the f32 formula rounded
    # once, closer to it than the unfused path that rounds h to bf16 first (for relu, with
    # which rounding commutes, equal to it).
    x, src, w, gs = _inputs(rng, 200, 300, 256, 512, 3, jnp.bfloat16)
    out = jax.jit(moe_xla.gather_gmm_activate, static_argnums=4)(x, src, w, gs, activation)
    exact = _formula(x, src, w, gs, activation)
    unfused = independent.activation_fn(activation)(
        moe_xla.gather_gmm(x, src, w, gs).astype(jnp.float32)).astype(jnp.bfloat16)
    fused_err = np.abs(np.asarray(out, np.float32) - np.asarray(exact))
    unfused_err = np.abs(np.asarray(unfused, np.float32) - np.asarray(exact))
    # Rounded once: within half a bf16 ulp (at most 2^-8 relative) of the f32 formula, up to
    # the f32 summation order and activation functions (absolute 1e-4 at h of unit scale).
    assert np.all(fused_err <= np.abs(np.asarray(exact)) * 2.0**-8 + 1e-4)
    if activation == "relu":  # rounding commutes with relu: the two paths agree exactly
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(unfused, np.float32))
    else:
        assert fused_err.mean() < unfused_err.mean()


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("t,m,sizes", [(0, 16, [10, 6]), (16, 0, [0, 0]), (16, 24, []), (16, 24, [0, 0])],
                         ids=["no-tokens", "no-rows", "no-groups", "empty-groups"])
def test_empty(rng, t, m, sizes, activation):
    # Every row is zero: no token to read, no row, no group, or only empty groups.
    x, w = normal(rng, (t, 16), jnp.bfloat16), normal(rng, (len(sizes), 16, 256), jnp.bfloat16)
    src = jnp.asarray(rng.integers(0, max(t, 1), size=m), jnp.int32)
    gs = jnp.asarray(sizes, jnp.int32).reshape(len(sizes))
    out = jax.jit(moe_xla.gather_gmm_activate, static_argnums=4)(x, src, w, gs, activation)
    assert out.shape == (m, 128 if activation in GATED else 256) and np.all(np.asarray(out, np.float32) == 0)


# ---------------------------------------------------------------------------- autodiff


def _loss_grads(fn, x, w, cts):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * cts), (0, 1)))(x, w)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gs", [[30, 0, 45, 20], [0, 0, 0, 0], [200, 5, 0, 1]], ids=["sum_below_m", "empty", "clamped"])
def test_grads_match_formula(rng, gs, activation):
    # Reverse mode against jax.grad of the einsum formula, in float32.
    t, m, k, n = 40, 120, 16, 24
    x, src, w, _ = _inputs(rng, t, m, k, n, 4, jnp.float32)
    gs = jnp.array(gs, jnp.int32)
    cts = normal(rng, (m, n // 2 if activation in GATED else n), jnp.float32)
    ours = _loss_grads(lambda x, w: moe_xla.gather_gmm_activate(x, src, w, gs, activation), x, w, cts)
    ref = _loss_grads(lambda x, w: _formula(x, src, w, gs, activation), x, w, cts)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_jvp_matches_formula(rng, activation):
    t, m, k, n = 30, 50, 16, 32
    x, src, w, gs = _inputs(rng, t, m, k, n, 3, jnp.float32, "sum_below_m")
    dx, dw = normal(rng, x.shape, jnp.float32), normal(rng, w.shape, jnp.float32)
    out, tangent = jax.jit(lambda *a: jax.jvp(lambda x, w: moe_xla.gather_gmm_activate(x, src, w, gs, activation),
                                              a[:2], a[2:]))(x, w, dx, dw)
    ref_out, ref_tangent = jax.jvp(lambda x, w: _formula(x, src, w, gs, activation), (x, w), (dx, dw))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(ref_tangent), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grads_in_dtype(rng, dtype):
    # bf16 operands: gradients of the operands' dtypes, close to the float32 formula's.
    x, src, w, gs = _inputs(rng, 64, 100, 32, 256, 3, dtype, "sum_below_m")
    cts = normal(rng, (100, 128), jnp.float32)
    ours = _loss_grads(lambda x, w: moe_xla.gather_gmm_activate(x, src, w, gs, "swiglu"), x, w, cts)
    ref = _loss_grads(lambda x, w: _formula(x, src, w, gs, "swiglu"), x.astype(jnp.float32), w.astype(jnp.float32),
                      cts)
    for o, r in zip(ours, ref):
        assert o.dtype == dtype
        assert_close(o, r, dtype)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_check_grads(rng, activation):
    x, src, w, _ = _inputs(rng, 10, 20, 6, 8, 3, jnp.float32)
    gs = jnp.array([7, 0, 9], jnp.int32)
    check_grads(lambda a, b: moe_xla.gather_gmm_activate(a, src, b, gs, activation), (x, w), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=1e-2)


# ---------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (None, 0, 0, 0), (0, None, None, None), (1, 0, None, 0)])
def test_vmap(rng, in_axes, activation):
    b, t, m, k, n, g = 3, 20, 30, 16, 8, 4
    shapes = [(t, k), (m,), (g, k, n), (g,)]
    shapes = [s if a is None else s[:a] + (b,) + s[a:] for s, a in zip(shapes, in_axes)]
    x, w = normal(rng, shapes[0], jnp.float32), normal(rng, shapes[2], jnp.float32)
    src = jnp.asarray(rng.integers(-2, t + 2, size=shapes[1]), jnp.int32)
    gs = jnp.asarray(rng.integers(0, 12, size=shapes[3]), jnp.int32)
    ours_fn = lambda *a: moe_xla.gather_gmm_activate(*a, activation)  # noqa: E731
    ref_fn = lambda *a: _formula(*a, activation)  # noqa: E731
    ours = jax.jit(jax.vmap(ours_fn, in_axes))(x, src, w, gs)
    assert_close(ours, jax.vmap(ref_fn, in_axes)(x, src, w, gs), jnp.float32)
    cts = normal(rng, ours.shape, jnp.float32)
    loss = lambda fn, x, w: jnp.sum(jax.vmap(fn, in_axes)(x, src, w, gs) * cts)  # noqa: E731
    for o, r in zip(jax.jit(jax.grad(lambda x, w: loss(ours_fn, x, w), (0, 1)))(x, w),
                    jax.grad(lambda x, w: loss(ref_fn, x, w), (0, 1))(x, w)):
        assert_close(o, r, jnp.float32)


# ---------------------------------------------------------------------------- sharding


@requires_8_devices
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_w_split_along_n_over_a_mesh(rng, activation):
    # Over 4 devices, w_in split along N: a plain activation's output comes back split the
    # same way; a gated one's (whose gate and up halves one shard would not both hold) is
    # computed whole. Both equal the formula.
    x, src, w, _ = _inputs(rng, 40, 50, 16, 64, 3, jnp.float32)
    gs = jnp.array([20, 0, 25], jnp.int32)
    mesh = jax.make_mesh((4,), ("x",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    out = jax.jit(moe_xla.gather_gmm_activate, static_argnums=4)(put(x, P()), put(src, P()),
                                                                  put(w, P(None, None, "x")), put(gs, P()), activation)
    if activation not in GATED:
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 2)
    assert_close(out, _formula(x, src, w, gs, activation), jnp.float32)


# ---------------------------------------------------------------------------- lowering


FUSED = ["moe_xla_gather_gmm_activate_cuda_v1"]
GATHERED = ["moe_xla_gather_gmm_cuda_v2"]  # the decomposition's f32 product by gather_gmm's kernel
COPIED = ["moe_xla_gather_rows_cuda_v1", "moe_xla_gmm_cuda_v1"]  # ... by gather_rows + gmm


@needs_cuda_kernel
@pytest.mark.parametrize("activation,n,dtype,targets", [
    ("swiglu", 256, jnp.bfloat16, FUSED), ("geglu", 512, jnp.bfloat16, FUSED), ("gelu", 24, jnp.bfloat16, FUSED),
    ("relu", 264, jnp.bfloat16, FUSED), ("swiglu", 72, jnp.bfloat16, GATHERED), ("silu", 20, jnp.bfloat16, COPIED),
    ("swiglu", 256, jnp.float32, COPIED)], ids=["swiglu", "geglu", "gelu", "relu", "F36", "N20", "f32"])
def test_cuda_lowering_takes_the_kernel_where_it_applies(activation, n, dtype, targets):
    x, w = jnp.zeros((10, 16), dtype), jnp.zeros((2, 16, n), dtype)
    src, gs = jnp.zeros((12,), jnp.int32), jnp.zeros((2,), jnp.int32)
    f = lambda *a: moe_xla.gather_gmm_activate(*a, activation)  # noqa: E731
    assert cuda_targets(f, x, src, w, gs) == targets
    if targets == FUSED:  # the activation reaches the handler as its typed attribute, the index of its name
        text = jax.jit(f).trace(x, src, w, gs).lower(lowering_platforms=("cuda",)).as_text()
        assert f"activation = {ACTIVATIONS.index(activation)} : i32" in text


def test_cpu_lowering_is_the_decomposition(rng):
    x, w = normal(rng, (10, 16), jnp.bfloat16), normal(rng, (2, 16, 256), jnp.bfloat16)
    f = jax.jit(lambda *a: moe_xla.gather_gmm_activate(*a, "swiglu"))
    text = f.trace(x, jnp.zeros((12,), jnp.int32), w, jnp.zeros((2,), jnp.int32)).lower(
        lowering_platforms=("cpu",)).as_text()
    assert re.findall(r"custom_call @(moe_xla_\w+)", text) == ["moe_xla_gather_rows_cpu_v1", "moe_xla_gmm_cpu_v1"]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("k,n", [(256, 1024), (1000, 768)], ids=["K256", "K-tail-F384"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_runs_the_kernel(rng, activation, k, n):
    # On the H200: the compiled program calls the fused kernel, and its result is the
    # formula's (the kernel-shaped cases of test_matches_formula check the values too);
    # K = 1000 ends in a partial 64-deep step, and gated N = 768 has three 128-column tiles
    # of gate | up pairs.
    x, src, w, gs = _inputs(rng, 500, 1000, k, n, 8, jnp.bfloat16)
    f = jax.jit(moe_xla.gather_gmm_activate, static_argnums=4)
    assert "moe_xla_gather_gmm_activate_cuda_v1" in f.lower(x, src, w, gs, activation).compile().as_text()
    assert_close(f(x, src, w, gs, activation), _formula(x, src, w, gs, activation), jnp.bfloat16)


# ---------------------------------------------------------------------------- first_product


def test_activation_fuses_where_the_kernel_applies(monkeypatch):
    x, w = jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros((8, 256, 512), jnp.bfloat16)
    assert not first_product.activation_fuses(x, w, 4, "swiglu")  # the CPU
    monkeypatch.setattr(first_product.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(first_product._lib, "local_gpus_hopper", lambda: True)
    assert first_product.activation_fuses(x, w, 4, "swiglu") and first_product.activation_fuses(x, w, 4, "relu")
    assert not first_product.activation_fuses(x, w[..., :320], 4, "swiglu")  # F = 160: not a multiple of 128
    assert first_product.activation_fuses(x, w[..., :320], 4, "gelu")  # plain: any N of 16-byte rows
    assert not first_product.activation_fuses(x.astype(jnp.float32), w, 4, "swiglu")
    monkeypatch.setattr(first_product._lib, "local_gpus_hopper", lambda: False)
    assert not first_product.activation_fuses(x, w, 4, "swiglu")


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("change,exc,message", [
    (dict(activation="tanh"), ValueError, r"expected activation in \('swiglu', 'geglu', 'gelu', 'silu', 'relu'\), "
                                          r"got 'tanh'"),
    (dict(w=jnp.zeros((2, 8, 5))), ValueError,
     r"gated activation 'swiglu' needs w_in \[G, K, 2F\] \(gate \| up\), got an odd N = 5"),
    (dict(x=jnp.zeros((4, 3, 8))), ValueError, r"expected x of rank 2 \[T, K\], got shape \(4, 3, 8\)"),
    (dict(src=jnp.zeros((6,), jnp.float32)), TypeError, "expected int32 src, got float32"),
    (dict(w=jnp.zeros((2, 9, 6))), ValueError, r"expected w_in.shape\[1\] \(K of x \[T, K\]\) = 8, got 9"),
    (dict(w=jnp.zeros((2, 8))), ValueError, r"expected w_in of rank 3 \[G, K, N\], got shape \(2, 8\)"),
    (dict(w=jnp.zeros((2, 8, 6), jnp.bfloat16)), TypeError,
     r"expected w_in of the dtype of x \(float32\), got bfloat16"),
    (dict(gs=jnp.zeros((3,), jnp.int32)), ValueError, r"expected group_sizes of shape \(2,\)"),
    (dict(gs=jnp.zeros((2,), jnp.float32)), TypeError, "expected int32 group_sizes, got float32"),
])
def test_bad_inputs(change, exc, message):
    args = dict(x=jnp.zeros((4, 8)), src=jnp.zeros((6,), jnp.int32), w=jnp.zeros((2, 8, 6)),
                gs=jnp.zeros((2,), jnp.int32), activation="swiglu") | change
    with pytest.raises(exc, match=f"gather_gmm_activate: {message}"):
        moe_xla.gather_gmm_activate(args["x"], args["src"], args["w"], args["gs"], args["activation"])


def test_odd_n_is_fine_for_plain_activations(rng):
    x, src, w, gs = _inputs(rng, 10, 12, 8, 5, 2, jnp.float32)
    assert moe_xla.gather_gmm_activate(x, src, w, gs, "relu").shape == (12, 5)
