"""gather_tgmm against the reference and a numpy sum of outer products on the default
backend (CPU in CI: its decomposition; the H200: the CUDA kernel for bf16 with K, N
multiples of 8), in both output layouts ([G, K, N], and [G, N, K] with transpose_out), its
autodiff, batching, sharding, lowering and errors, and gather_gmm's gradient in w through
it."""

from __future__ import annotations

import functools
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
# transpose_out: [G, N, K] blocks, in bf16 (the kernel's; the other dtypes take the same
# decomposition), with the tails of K and N also the other way round (K = 264, N = 136).
TRANSPOSED_SHAPES = SHAPES + [(70, 200, 264, 136, 3)]

needs_cuda_kernel = pytest.mark.skipif(not _lib.has_kernel("gather_tgmm", "cuda"),
                                       reason="the library was built without CUDA")


def _src(rng, t: int, m: int):
    return src_with_bad_rows(rng, t, m, [-1, t, t + 7, -(2**31), 2**31 - 1])


def _ref(x, src, dy, gs, out_dtype=None, transpose_out=False):
    return reference.gather_tgmm(x.astype(jnp.float32), src, dy.astype(jnp.float32), gs, transpose_out=transpose_out,
                                 preferred_element_type=out_dtype or jnp.float32)


def _ours(transpose_out, out_dtype=None):
    """gather_tgmm with these static arguments, jitted."""
    return jax.jit(functools.partial(moe_xla.gather_tgmm, transpose_out=transpose_out,
                                     preferred_element_type=out_dtype))


def _empty_groups(gs, m: int):
    ends = np.asarray(reference.group_ends(gs, m))
    return np.diff(np.concatenate([[0], ends])) == 0


def _cases():
    sizes = ("random", "zeros", "one_giant", "sum_below_m", "sum_above_m", "extremes")
    for transpose_out, shapes, dtypes in ((False, SHAPES, DTYPES), (True, TRANSPOSED_SHAPES, DTYPES[:1])):
        for case in cases(shapes, dtypes, sizes):
            yield pytest.param(*case.values, transpose_out, id=case.id + ("-transpose_out" if transpose_out else ""))


@pytest.mark.parametrize("t,m,k,n,g,dtype,sizes,transpose_out", list(_cases()))
def test_matches_reference(rng, t, m, k, n, g, dtype, sizes, transpose_out):
    x, dy = normal(rng, (t, k), dtype), normal(rng, (m, n), dtype)
    src, gs = _src(rng, t, m), group_sizes(rng, m, g, sizes)
    out = _ours(transpose_out)(x, src, dy, gs)
    assert out.dtype == dtype and out.shape == ((g, n, k) if transpose_out else (g, k, n))
    assert_close(out, _ref(x, src, dy, gs, transpose_out=transpose_out), dtype)
    assert np.all(np.asarray(out, np.float32)[_empty_groups(gs, m)] == 0), "empty groups' blocks must be zero"


