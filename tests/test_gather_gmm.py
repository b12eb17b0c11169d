"""gather_gmm against the reference on the default backend (CPU in CI: its decomposition;
the H200: the CUDA kernel for bf16 with K, N multiples of 8), in both layouts of w ([G, K, N]
and, with transpose_rhs, [G, N, K]), its autodiff, batching, lowering and errors, and moe()
with its first product gathered against the copying layer."""

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
from moe_xla import first_product, product_combine, reference
from conftest import ON_GPU, assert_close, normal, requires_8_devices
import independent
from gather_inputs import cases, cuda_targets, group_sizes, src_with_bad_rows

# (T, M, K, N, G): kernel-shaped (K, N multiples of 8: the CUDA kernel in bf16), tails of
# the kernel's 128-row tiles, G = 1, and K or N not multiples of 8 (the decomposition).
SHAPES = [(40, 96, 64, 72, 7), (300, 517, 128, 256, 5), (17, 33, 16, 8, 1), (50, 70, 12, 16, 3), (30, 45, 16, 20, 4)]
DTYPES = [jnp.bfloat16, jnp.float32, jnp.float16]

needs_cuda_kernel = pytest.mark.skipif(not _lib.has_kernel("gather_gmm", "cuda"),
                                       reason="the library was built without CUDA")


def _src(rng, t: int, m: int):
    return src_with_bad_rows(rng, t, m, [-1, t, t + 7, -(2**31)])


def _slots(rng, t: int, k: int):
    """(src [T*k], token_slots [T, k]) of a random permutation of the T*k rows, as permute's
    row_map: token_slots[t, j] = the row of assignment (t, j), src[row] = its token."""
    perm = rng.permutation(t * k).astype(np.int32)
    src = np.empty(t * k, np.int32)
    src[perm] = np.arange(t * k) // k
    return jnp.asarray(src), jnp.asarray(perm.reshape(t, k))


def _ref(x, src, w, gs, out_dtype=None, transpose_rhs=False):
    return reference.gather_gmm(x.astype(jnp.float32), src, w.astype(jnp.float32), gs, transpose_rhs=transpose_rhs,
                                preferred_element_type=out_dtype or jnp.float32)


def _w_shape(g: int, k: int, n: int, transpose_rhs: bool):
    """w's shape in its layout: [G, K, N], or [G, N, K] with transpose_rhs."""
    return (g, n, k) if transpose_rhs else (g, k, n)


def _cases():
    return cases(SHAPES, DTYPES, ("random", "zeros", "one_giant", "sum_below_m", "sum_above_m"))


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("t,m,k,n,g,dtype,sizes", list(_cases()))
def test_matches_reference(rng, t, m, k, n, g, dtype, sizes, transpose_rhs):
    x, w = normal(rng, (t, k), dtype), normal(rng, _w_shape(g, k, n, transpose_rhs), dtype)
    src, gs = _src(rng, t, m), group_sizes(rng, m, g, sizes)
    out = jax.jit(lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs))(x, src, w, gs)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, _ref(x, src, w, gs, transpose_rhs=transpose_rhs), dtype)
    tail = int(reference.group_ends(gs, m)[-1])
    assert np.all(np.asarray(out[tail:], np.float32) == 0), "rows past sum(group_sizes) must be zero"
    bad = ~((np.asarray(src) >= 0) & (np.asarray(src) < t))
    assert np.all(np.asarray(out, np.float32)[bad] == 0), "rows of src outside [0, T) must be zero"


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_preferred_element_type(rng, in_dtype, out_dtype, transpose_rhs):
    x, w = normal(rng, (64, 32), in_dtype), normal(rng, _w_shape(3, 32, 40, transpose_rhs), in_dtype)
    src, gs = _src(rng, 64, 100), jnp.array([30, 0, 65], jnp.int32)
    out = jax.jit(lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype))(
        x, src, w, gs)
    assert out.dtype == out_dtype
    assert_close(out, _ref(x, src, w, gs, transpose_rhs=transpose_rhs), out_dtype)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("t,m,sizes", [(0, 16, [10, 6]), (16, 0, [0, 0]), (16, 24, []), (16, 24, [0, 0])],
                         ids=["no-tokens", "no-rows", "no-groups", "empty-groups"])
