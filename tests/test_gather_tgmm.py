"""gather_tgmm against the reference and a numpy sum of outer products on the default
backend (CPU in CI: its decomposition; the H200: the CUDA kernel for bf16 with K, N
multiples of 8), its autodiff, batching, sharding, lowering and errors, and gather_gmm's
gradient in w through it."""

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
from moe_xla import reference
from moe_xla.primitives import _sharding
from moe_xla.primitives.gather_tgmm import gather_tgmm_p
from conftest import assert_close, normal, requires_8_devices
from gather_inputs import cases, cuda_targets, group_sizes, src_with_bad_rows

# (T, M, K, N, G): kernel-shaped (K, N multiples of 8: the CUDA kernel in bf16), tails of
# its 64-row steps and 128 x 256 blocks, G = 1, and K or N not multiples of 8 (the
# decomposition).
SHAPES = [(40, 96, 64, 72, 7), (300, 517, 136, 264, 5), (17, 33, 16, 8, 1), (50, 70, 12, 16, 3), (30, 45, 16, 20, 4)]
DTYPES = [jnp.bfloat16, jnp.float32, jnp.float16]

needs_cuda_kernel = pytest.mark.skipif(not _lib.has_kernel("gather_tgmm", "cuda"),
                                       reason="the library was built without CUDA")


def _src(rng, t: int, m: int):
    return src_with_bad_rows(rng, t, m, [-1, t, t + 7, -(2**31), 2**31 - 1])


def _ref(x, src, dy, gs, out_dtype=None):
    return reference.gather_tgmm(x.astype(jnp.float32), src, dy.astype(jnp.float32), gs,
                                 preferred_element_type=out_dtype or jnp.float32)


def _empty_groups(gs, m: int):
    ends = np.asarray(reference.group_ends(gs, m))
    return np.diff(np.concatenate([[0], ends])) == 0


def _cases():
    return cases(SHAPES, DTYPES, ("random", "zeros", "one_giant", "sum_below_m", "sum_above_m", "extremes"))


@pytest.mark.parametrize("t,m,k,n,g,dtype,sizes", list(_cases()))
def test_matches_reference(rng, t, m, k, n, g, dtype, sizes):
    x, dy = normal(rng, (t, k), dtype), normal(rng, (m, n), dtype)
    src, gs = _src(rng, t, m), group_sizes(rng, m, g, sizes)
    out = jax.jit(moe_xla.gather_tgmm)(x, src, dy, gs)
    assert out.dtype == dtype and out.shape == (g, k, n)
    assert_close(out, _ref(x, src, dy, gs), dtype)
    assert np.all(np.asarray(out, np.float32)[_empty_groups(gs, m)] == 0), "empty groups' blocks must be zero"