@pytest.mark.parametrize("transpose_out", [False, True])
def test_matches_numpy_outer_products(rng, transpose_out):
    # The contract term by term, in float64: row r of group g adds x[src[r]] (outer) dy[r]
    # (dy[r] (outer) x[src[r]] with transpose_out).
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
    out = _ours(transpose_out)(x, src, dy, gs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want.transpose(0, 2, 1) if transpose_out else want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_past_the_groups_do_not_leak(rng, dtype, transpose_out):
    # NaN and inf in the dy rows no group owns (and in a group's neighbour rows within one
    # 64-row step of it) never reach a block.
    t, m, k, n = 64, 300, 64, 136
    x, dy = normal(rng, (t, k), dtype), normal(rng, (m, n), dtype)
    src = jnp.asarray(rng.integers(0, t, size=m), jnp.int32)
    gs = jnp.array([37, 0, 100, 3, 60], jnp.int32)  # 200 rows: 100 rows past the groups
    poisoned = dy.at[200::2].set(jnp.nan).at[201::2].set(jnp.inf)
    out = _ours(transpose_out)(x, src, poisoned, gs)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_close(out, _ref(x, src, dy, gs, transpose_out=transpose_out), dtype)


@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_preferred_element_type(rng, in_dtype, out_dtype, transpose_out):
    x, dy = normal(rng, (64, 32), in_dtype), normal(rng, (100, 40), in_dtype)
    src, gs = _src(rng, 64, 100), jnp.array([30, 0, 65], jnp.int32)
    out = _ours(transpose_out, out_dtype)(x, src, dy, gs)
    assert out.dtype == out_dtype
    assert_close(out, _ref(x, src, dy, gs, transpose_out=transpose_out), out_dtype)


@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("t,m,sizes", [(0, 16, [10, 6]), (16, 0, [3, 0]), (16, 24, []), (16, 24, [0, 0])],
                         ids=["no-tokens", "no-rows", "no-groups", "empty-groups"])
def test_empty(rng, t, m, sizes, transpose_out):
    # Every block is zero: no token to read, no row, or only empty groups (or no block).
    x, dy = normal(rng, (t, 16), jnp.bfloat16), normal(rng, (m, 8), jnp.bfloat16)
    src = jnp.asarray(rng.integers(0, max(t, 1), size=m), jnp.int32)
    out = _ours(transpose_out)(x, src, dy, jnp.asarray(sizes, jnp.int32).reshape(len(sizes)))
    assert out.shape == ((len(sizes), 8, 16) if transpose_out else (len(sizes), 16, 8))
    assert np.all(np.asarray(out, np.float32) == 0)


# ---------------------------------------------------------------------------- autodiff


@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grads_match_vjp_of_reference(rng, dtype, transpose_out):
    t, m, k, n = 40, 120, 16, 24
    x, dy = normal(rng, (t, k), dtype), normal(rng, (m, n), dtype)
    src, gs = _src(rng, t, m), jnp.array([30, 0, 45, 20], jnp.int32)  # sum 95 < M = 120
    weights = normal(rng, (4, n, k) if transpose_out else (4, k, n), jnp.float32)

    def grads(fn, x, dy):
        loss = lambda x, dy: jnp.sum(fn(x, src, dy, gs, transpose_out=transpose_out).astype(jnp.float32) * weights)
        return jax.jit(jax.grad(loss, (0, 1)))(x, dy)

    ours = grads(moe_xla.gather_tgmm, x, dy)
    ref = grads(reference.gather_tgmm, x.astype(jnp.float32), dy.astype(jnp.float32))
    for o, r in zip(ours, ref):
        assert o.dtype == dtype
        assert_close(o, r, dtype)
    assert np.all(np.asarray(ours[1], np.float32)[95:] == 0), "rows past the groups get zero gradient"


@pytest.mark.parametrize("transpose_out", [False, True])
def test_check_grads(rng, transpose_out):
    x, dy = normal(rng, (10, 6), jnp.float32), normal(rng, (20, 5), jnp.float32)
    src, gs = _src(rng, 10, 20), jnp.array([7, 0, 9], jnp.int32)
    check_grads(lambda a, b: moe_xla.gather_tgmm(a, src, b, gs, transpose_out=transpose_out), (x, dy), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=1e-2)


# ---------------------------------------------------------------------------- vmap and sharding


@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (None, 0, 0, 0), (0, None, None, None), (1, 0, None, 0)])
def test_vmap(rng, in_axes, transpose_out):
    b, t, m, k, n, g = 3, 20, 30, 16, 8, 4
    shapes = [(t, k), (m,), (m, n), (g,)]
    shapes = [s if a is None else s[:a] + (b,) + s[a:] for s, a in zip(shapes, in_axes)]
    x, dy = normal(rng, shapes[0], jnp.float32), normal(rng, shapes[2], jnp.float32)
    src = jnp.asarray(rng.integers(-2, t + 2, size=shapes[1]), jnp.int32)
    gs = jnp.asarray(rng.integers(0, 12, size=shapes[3]), jnp.int32)
    ours_fn = functools.partial(moe_xla.gather_tgmm, transpose_out=transpose_out)
    ref_fn = functools.partial(reference.gather_tgmm, transpose_out=transpose_out)
    ours = jax.jit(jax.vmap(ours_fn, in_axes))(x, src, dy, gs)
    assert ours.shape == (b, g) + ((n, k) if transpose_out else (k, n))
    assert_close(ours, jax.vmap(ref_fn, in_axes)(x, src, dy, gs), jnp.float32)
    cts = normal(rng, ours.shape, jnp.float32)
    loss = lambda fn, x, dy: jnp.sum(jax.vmap(fn, in_axes)(x, src, dy, gs) * cts)
    for o, r in zip(jax.jit(jax.grad(lambda x, dy: loss(ours_fn, x, dy), (0, 1)))(x, dy),
                    jax.grad(lambda x, dy: loss(ref_fn, x, dy), (0, 1))(x, dy)):
        assert_close(o, r, jnp.float32)