def test_empty(rng, t, m, sizes, transpose_rhs):
    # Every row is zero: no token to read, no row, no group, or only empty groups.
    x, w = normal(rng, (t, 16), jnp.bfloat16), normal(rng, _w_shape(len(sizes), 16, 8, transpose_rhs), jnp.bfloat16)
    src = jnp.asarray(rng.integers(0, max(t, 1), size=m), jnp.int32)
    gs = jnp.asarray(sizes, jnp.int32).reshape(len(sizes))
    out = jax.jit(lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs))(x, src, w, gs)
    assert out.shape == (m, 8) and np.all(np.asarray(out, np.float32) == 0)


# ---------------------------------------------------------------------------- autodiff


def _loss_grads(fn, x, w, weights):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * weights), (0, 1)))(x, w)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_slots", [False, True], ids=["src", "token_slots"])
def test_grads_match_vjp_of_decomposition(rng, dtype, with_slots, transpose_rhs):
    t, k, kk, n = 40, 16, 3, 24
    src, slots = _slots(rng, t, kk)
    if with_slots:
        # Some assignments land nowhere: their slot names no row and their row reads no token.
        dropped = np.asarray(slots).reshape(-1)[:5]
        src = src.at[dropped].set(t)
        slots = jnp.where(jnp.isin(slots, dropped), -1, slots)
    else:
        src = _src(rng, t, t * kk)  # repeats and rows naming no token
    x, w = normal(rng, (t, k), dtype), normal(rng, _w_shape(4, k, n, transpose_rhs), dtype)
    gs = jnp.array([30, 0, 45, 20], jnp.int32)  # sum 95 < M = 120
    weights = normal(rng, (t * kk, n), jnp.float32)
    kw = dict(token_slots=slots) if with_slots else {}
    ours = _loss_grads(lambda x, w: moe_xla.gather_gmm(x, src, w, gs, transpose_rhs=transpose_rhs, **kw), x, w,
                       weights)
    ref = _loss_grads(lambda x, w: reference.gather_gmm(x, src, w, gs, transpose_rhs=transpose_rhs),
                      x.astype(jnp.float32), w.astype(jnp.float32), weights)
    for o, r in zip(ours, ref):
        assert o.dtype == dtype
        assert_close(o, r, dtype)


