"""quantize_fp8_rows_group_cols: quantize_fp8_rows and quantize_fp8_group_cols of one x from
one read (common/fp8_blockwise.h, Fp8GroupColsParams with q given).

The kernels bitwise against the reference on the CPU (the CPU kernel everywhere, the CUDA
kernel where there is a GPU), on tricky data laid along rows (a zero row tile, subnormal,
NaN / inf rows: the row tiles' exact pass) and along columns (the column tiles'), with the
group edges of test_fp8_wgrad, K of several column-block runs, K tails and K below 8.
Rules: vmap against a loop (and with no rows), a sharded x against one device, the
lowering's target, errors naming the argument in Python and in the FFI handlers.
gmm(quantization="fp8_blockwise_fp8_wgrad"), which
quantises x and dy with it, is tested in test_gmm_fp8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_fp8_quantize import assert_bitwise, tricky
from test_fp8_wgrad import DTYPES, EDGES, PLATFORMS, QUANT_CASES, _case_id, _on

import moe_xla
from moe_xla import reference

# test_fp8_wgrad's cases, plus K of 5 column blocks (two runs of a CUDA CTA's 4) with a
# tail, and one of 8 whole blocks.
CASES = QUANT_CASES + [(400, 600, [129, 0, 200]), (256, 1024, [128, 1, 0, 127])]


def _x(rng, m, k, dtype, along):
    """tricky data with its special rows along the rows of x or (transposed) its columns."""
    if m == 0:
        return jnp.zeros((0, k), dtype)
    return tricky(rng, (m, k), dtype) if along == "rows" else jnp.asarray(np.asarray(tricky(rng, (k, m), dtype)).T)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("along", ["rows", "cols"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_is_the_reference_bitwise(rng, case, dtype, pow2, along, platform):
    m, k, sizes = case
    x, gs = _x(rng, m, k, dtype, along), jnp.asarray(sizes, jnp.int32)
    out = _on(platform, moe_xla.quantize_fp8_rows_group_cols, x, gs, pow2_scale=pow2)
    t = -(-m // 128) + len(sizes)
    assert [o.shape for o in out] == [(m, k), (m, -(-k // 128)), (k, 128 * t), (t, k)]
    assert_bitwise(out, _on("cpu", reference.quantize_fp8_rows_group_cols, x, gs, pow2_scale=pow2),
                   "the reference on the CPU")


def test_vmap_equals_a_loop(rng):
    b, m, k = 3, 300, 136
    sizes = np.array([[0, 129, 100], [300, 0, 0], [-2, 1, 500]], np.int32)
    x = jnp.stack([tricky(rng, (m, k), jnp.bfloat16) for _ in range(b)])
    out = jax.jit(jax.vmap(moe_xla.quantize_fp8_rows_group_cols))(x, jnp.asarray(sizes))
    for i in range(b):
        assert_bitwise([o[i] for o in out], moe_xla.quantize_fp8_rows_group_cols(x[i], jnp.asarray(sizes[i])),
                       f"element {i}")
    # group_sizes shared by the batch
    out = jax.vmap(moe_xla.quantize_fp8_rows_group_cols, in_axes=(0, None))(x, jnp.asarray(sizes[0]))
    for i in range(b):
        assert_bitwise([o[i] for o in out], moe_xla.quantize_fp8_rows_group_cols(x[i], jnp.asarray(sizes[0])),
                       f"element {i}, shared sizes")
    # no rows (the batching rules of both row quantisers)
    out = jax.vmap(moe_xla.quantize_fp8_rows_group_cols)(jnp.zeros((b, 0, k)), jnp.asarray(sizes))
    assert [o.shape for o in out] == [(b, 0, k), (b, 0, 2), (b, k, 128 * 3), (b, 3, k)]
    assert [o.shape for o in jax.vmap(moe_xla.quantize_fp8_rows)(jnp.zeros((b, 0, k)))] == [(b, 0, k), (b, 0, 2)]


def test_sharded_x_gives_the_one_device_result(rng):
    """x split along K (in whole tiles) or M: the op runs on the whole of x, gathered."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    m, k, sizes = 700, 256, jnp.asarray(EDGES, jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = tricky(rng, (m, k), jnp.float32)
    want = _on("cpu", reference.quantize_fp8_rows_group_cols, x, sizes)
    for spec in (P(None, "d"), P("d", None)):
        out = jax.jit(moe_xla.quantize_fp8_rows_group_cols)(jax.device_put(x, NamedSharding(mesh, spec)), sizes)
        assert_bitwise(out, want, f"one device ({spec})")