def _mesh_case(rng):
    """(x, src, dy, gs, the mesh, the four operands on it): x split along K, dy along N."""
    x, dy = normal(rng, (40, 16), jnp.float32), normal(rng, (50, 32), jnp.float32)
    src, gs = _src(rng, 40, 50), jnp.array([20, 0, 25], jnp.int32)
    mesh = jax.make_mesh((2, 4), ("k", "n"))
    args = [jax.device_put(a, NamedSharding(mesh, spec))
            for a, spec in ((x, P(None, "k")), (src, P()), (dy, P(None, "n")), (gs, P()))]
    return x, src, dy, gs, mesh, args


def _assert_split_blocks(out, mesh, x, src, dy, gs, transpose_out):
    """out is split along K and N as the operands are ([G, N, K] blocks with transpose_out)
    and equals one device's result."""
    want = P(None, "n", "k") if transpose_out else P(None, "k", "n")
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, want), 3)
    assert_close(out, _ref(x, src, dy, gs, transpose_out=transpose_out), jnp.float32)


@requires_8_devices
@pytest.mark.parametrize("transpose_out", [False, True])
def test_follows_k_and_n_on_a_mesh(rng, transpose_out):
    x, src, dy, gs, mesh, args = _mesh_case(rng)
    _assert_split_blocks(_ours(transpose_out)(*args), mesh, x, src, dy, gs, transpose_out)


@requires_8_devices
@pytest.mark.parametrize("transpose_out", [False, True])
def test_sharding_rule_splits_the_blocks_without_communication(rng, transpose_out):
    # The rule the kernel's lowering is partitioned with (on CPU the primitive lowers to its
    # decomposition, whose parts have rules of their own), run here through the
    # custom_partitioning function itself: each device's shard computed from its local
    # operands, no collective.
    x, src, dy, gs, mesh, args = _mesh_case(rng)
    params = dict(transpose_out=transpose_out, preferred_element_type=jnp.dtype(jnp.float32))
    fn = jax.jit(_sharding.partitioned(gather_tgmm_p, _sharding.GATHER_TGMM, tuple(sorted(params.items()))))
    _assert_split_blocks(fn(*args), mesh, x, src, dy, gs, transpose_out)
    hlo = fn.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)


# ---------------------------------------------------------------------------- lowering and errors


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@needs_cuda_kernel
@pytest.mark.parametrize("transpose_out", [False, True])
@pytest.mark.parametrize("k,n,dtype,out_dtype,kernel", [
    (16, 24, jnp.bfloat16, None, True), (16, 24, jnp.bfloat16, jnp.float32, True),
    (12, 24, jnp.bfloat16, None, False), (16, 20, jnp.bfloat16, None, False),
    (16, 24, jnp.float32, None, False), (16, 24, jnp.float16, None, False)])