@pytest.mark.parametrize("m", [70, 150], ids=["m_below_tk", "m_above_tk"])
def test_token_slots_need_not_name_t_times_k_rows(rng, m):
    # The EP layer's received rows: M grouped rows for T rows of k slots each (M != T*k);
    # slots past the named ones are outside [0, M) (large or negative), rows no slot names
    # read no token.
    t, kk, k, n = 40, 3, 16, 24
    named = min(m, t * kk) - 10
    picked = rng.permutation(t * kk)[:named]
    rows = rng.permutation(m)[:named].astype(np.int32)
    slots = np.where(rng.random(t * kk) < 0.5, m + rng.integers(0, 5, t * kk), -1 - rng.integers(0, 5, t * kk))
    slots[picked] = rows
    src = np.full(m, -1, np.int32)
    src[rows] = picked // kk
    src, slots = jnp.asarray(src), jnp.asarray(slots.reshape(t, kk), jnp.int32)
    x, w = normal(rng, (t, k), jnp.float32), normal(rng, (4, k, n), jnp.float32)
    gs = jnp.array([m // 4, 0, m // 2, m // 5], jnp.int32)
    weights = normal(rng, (m, n), jnp.float32)
    ours = _loss_grads(lambda x, w: moe_xla.gather_gmm(x, src, w, gs, token_slots=slots), x, w, weights)
    ref = _loss_grads(lambda x, w: independent.gather_gmm(x, src, w, gs, False), x, w, weights)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("k,n", [(16, 24), (16, 16)], ids=["k16n24", "square"])
@pytest.mark.parametrize("gs", [[30, 0, 45, 20], [0, 0, 0, 0], [200, 5, 0, 1]], ids=["sum_below_m", "empty", "clamped"])
def test_grads_match_einsum(rng, gs, k, n, transpose_rhs):
    # Against a formulation that shares no code with gmm, gather_rows or the reference. K = N
    # too: there a w taken in the wrong layout has the right shape and only values tell.
    t, m = 40, 120
    x, w = normal(rng, (t, k), jnp.float32), normal(rng, _w_shape(4, k, n, transpose_rhs), jnp.float32)
    src, gs = _src(rng, t, m), jnp.array(gs, jnp.int32)
    weights = normal(rng, (m, n), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(moe_xla.gather_gmm, static_argnames="transpose_rhs")(
        x, src, w, gs, transpose_rhs=transpose_rhs)), np.asarray(independent.gather_gmm(x, src, w, gs, transpose_rhs)),
        rtol=1e-5, atol=1e-5)
    ours = _loss_grads(lambda x, w: moe_xla.gather_gmm(x, src, w, gs, transpose_rhs=transpose_rhs), x, w, weights)
    ref = _loss_grads(lambda x, w: independent.gather_gmm(x, src, w, gs, transpose_rhs), x, w, weights)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("with_slots", [False, True], ids=["src", "token_slots"])
def test_check_grads(rng, with_slots, transpose_rhs):
    src, slots = _slots(rng, 10, 2)
    x, w = normal(rng, (10, 6), jnp.float32), normal(rng, _w_shape(3, 6, 5, transpose_rhs), jnp.float32)
    gs = jnp.array([7, 0, 9], jnp.int32)
    kw = dict(token_slots=slots) if with_slots else {}
    check_grads(lambda a, b: moe_xla.gather_gmm(a, src, b, gs, transpose_rhs=transpose_rhs, **kw), (x, w), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=1e-2)


# ---------------------------------------------------------------------------- vmap and sharding


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (None, 0, 0, 0), (0, None, None, None), (1, 0, None, 0)])
def test_vmap(rng, in_axes, transpose_rhs):
    b, t, m, k, n, g = 3, 20, 30, 16, 8, 4
    shapes = [(t, k), (m,), _w_shape(g, k, n, transpose_rhs), (g,)]
    shapes = [s if a is None else s[:a] + (b,) + s[a:] for s, a in zip(shapes, in_axes)]
    x, w = normal(rng, shapes[0], jnp.float32), normal(rng, shapes[2], jnp.float32)
    src = jnp.asarray(rng.integers(-2, t + 2, size=shapes[1]), jnp.int32)
    gs = jnp.asarray(rng.integers(0, 12, size=shapes[3]), jnp.int32)
    ours_fn = lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs)
    ref_fn = lambda *a: reference.gather_gmm(*a, transpose_rhs=transpose_rhs)
    ours = jax.jit(jax.vmap(ours_fn, in_axes))(x, src, w, gs)
    assert_close(ours, jax.vmap(ref_fn, in_axes)(x, src, w, gs), jnp.float32)
    cts = normal(rng, ours.shape, jnp.float32)
    loss = lambda fn, x, w: jnp.sum(jax.vmap(fn, in_axes)(x, src, w, gs) * cts)
    for o, r in zip(jax.jit(jax.grad(lambda x, w: loss(ours_fn, x, w), (0, 1)))(x, w),
                    jax.grad(lambda x, w: loss(ref_fn, x, w), (0, 1))(x, w)):
        assert_close(o, r, jnp.float32)


@pytest.mark.parametrize("x_batched", [True, False])
def test_vmap_with_token_slots(rng, x_batched):
    b, t, kk = 3, 12, 2
    pairs = [_slots(rng, t, kk) for _ in range(b)]
    src, slots = jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])
    x = normal(rng, (b, t, 8) if x_batched else (t, 8), jnp.float32)
    w, gs = normal(rng, (b, 3, 8, 16), jnp.float32), jnp.asarray(rng.integers(0, 10, size=(b, 3)), jnp.int32)
    in_axes = (0 if x_batched else None, 0, 0, 0, 0)
    f = lambda x, src, w, gs, slots: moe_xla.gather_gmm(x, src, w, gs, token_slots=slots)
    cts = normal(rng, (b, t * kk, 16), jnp.float32)
    loss = lambda fn, x, w: jnp.sum(jax.vmap(fn, in_axes)(x, src, w, gs, slots) * cts)
    ref = lambda x, src, w, gs, slots: reference.gather_gmm(x, src, w, gs)
    for o, r in zip(jax.tree.leaves(jax.jit(jax.value_and_grad(lambda x, w: loss(f, x, w), (0, 1)))(x, w)),
                    jax.tree.leaves(jax.value_and_grad(lambda x, w: loss(ref, x, w), (0, 1))(x, w))):
        assert_close(o, r, jnp.float32)