def test_lowers_to_its_target():
    platform = "cuda" if jax.default_backend() == "gpu" else "cpu"
    text = jax.jit(moe_xla.quantize_fp8_rows_group_cols).lower(jnp.zeros((200, 8)), jnp.asarray([100, 50])).as_text()
    assert f"moe_xla_quantize_fp8_rows_group_cols_{platform}_v1" in text


def test_not_differentiable():
    gs = jnp.asarray([100, 50], jnp.int32)
    with pytest.raises(TypeError, match="quantize_fp8_rows_group_cols is not differentiable"):
        jax.grad(lambda x: moe_xla.quantize_fp8_rows_group_cols(x, gs)[1].sum())(jnp.ones((200, 8)))


@pytest.mark.parametrize("op", ["quantize_fp8_group_cols", "quantize_fp8_rows_group_cols"])
@pytest.mark.parametrize("args, kw, message", [
    ((jnp.zeros((4, 8), jnp.int32), jnp.zeros(2, jnp.int32)), {},
     "{op}: expected x of dtype float32, bfloat16, float16, got int32"),
    ((jnp.zeros((2, 4, 8)), jnp.zeros(2, jnp.int32)), {}, r"expected x of rank 2 \[M, K\], got shape \(2, 4, 8\)"),
    ((jnp.zeros((4, 8)), jnp.zeros((1, 2), jnp.int32)), {}, r"expected group_sizes of rank 1 \[G\], got shape \(1, 2\)"),
    ((jnp.zeros((4, 8)), jnp.zeros(2, jnp.float32)), {}, "expected int32 group_sizes, got float32"),
    ((jnp.zeros((4, 8)), jnp.zeros(2, jnp.uint32)), {}, "expected int32 group_sizes, got uint32"),
    ((jnp.zeros((4, 8)), jnp.zeros(2, jnp.int32)), {"pow2_scale": 1}, "expected pow2_scale to be a Python bool"),
])
def test_bad_inputs_raise_at_trace_time(op, args, kw, message):
    """Both quantisations of the wgrad's operands (this op and quantize_fp8_group_cols)."""
    with pytest.raises((TypeError, ValueError), match=message.format(op=op)):
        jax.eval_shape(lambda *a: getattr(moe_xla, op)(*a, **kw), *args)


# On 200 rows, K 8 and 2 groups: q [200, 8], row_scales [200, 1], q_t [8, 512], scales [4, 8].
_GOOD = [((200, 8), jnp.float8_e4m3fn), ((200, 1), jnp.float32), ((8, 512), jnp.float8_e4m3fn), ((4, 8), jnp.float32)]


def _results(i, shape, dtype):
    results = list(_GOOD)
    results[i] = (shape, dtype)
    return results


@pytest.mark.parametrize("results, message", [
    (_results(0, (200, 7), jnp.float8_e4m3fn), r"q: expected shape \[200, 8\], got \[200, 7\]"),
    (_results(0, (200, 8), jnp.int8), "q: expected dtype float8_e4m3fn"),
    (_results(1, (200, 2), jnp.float32), r"row_scales: expected shape \[200, 1\], got \[200, 2\]"),
    (_results(2, (8, 384), jnp.float8_e4m3fn), r"q_t: expected shape \[8, 512\], got \[8, 384\]"),
    (_results(3, (4, 7), jnp.float32), r"scales: expected shape \[4, 8\], got \[4, 7\]"),
])
def test_handler_rejects_inconsistent_buffers(results, message):
    """The FFI handler checks what the primitive's shape rule already guarantees, for
    callers that reach the target without it."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel("quantize_fp8_rows_group_cols", "cpu"),
                            [jax.ShapeDtypeStruct(s, d) for s, d in results])
    x, gs = jnp.zeros((200, 8)), jnp.asarray([100, 50], jnp.int32)
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, pow2_scale=False))(x, gs))