def test_matches_numpy_outer_products(rng):
    # The contract term by term, in float64: row r of group g adds x[src[r]] (outer) dy[r].
    t, m, k, n = 23, 50, 16, 24
    x, dy = normal(rng, (t, k), jnp.float32), normal(rng, (m, n), jnp.float32)
    src, gs = _src(rng, t, m), jnp.array([7, 0, 20, -3, 30], jnp.int32)  # clamped: 7, 0, 20, 0, 23
    want = np.zeros((5, k, n))
    start = 0
    for g, size in enumerate([7, 0, 20, 0, 23]):
        for r in range(start, start + size):
            if 0 <= int(src[r]) < t:
                want[g] += np.outer(np.asarray(x, np.float64)[int(src[r])], np.asarray(dy, np.float64)[r])
        start += size
    out = jax.jit(moe_xla.gather_tgmm)(x, src, dy, gs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_past_the_groups_do_not_leak(rng, dtype):
    # NaN and inf in the dy rows no group owns (and in a group's neighbour rows within one
    # 64-row step of it) never reach a block.
    t, m, k, n = 64, 300, 64, 136
    x, dy = normal(rng, (t, k), dtype), normal(rng, (m, n), dtype)
    src = jnp.asarray(rng.integers(0, t, size=m), jnp.int32)
    gs = jnp.array([37, 0, 100, 3, 60], jnp.int32)  # 200 rows: 100 rows past the groups
    poisoned = dy.at[200::2].set(jnp.nan).at[201::2].set(jnp.inf)
    out = jax.jit(moe_xla.gather_tgmm)(x, src, poisoned, gs)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_close(out, _ref(x, src, dy, gs), dtype)


@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_preferred_element_type(rng, in_dtype, out_dtype):
    x, dy = normal(rng, (64, 32), in_dtype), normal(rng, (100, 40), in_dtype)
    src, gs = _src(rng, 64, 100), jnp.array([30, 0, 65], jnp.int32)
    out = jax.jit(lambda *a: moe_xla.gather_tgmm(*a, preferred_element_type=out_dtype))(x, src, dy, gs)
    assert out.dtype == out_dtype
    assert_close(out, _ref(x, src, dy, gs), out_dtype)


@pytest.mark.parametrize("t,m,sizes", [(0, 16, [10, 6]), (16, 0, [3, 0]), (16, 24, []), (16, 24, [0, 0])],
                         ids=["no-tokens", "no-rows", "no-groups", "empty-groups"])
def test_empty(rng, t, m, sizes):
    # Every block is zero: no token to read, no row, or only empty groups (or no block).
    x, dy = normal(rng, (t, 16), jnp.bfloat16), normal(rng, (m, 8), jnp.bfloat16)
    src = jnp.asarray(rng.integers(0, max(t, 1), size=m), jnp.int32)
    out = jax.jit(moe_xla.gather_tgmm)(x, src, dy, jnp.asarray(sizes, jnp.int32).reshape(len(sizes)))
    assert out.shape == (len(sizes), 16, 8) and np.all(np.asarray(out, np.float32) == 0)


# ---------------------------------------------------------------------------- autodiff


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grads_match_vjp_of_reference(rng, dtype):
    t, m, k, n = 40, 120, 16, 24
    x, dy = normal(rng, (t, k), dtype), normal(rng, (m, n), dtype)
    src, gs = _src(rng, t, m), jnp.array([30, 0, 45, 20], jnp.int32)  # sum 95 < M = 120
    weights = normal(rng, (4, k, n), jnp.float32)

    def grads(fn, x, dy):
        return jax.jit(jax.grad(lambda x, dy: jnp.sum(fn(x, src, dy, gs).astype(jnp.float32) * weights), (0, 1)))(x, dy)

    ours = grads(moe_xla.gather_tgmm, x, dy)
    ref = grads(reference.gather_tgmm, x.astype(jnp.float32), dy.astype(jnp.float32))
    for o, r in zip(ours, ref):
        assert o.dtype == dtype
        assert_close(o, r, dtype)
    assert np.all(np.asarray(ours[1], np.float32)[95:] == 0), "rows past the groups get zero gradient"


def test_check_grads(rng):
    x, dy = normal(rng, (10, 6), jnp.float32), normal(rng, (20, 5), jnp.float32)
    src, gs = _src(rng, 10, 20), jnp.array([7, 0, 9], jnp.int32)
    check_grads(lambda a, b: moe_xla.gather_tgmm(a, src, b, gs), (x, dy), order=2, modes=("fwd", "rev"),
                atol=2e-2, rtol=2e-2, eps=1e-2)


# ---------------------------------------------------------------------------- vmap and sharding


@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (None, 0, 0, 0), (0, None, None, None), (1, 0, None, 0)])
def test_vmap(rng, in_axes):
    b, t, m, k, n, g = 3, 20, 30, 16, 8, 4
    shapes = [(t, k), (m,), (m, n), (g,)]
    shapes = [s if a is None else s[:a] + (b,) + s[a:] for s, a in zip(shapes, in_axes)]
    x, dy = normal(rng, shapes[0], jnp.float32), normal(rng, shapes[2], jnp.float32)
    src = jnp.asarray(rng.integers(-2, t + 2, size=shapes[1]), jnp.int32)
    gs = jnp.asarray(rng.integers(0, 12, size=shapes[3]), jnp.int32)
    ours = jax.jit(jax.vmap(moe_xla.gather_tgmm, in_axes))(x, src, dy, gs)
    assert_close(ours, jax.vmap(reference.gather_tgmm, in_axes)(x, src, dy, gs), jnp.float32)
    cts = normal(rng, ours.shape, jnp.float32)
    loss = lambda fn, x, dy: jnp.sum(jax.vmap(fn, in_axes)(x, src, dy, gs) * cts)
    for o, r in zip(jax.jit(jax.grad(lambda x, dy: loss(moe_xla.gather_tgmm, x, dy), (0, 1)))(x, dy),
                    jax.grad(lambda x, dy: loss(reference.gather_tgmm, x, dy), (0, 1))(x, dy)):
        assert_close(o, r, jnp.float32)


@requires_8_devices
def test_follows_k_and_n_on_a_mesh(rng):
    # x split along K and dy along N: the blocks come back split the same way, equal to one
    # device's.
    x, dy = normal(rng, (40, 16), jnp.float32), normal(rng, (50, 32), jnp.float32)
    src, gs = _src(rng, 40, 50), jnp.array([20, 0, 25], jnp.int32)
    mesh = jax.make_mesh((2, 4), ("k", "n"))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    out = jax.jit(moe_xla.gather_tgmm)(put(x, P(None, "k")), put(src, P()), put(dy, P(None, "n")), put(gs, P()))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "k", "n")), 3)
    assert_close(out, _ref(x, src, dy, gs), jnp.float32)


@requires_8_devices
def test_sharding_rule_splits_the_blocks_without_communication(rng):
    # The rule the kernel's lowering is partitioned with (on CPU the primitive lowers to its
    # decomposition, whose parts have rules of their own), run here through the
    # custom_partitioning function itself: blocks split along K and N as x and dy are, each
    # device's shard computed from its local operands, no collective.
    x, dy = normal(rng, (40, 16), jnp.float32), normal(rng, (50, 32), jnp.float32)
    src, gs = _src(rng, 40, 50), jnp.array([20, 0, 25], jnp.int32)
    mesh = jax.make_mesh((2, 4), ("k", "n"))
    args = [jax.device_put(a, NamedSharding(mesh, spec))
            for a, spec in ((x, P(None, "k")), (src, P()), (dy, P(None, "n")), (gs, P()))]
    params = (("preferred_element_type", jnp.dtype(jnp.float32)),)
    fn = jax.jit(_sharding.partitioned(gather_tgmm_p, _sharding.GATHER_TGMM, params))
    out = fn(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "k", "n")), 3)
    assert_close(out, _ref(x, src, dy, gs), jnp.float32)
    hlo = fn.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)