@requires_8_devices
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("split", ["n", "k"])
def test_split_over_a_mesh(rng, transpose_rhs, split):
    # Over 4 devices, w split along N: out comes back split the same way; x and w split along
    # K: each device computes a partial product, summed once. Both equal one device's.
    k, n = (16, 32) if split == "n" else (32, 16)
    x, w = normal(rng, (40, k), jnp.float32), normal(rng, _w_shape(3, k, n, transpose_rhs), jnp.float32)
    src, gs = _src(rng, 40, 50), jnp.array([20, 0, 25], jnp.int32)
    mesh = jax.make_mesh((4,), ("x",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    w_axis = {("n", False): 2, ("n", True): 1, ("k", False): 1, ("k", True): 2}[split, transpose_rhs]
    w_spec = P(*("x" if axis == w_axis else None for axis in range(3)))
    f = jax.jit(lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs))
    out = f(put(x, P() if split == "n" else P(None, "x")), put(src, P()), put(w, w_spec), put(gs, P()))
    if split == "n":
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 2)
    assert_close(out, _ref(x, src, w, gs, transpose_rhs=transpose_rhs), jnp.float32)


# ---------------------------------------------------------------------------- lowering and errors


@needs_cuda_kernel
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("k,n,dtype,out_dtype,kernel", [
    (16, 24, jnp.bfloat16, None, True), (16, 24, jnp.bfloat16, jnp.float32, True),
    (12, 24, jnp.bfloat16, None, False), (16, 20, jnp.bfloat16, None, False),
    (16, 24, jnp.float32, None, False), (16, 24, jnp.float16, None, False)])
def test_cuda_lowering_takes_the_kernel_where_it_applies(k, n, dtype, out_dtype, kernel, transpose_rhs):
    x, w = jnp.zeros((10, k), dtype), jnp.zeros(_w_shape(2, k, n, transpose_rhs), dtype)
    src, gs = jnp.zeros((12,), jnp.int32), jnp.zeros((2,), jnp.int32)
    f = lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)
    targets = cuda_targets(f, x, src, w, gs)
    decomposition = ["moe_xla_gather_rows_cuda_v1", "moe_xla_gmm_cuda_v1"]
    assert targets == (["moe_xla_gather_gmm_cuda_v2"] if kernel else decomposition)
    if kernel:  # the layout reaches the handler as its typed attribute
        text = jax.jit(f).trace(x, src, w, gs).lower(lowering_platforms=("cuda",)).as_text()
        assert f"transpose_rhs = {str(transpose_rhs).lower()}" in text


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w_kn", "w_nk"])
def test_cpu_lowering_is_the_decomposition(rng, transpose_rhs):
    x, w = normal(rng, (10, 16), jnp.bfloat16), normal(rng, _w_shape(2, 16, 8, transpose_rhs), jnp.bfloat16)
    f = jax.jit(lambda *a: moe_xla.gather_gmm(*a, transpose_rhs=transpose_rhs))
    text = f.trace(x, jnp.zeros((12,), jnp.int32), w, jnp.zeros((2,), jnp.int32)).lower(
        lowering_platforms=("cpu",)).as_text()
    assert re.findall(r"custom_call @(moe_xla_\w+)", text) == ["moe_xla_gather_rows_cpu_v1", "moe_xla_gmm_cpu_v1"]
    assert f"transpose_rhs = {str(transpose_rhs).lower()}" in text  # gmm's attribute carries the layout