def test_cuda_lowering_takes_the_kernel_where_it_applies(k, n, dtype, out_dtype, kernel, transpose_out):
    x, dy = jnp.zeros((10, k), dtype), jnp.zeros((12, n), dtype)
    src, gs = jnp.zeros((12,), jnp.int32), jnp.zeros((2,), jnp.int32)
    fn = functools.partial(moe_xla.gather_tgmm, transpose_out=transpose_out, preferred_element_type=out_dtype)
    decomposition = ["moe_xla_gather_rows_cuda_v1", "moe_xla_tgmm_cuda_v1"]
    assert cuda_targets(fn, x, src, dy, gs) == (["moe_xla_gather_tgmm_cuda_v2"] if kernel else decomposition)
    if kernel:
        # The kernel writes the layout itself: its call carries the attribute and returns
        # [G, N, K] blocks, with no transpose around it.
        text = _cuda_text(fn, x, src, dy, gs)
        assert re.search(rf"transpose_out = {str(transpose_out).lower()}", text), text
        block = f"{n}x{k}" if transpose_out else f"{k}x{n}"
        assert re.search(rf"custom_call @moe_xla_gather_tgmm_cuda_v2\(.*-> \(tensor<2x{block}x", text), text
        assert "stablehlo.transpose" not in text


@needs_cuda_kernel
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gather_gmm_gradient_in_w_is_a_gather_tgmm(transpose_rhs):
    # With transpose_rhs, w [G, N, K]: the kernel writes d w in that layout (transpose_out),
    # no transpose follows it.
    x, w = jnp.zeros((10, 16), jnp.bfloat16), jnp.zeros((2, 24, 16) if transpose_rhs else (2, 16, 24), jnp.bfloat16)
    src, gs = jnp.zeros((12,), jnp.int32), jnp.zeros((2,), jnp.int32)
    loss = lambda w: jnp.sum(moe_xla.gather_gmm(x, src, w, gs, transpose_rhs=transpose_rhs).astype(jnp.float32))
    targets = cuda_targets(jax.grad(loss), w)
    assert "moe_xla_gather_tgmm_cuda_v2" in targets
    assert "moe_xla_gather_rows_cuda_v1" not in targets and "moe_xla_tgmm_cuda_v1" not in targets
    assert "stablehlo.transpose" not in _cuda_text(jax.grad(loss), w)


@pytest.mark.parametrize("transpose_out", [False, True])
def test_cpu_lowering_is_the_decomposition(rng, transpose_out):
    x, dy = normal(rng, (10, 16), jnp.bfloat16), normal(rng, (12, 8), jnp.bfloat16)
    fn = functools.partial(moe_xla.gather_tgmm, transpose_out=transpose_out)
    text = jax.jit(fn).trace(x, jnp.zeros((12,), jnp.int32), dy, jnp.zeros((2,), jnp.int32)).lower(
        lowering_platforms=("cpu",)).as_text()
    assert re.findall(r"custom_call @(moe_xla_\w+)", text) == ["moe_xla_gather_rows_cpu_v1", "moe_xla_tgmm_cpu_v1"]
    assert "stablehlo.transpose" not in text  # the tgmm's operands in the other order


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
    (dict(transpose_out=1), TypeError, "expected transpose_out to be a Python bool, got 1"),
])
def test_bad_inputs(change, exc, message):
    args = dict(x=jnp.zeros((4, 8)), src=jnp.zeros((6,), jnp.int32), dy=jnp.zeros((6, 5)),
                gs=jnp.zeros((2,), jnp.int32)) | change
    kw = {key: args.pop(key) for key in ("preferred_element_type", "transpose_out") if key in args}
    with pytest.raises(exc, match=f"gather_tgmm: {message}"):
        moe_xla.gather_tgmm(args["x"], args["src"], args["dy"], args["gs"], **kw)