# ---------------------------------------------------------------------------- lowering and errors


@needs_cuda_kernel
@pytest.mark.parametrize("k,n,dtype,out_dtype,kernel", [
    (16, 24, jnp.bfloat16, None, True), (16, 24, jnp.bfloat16, jnp.float32, True),
    (12, 24, jnp.bfloat16, None, False), (16, 20, jnp.bfloat16, None, False),
    (16, 24, jnp.float32, None, False), (16, 24, jnp.float16, None, False)])
def test_cuda_lowering_takes_the_kernel_where_it_applies(k, n, dtype, out_dtype, kernel):
    x, dy = jnp.zeros((10, k), dtype), jnp.zeros((12, n), dtype)
    src, gs = jnp.zeros((12,), jnp.int32), jnp.zeros((2,), jnp.int32)
    targets = cuda_targets(lambda *a: moe_xla.gather_tgmm(*a, preferred_element_type=out_dtype), x, src, dy, gs)
    decomposition = ["moe_xla_gather_rows_cuda_v1", "moe_xla_tgmm_cuda_v1"]
    assert targets == (["moe_xla_gather_tgmm_cuda_v1"] if kernel else decomposition)


@needs_cuda_kernel
def test_gather_gmm_gradient_in_w_is_a_gather_tgmm():
    x, w = jnp.zeros((10, 16), jnp.bfloat16), jnp.zeros((2, 16, 24), jnp.bfloat16)
    src, gs = jnp.zeros((12,), jnp.int32), jnp.zeros((2,), jnp.int32)
    targets = cuda_targets(jax.grad(lambda w: jnp.sum(moe_xla.gather_gmm(x, src, w, gs).astype(jnp.float32))), w)
    assert "moe_xla_gather_tgmm_cuda_v1" in targets
    assert "moe_xla_gather_rows_cuda_v1" not in targets and "moe_xla_tgmm_cuda_v1" not in targets


def test_cpu_lowering_is_the_decomposition(rng):
    x, dy = normal(rng, (10, 16), jnp.bfloat16), normal(rng, (12, 8), jnp.bfloat16)
    text = jax.jit(moe_xla.gather_tgmm).trace(x, jnp.zeros((12,), jnp.int32), dy, jnp.zeros((2,), jnp.int32)).lower(
        lowering_platforms=("cpu",)).as_text()
    assert re.findall(r"custom_call @(moe_xla_\w+)", text) == ["moe_xla_gather_rows_cpu_v1", "moe_xla_tgmm_cpu_v1"]


@pytest.mark.parametrize("change,exc,message", [
    (dict(x=jnp.zeros((4, 3, 8))), ValueError, r"expected x of rank 2 \[T, K\], got shape \(4, 3, 8\)"),
    (dict(src=jnp.zeros((6,), jnp.float32)), TypeError, "expected int32 src, got float32"),
    (dict(src=jnp.zeros((6, 1), jnp.int32)), ValueError, r"expected src of rank 1 \[M\]"),
    (dict(dy=jnp.zeros((6, 5, 1))), ValueError, r"expected dy of rank 2 \[M, N\], got shape \(6, 5, 1\)"),
    (dict(dy=jnp.zeros((7, 5))), ValueError, r"expected dy.shape\[0\] \(M of src \[M\]\) = 6, got 7"),
    (dict(dy=jnp.zeros((6, 5), jnp.bfloat16)), TypeError, r"expected dy of the dtype of x \(float32\), got bfloat16"),
    (dict(x=jnp.zeros((4, 8), jnp.int32), dy=jnp.zeros((6, 5), jnp.int32)), TypeError, "expected x of dtype"),
    (dict(gs=jnp.zeros((3,), jnp.float32)), TypeError, "expected int32 group_sizes, got float32"),
    (dict(gs=jnp.zeros((3, 1), jnp.int32)), ValueError, r"expected group_sizes of rank 1 \[G\]"),
    (dict(preferred_element_type=jnp.int32), TypeError, "expected preferred_element_type"),
])
def test_bad_inputs(change, exc, message):
    args = dict(x=jnp.zeros((4, 8)), src=jnp.zeros((6,), jnp.int32), dy=jnp.zeros((6, 5)),
                gs=jnp.zeros((2,), jnp.int32)) | change
    kw = {key: args.pop(key) for key in ("preferred_element_type",) if key in args}
    with pytest.raises(exc, match=f"gather_tgmm: {message}"):
        moe_xla.gather_tgmm(args["x"], args["src"], args["dy"], args["gs"], **kw)