@pytest.mark.parametrize("change,exc,message", [
    (dict(x=jnp.zeros((4, 3, 8))), ValueError, r"expected x of rank 2 \[T, K\], got shape \(4, 3, 8\)"),
    (dict(src=jnp.zeros((6,), jnp.float32)), TypeError, "expected int32 src, got float32"),
    (dict(src=jnp.zeros((6, 1), jnp.int32)), ValueError, r"expected src of rank 1 \[M\]"),
    (dict(w=jnp.zeros((2, 9, 5))), ValueError, r"expected w.shape\[1\] \(K of x \[T, K\]\) = 8, got 9"),
    (dict(w=jnp.zeros((2, 8, 5)), transpose_rhs=True), ValueError,
     r"expected w.shape\[2\] \(K of x \[T, K\]\) = 8, got 5"),
    (dict(w=jnp.zeros((2, 5, 8, 1)), transpose_rhs=True), ValueError,
     r"expected w of rank 3 \[G, N, K\], got shape \(2, 5, 8, 1\)"),
    (dict(w=jnp.zeros((3, 5, 8)), transpose_rhs=True), ValueError, r"expected group_sizes of shape \(3,\)"),
    (dict(transpose_rhs=1), TypeError, "expected transpose_rhs to be a Python bool, got 1"),
    (dict(w=jnp.zeros((2, 8, 5), jnp.bfloat16)), TypeError, r"expected w of the dtype of x \(float32\), got bfloat16"),
    (dict(x=jnp.zeros((4, 8), jnp.int32), w=jnp.zeros((2, 8, 5), jnp.int32)), TypeError, "expected x of dtype"),
    (dict(gs=jnp.zeros((3,), jnp.int32)), ValueError, r"expected group_sizes of shape \(2,\)"),
    (dict(token_slots=jnp.zeros((4, 2), jnp.float32)), TypeError, "expected int32 token_slots, got float32"),
    (dict(token_slots=jnp.zeros((3, 2), jnp.int32)), ValueError, r"expected token_slots.shape\[0\] \(T of x \[T, K\]\) = 4"),
    (dict(preferred_element_type=jnp.int32), TypeError, "expected preferred_element_type"),
])
def test_bad_inputs(change, exc, message):
    args = dict(x=jnp.zeros((4, 8)), src=jnp.zeros((6,), jnp.int32), w=jnp.zeros((2, 8, 5)),
                gs=jnp.zeros((2,), jnp.int32)) | change
    kw = {key: args.pop(key) for key in ("token_slots", "preferred_element_type", "transpose_rhs") if key in args}
    with pytest.raises(exc, match=f"gather_gmm: {message}"):
        moe_xla.gather_gmm(args["x"], args["src"], args["w"], args["gs"], **kw)


# ---------------------------------------------------------------------------- in moe()


def _layer_args(rng, dtype, t=70, h=16, f=8, e=6):
    x = normal(rng, (t, h), dtype)
    logits = normal(rng, (t, e), jnp.float32)
    w_in = (normal(rng, (e, h, 2 * f), jnp.float32) / np.sqrt(h)).astype(dtype)
    w_out = (normal(rng, (e, f, h), jnp.float32) / np.sqrt(f)).astype(dtype)
    return x, logits, w_in, w_out


def _layer(mode, args, top_k=3, **kw):
    """(y, grads) of moe() traced with its first product `mode`; a fresh jit per mode."""
    ct = jnp.cos(jnp.arange(args[0].size, dtype=jnp.float32).reshape(args[0].shape))

    def loss(*a):
        return jnp.sum(moe_xla.moe(*a, top_k=top_k, **kw).astype(jnp.float32) * ct)

    with first_product.forced(mode):
        y = jax.jit(lambda *a: moe_xla.moe(*a, top_k=top_k, **kw))(*args)
        grads = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*args)
    return y, grads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", score="sigmoid", top_k=2),
                                dict(top_k=6, shared_experts=True)], ids=["swiglu", "gelu", "all-experts-shared"])
def test_moe_gathered_equals_copied(rng, dtype, kw):
    kw = dict(kw)
    args = _layer_args(rng, dtype)
    if kw.get("activation") == "gelu":
        args = args[:2] + (args[2][..., :8], args[3])
    if kw.pop("shared_experts", False):
        kw["shared_experts"] = (normal(rng, (16, 24), dtype) / 4, normal(rng, (12, 16), dtype) / 4)
    y_copy, g_copy = _layer("copy", args, **kw)
    y_gather, g_gather = _layer("gather", args, **kw)
    # Gradients: the custom_jvp's rule is the copy path, so bitwise everywhere. The forward:
    # the same kernels on CPU and in float32 (the decomposition, gather_rows + gmm, moves the
    # same rows as permute's copy): bitwise; the GPU's gather kernel and grouped GEMM may
    # round h differently in bf16.
    for a, b in zip(g_gather, g_copy):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert y_gather.dtype == y_copy.dtype
    if ON_GPU and jnp.dtype(dtype) == jnp.bfloat16:
        assert_close(y_gather, y_copy, dtype)
    else:
        np.testing.assert_array_equal(np.asarray(y_gather, np.float32), np.asarray(y_copy, np.float32))


def test_moe_gathered_matches_reference(rng):
    args = _layer_args(rng, jnp.float32)
    y, _ = _layer("gather", args)
    assert_close(y, reference.moe(*args, top_k=3), jnp.float32)


def _permute_width(text: str):
    """The widths H of the [R, H] x_sorted results of the permute calls in a lowered module."""
    return [int(w) for w in re.findall(r"custom_call @moe_xla_permute_\w+\([^\n]*-> \(tensor<\d+x(\d+)x", text)]


@needs_cuda_kernel
def test_moe_forward_gathers_without_a_permuted_copy_and_so_does_its_step(rng):
    args = _layer_args(rng, jnp.bfloat16)

    def fwd():
        return lambda *a: moe_xla.moe(*a, top_k=3)

    def step():
        return jax.grad(lambda *a: jnp.sum(moe_xla.moe(*a, top_k=3).astype(jnp.float32)), (0, 1, 2, 3))

    def lowered(mode, make):
        # A fresh function per mode: jit reuses a function's trace, made under one mode. The
        # combine's backward copies, so that the gather_gmm calls are the first product's.
        with first_product.forced(mode), product_combine.forced("copy"):
            return jax.jit(make()).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    gathered, copied = lowered("gather", fwd), lowered("copy", fwd)
    assert "moe_xla_gather_gmm_cuda_v2" in gathered and "moe_xla_gather_gmm_cuda_v2" not in copied
    assert set(_permute_width(gathered)) == {0} and 16 in _permute_width(copied)
    assert "stablehlo.gather" not in gathered  # no [T*k, H] gather of x either
    # A step under "gather" differentiates gather_gmm itself: its weight gradient is a
    # gather_tgmm and no permute copies x; under "copy" it copies.
    gathered, copied = lowered("gather", step), lowered("copy", step)
    assert "moe_xla_gather_gmm_cuda_v2" in gathered and "moe_xla_gather_tgmm_cuda_v2" in gathered
    assert set(_permute_width(gathered)) == {0}
    assert "moe_xla_gather_gmm_cuda_v2" not in copied and 16 in _permute_width(copied)


def test_the_derivative_rule_follows_derivative_gathers(rng, monkeypatch):
    """Gathered forward, and a derivative that gathers or copies as derivative_gathers says:
    the same gradients either way (bitwise: both sum the same rows in the same order)."""
    args = _layer_args(rng, jnp.float32)

    def grads():
        return jax.jit(jax.grad(lambda *a: jnp.sum(moe_xla.moe(*a, top_k=3)), (0, 1, 2, 3)))

    results = []
    for n_max in (0, 10**6):
        monkeypatch.setattr(first_product, "GATHER_DERIVATIVE_MAX_N", n_max)
        monkeypatch.setattr(first_product, "choose", lambda *_: "gather")
        text = str(jax.make_jaxpr(grads())(*args))
        assert ("moe_xla_gather_tgmm[" in text) == (n_max > 0)
        results.append(grads()(*args))
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_moe_gathers_on_the_gpu_by_default(rng):
    args = _layer_args(rng, jnp.bfloat16)
    hlo = jax.jit(lambda *a: moe_xla.moe(*a, top_k=3)).lower(*args).compile().as_text()
    assert 'custom_call_target="moe_xla_gather_gmm_cuda_v2"' in hlo


def test_choose(monkeypatch):
    x, w = jnp.zeros((64, 4096), jnp.bfloat16), jnp.zeros((8, 4096, 1024), jnp.bfloat16)
    monkeypatch.setattr(first_product.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(first_product._lib, "local_gpus_hopper", lambda: True)
    assert first_product.choose(x, w, 8) == "gather"
    assert first_product.choose(x, jnp.zeros((8, 4096, 1032), jnp.bfloat16), 8) == "copy"
    assert first_product.choose(x.astype(jnp.float32), w, 8) == "copy"
    assert first_product.choose(x[:, :4092], w[:, :4092], 8) == "copy"  # K not a multiple of 8
    with first_product.forced("copy"):
        assert first_product.choose(x, w, 8) == "copy"
    monkeypatch.setattr(first_product._lib, "local_gpus_hopper", lambda: False)
    assert first_product.choose(x, w, 8) == "copy"
    monkeypatch.setattr(first_product.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(first_product._lib, "local_gpus_hopper", lambda: True)
    assert first_product.choose(x, w, 8) == "copy"
    with pytest.raises(ValueError, match="expected a mode in"):
        with first_product.forced("fused"):
            pass
