"""gather_rows: rows gathered through an index, each optionally scaled.

The kernels (CPU everywhere, CUDA where there is a GPU) against the reference evaluated on
the CPU, bitwise: a copy keeps every bit (NaN payloads too); a scaled row's NaN only has to
be NaN where the reference's is. Data: values with every special case (NaN, inf, subnormal,
signed zeros), factors of 0, -0, negative, huge, subnormal, inf and NaN, src entries
outside [0, T) (-1, T, INT32_MIN, INT32_MAX) and repeated, no rows, no values, no columns,
odd widths and widths of every copy unit; on the GPU a big case and one past 2^31 bytes.
Gradients against a dense one-hot product (not the reference), check_grads, vmap, jit,
eager, the reference lowering, sharding along R and H, errors, and the ops that use it
(unpermute's unique-rows transpose, gather_gmm's decomposition) lowering to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, requires_gpu
from jax.test_util import check_grads
from test_fp8_quantize import _reference_on, tricky
from test_expand_quantize_fp8_rows import _bits, assert_rows_bitwise

import moe_xla
from moe_xla import reference
from moe_xla.primitives.gather_rows import gather_rows, gather_rows_p

PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (T, R, H): H a multiple of 8 (16-byte units for 16-bit dtypes), H = 4 and 2 mod 8 (8- and
# 4-byte units), odd H (2-byte units), one column, more rows than values (repeats), no
# rows, no values, no columns.
SHAPES = [(37, 50, 256), (5, 40, 300), (64, 64, 136), (3, 9, 7), (11, 30, 1), (20, 33, 6), (10, 0, 128),
          (0, 6, 130), (6, 4, 0), (200, 1000, 1032)]
INVALID = [-1, "T", "T+1", -(2 ** 31), 2 ** 31 - 1, -7]


def _src(rng, t, r):
    """[R] int32: random rows of [0, T), the invalid entries of INVALID, repeats."""
    src = rng.integers(0, max(t, 1), r).astype(np.int64)
    invalid = np.array([t if v == "T" else t + 1 if v == "T+1" else v for v in INVALID], np.int64)
    src[5: 5 + invalid.size] = invalid[: max(0, r - 5)]
    if r > 12:
        src[11:13] = src[0]  # repeated next to unrelated rows
    if t == 0:
        src[:] = np.resize(invalid, r)
    return jnp.asarray(src, jnp.int32)


def _factor(rng, r):
    """[R] float32 of every magnitude and the special values."""
    f = (rng.standard_normal(r) * np.exp(rng.uniform(-8, 8, r))).astype(np.float32)
    special = np.array([0.0, -0.0, -1.0, 1.0, 3e38, -1e30, 1e-40, 2.0 ** -126, np.inf, np.nan], np.float32)
    f[13: 13 + special.size] = special[: max(0, r - 13)]
    return jnp.asarray(f)


def _case(rng, t, r, h, dtype, with_factor):
    return tricky(rng, (t, h), dtype), _src(rng, t, r), _factor(rng, r) if with_factor else None


def _on(platform, *args):
    return [None if a is None else jax.device_put(a, jax.devices(platform)[0]) for a in args]


def _reference_on_cpu(values, src, factor):
    if factor is None:
        return _reference_on("cpu", lambda a: reference.gather_rows(*a), (values, src))
    return _reference_on("cpu", lambda a: reference.gather_rows(*a), (values, src, factor))


def assert_bitwise(rows, want, with_factor, against="the reference on the CPU"):
    """A copy: every bit. A scaled row: every bit but NaN's sign and payload."""
    if with_factor:
        assert_rows_bitwise(rows, want, against)
    else:
        assert rows.shape == want.shape and rows.dtype == want.dtype
        np.testing.assert_array_equal(_bits(rows), _bits(want), f"rows differ from {against}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("with_factor", [False, True], ids=["copy", "factor"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_is_the_reference_bitwise(rng, shape, dtype, with_factor, platform):
    t, r, h = shape
    values, src, factor = _case(rng, t, r, h, dtype, with_factor)
    out = jax.jit(gather_rows)(*_on(platform, values, src, factor))
    assert out.shape == (r, h) and out.dtype == values.dtype
    assert_bitwise(out, _reference_on_cpu(values, src, factor), with_factor)
    # The contract's own claims: rows of no value are +0 rows; a copy is values' bits.
    named = np.asarray((src >= 0) & (src < t))
    assert np.all(_bits(out)[~named] == 0)
    if not with_factor and t:
        np.testing.assert_array_equal(_bits(out)[named], _bits(values)[np.asarray(src)[named]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_contract_in_numpy(rng, dtype):
    """reference.gather_rows with a factor against the rule in numpy (gradual underflow):
    float32 subnormal operands and products of magnitude at most 2^-126 are zeros of their
    sign, one rounding to the dtype; evaluated on the CPU, whose flushing would hide a
    reference that left it to the FPU."""
    t, r, h = 7, 40, 130
    values, src, factor = _case(rng, t, r, h, dtype, True)
    x = np.asarray(values, np.float32)[np.clip(np.asarray(src), 0, t - 1)]
    tiny = np.nextafter(np.float32(2.0 ** -126), np.float32(0))

    def flushed(v, limit):
        return np.where(np.abs(v) <= limit, np.copysign(np.float32(0), v), v).astype(np.float32)

    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        product = flushed(flushed(np.asarray(factor)[:, None], tiny) * flushed(x, tiny), np.float32(2.0 ** -126))
        named = ((np.asarray(src) >= 0) & (np.asarray(src) < t))[:, None]
        want = np.where(named, product, np.float32(0)).astype(jnp.dtype(dtype))
    assert_rows_bitwise(_reference_on_cpu(values, src, factor), want, "numpy")


def test_invalid_indices_read_nothing_and_give_zero_rows(rng):
    """Every src outside [0, T), any factor: +0 rows; an empty values array too."""
    src = jnp.asarray([-1, 3, 4, -(2 ** 31), 2 ** 31 - 1, 1000], jnp.int32)
    factor = jnp.asarray([1.0, np.nan, np.inf, -2.0, 0.0, 1e30], jnp.float32)
    for values in (tricky(rng, (3, 260), jnp.bfloat16), jnp.zeros((0, 260), jnp.bfloat16)):
        for f in (None, factor):
            assert np.all(_bits(jax.jit(gather_rows)(values, src, f)) == 0)


def _dense(values, src, factor):
    """An independent formula: (factor * one_hot(src)) @ values in float32, [R, T] @ [T, H]."""
    m = (src[:, None] == jnp.arange(values.shape[0])[None, :]).astype(jnp.float32)
    if factor is not None:
        m = m * factor[:, None]
    return jnp.einsum("rt,th->rh", m, values.astype(jnp.float32), precision="highest")


def _unique_src(rng, t, r):
    """[R] int32 naming each of T tokens at most once, with entries naming none."""
    src = np.full(r, -1, np.int64)
    n = min(t, r - 3)
    src[rng.choice(r, n, replace=False)] = rng.permutation(t)[:n]
    src[src == -1] = np.resize([t, -(2 ** 31), 2 ** 31 - 1, -1], int((src == -1).sum()))
    return jnp.asarray(src, jnp.int32)


@pytest.mark.parametrize("unique", [False, True])
@pytest.mark.parametrize("with_factor", [False, True], ids=["copy", "factor"])
def test_grads_are_the_dense_products(rng, with_factor, unique):
    t, r, h = 12, 30, 9
    values = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    src = _unique_src(rng, t, r) if unique else _src(rng, t, r)
    factor = jnp.asarray(rng.standard_normal(r), jnp.float32) if with_factor else None
    ct = jnp.asarray(rng.standard_normal((r, h)), jnp.float32)

    def ours(v, f):
        return gather_rows(v, src, f, unique_sources=unique)

    out, vjp = jax.vjp(ours, values, factor)
    np.testing.assert_allclose(out, _dense(values, src, factor), rtol=1e-6, atol=0)
    d_values, d_factor = jax.jit(vjp)(ct)
    one_hot = (src[:, None] == jnp.arange(t)[None, :]).astype(jnp.float32)
    w = one_hot if factor is None else one_hot * factor[:, None]
    np.testing.assert_allclose(d_values, np.asarray(w, np.float64).T @ np.asarray(ct, np.float64), rtol=1e-5,
                               atol=1e-6)
    if with_factor:
        gathered = np.asarray(one_hot, np.float64) @ np.asarray(values, np.float64)
        np.testing.assert_allclose(d_factor, np.sum(np.asarray(ct, np.float64) * gathered, axis=1), rtol=1e-5,
                                   atol=1e-6)
    # Forward mode: linear in values, bilinear in (values, factor).
    dv = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    df = None if factor is None else jnp.asarray(rng.standard_normal(r), jnp.float32)
    _, tangent = jax.jvp(ours, (values, factor), (dv, df))
    want = _dense(dv, src, factor) + (0 if df is None else _dense(values, src, df))
    np.testing.assert_allclose(tangent, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unique", [False, True])
def test_check_grads(rng, unique):
    t, r, h = 6, 10, 5
    src = _unique_src(rng, t, r) if unique else _src(rng, t, r)
    values = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    factor = jnp.asarray(rng.standard_normal(r), jnp.float32)
    check_grads(lambda v, f: gather_rows(v, src, f, unique_sources=unique), (values, factor), order=2,
                modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)
    check_grads(lambda v: gather_rows(v, src, unique_sources=unique), (values,), order=2, modes=("fwd", "rev"),
                atol=1e-2, rtol=1e-2)


def test_grad_in_values_is_deterministic_and_keeps_the_dtype(rng):
    values = jnp.asarray(rng.standard_normal((50, 64)), jnp.bfloat16)
    src = jnp.asarray(rng.integers(-5, 55, 400), jnp.int32)
    factor = jnp.asarray(rng.standard_normal(400), jnp.float32)
    grad = jax.jit(jax.grad(lambda v, f: jnp.sum(gather_rows(v, src, f).astype(jnp.float32) ** 2), (0, 1)))
    first, again = grad(values, factor), grad(values, factor)
    assert first[0].dtype == jnp.bfloat16 and first[1].dtype == jnp.float32
    for a, b in zip(first, again):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _per_batch(values, src, factor):
    outs = [jax.jit(gather_rows)(values[b], src[b], None if factor is None else factor[b])
            for b in range(src.shape[0])]
    return jnp.stack(outs)


@pytest.mark.parametrize("with_factor", [False, True], ids=["copy", "factor"])
def test_vmap_folds_the_batch_and_keeps_invalid_indices_invalid(rng, with_factor):
    """Batch entry b's src indexes its own values; T itself, negative and huge entries stay
    zero rows instead of naming the next entry's rows. Unbatched operands broadcast."""
    b, t, r, h = 3, 9, 30, 140
    values = jnp.stack([tricky(rng, (t, h), jnp.bfloat16) for _ in range(b)])
    src = jnp.stack([_src(rng, t, r) for _ in range(b)]).at[:, 20].set(t).at[:, 21].set(2 * t - 1)
    factor = jnp.stack([_factor(rng, r) for _ in range(b)]) if with_factor else None
    want = _per_batch(values, src, factor)
    assert_bitwise(jax.vmap(gather_rows)(values, src, factor), want, with_factor, "the op per batch entry")
    moved = jax.vmap(gather_rows, in_axes=(1, 1, None if factor is None else 0), out_axes=1)(
        jnp.swapaxes(values, 0, 1), src.T, factor)
    assert_bitwise(jnp.swapaxes(moved, 0, 1), want, with_factor, "the op per batch entry")
    one = None if factor is None else factor[0]
    shared = jax.vmap(gather_rows, in_axes=(None, 0, None))(values[0], src, one)
    want = _per_batch(jnp.stack([values[0]] * b), src, None if one is None else jnp.stack([one] * b))
    assert_bitwise(shared, want, with_factor, "the op per batch entry")
    stacked = jax.vmap(gather_rows, in_axes=(0, None, None))(values, src[1], one)
    want = _per_batch(values, jnp.stack([src[1]] * b), None if one is None else jnp.stack([one] * b))
    assert_bitwise(stacked, want, with_factor, "the op per batch entry")


def test_vmap_of_grads_is_grads_per_batch_entry(rng):
    b, t, r, h = 3, 8, 20, 6
    values = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    src = jnp.stack([_unique_src(rng, t, r) for _ in range(b)])
    factor = jnp.asarray(rng.standard_normal((b, r)), jnp.float32)
    for unique in (False, True):
        grad = jax.grad(lambda v, s, f: jnp.sum(jnp.sin(gather_rows(v, s, f, unique_sources=unique))), (0, 2))
        batched = jax.vmap(grad)(values, src, factor)
        for i in range(b):
            for got, want in zip(batched, grad(values[i], src[i], factor[i])):
                np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-7)


def test_eager_and_reference_lowering_are_the_kernel(monkeypatch, rng):
    args = _on("cpu", *_case(rng, 12, 33, 300, jnp.bfloat16, True))
    kernel = jax.jit(gather_rows)(*args)
    assert_bitwise(gather_rows(*args), kernel, True, "the jitted kernel")
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda *a: gather_rows(*a))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    assert "moe_xla_gather_rows" not in f.lower(*args).as_text()
    assert_bitwise(f(*args), kernel, True, "the kernel")


def test_lowers_to_one_versioned_call():
    platform = "cuda" if ON_GPU else "cpu"
    v, s, f = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((16,), jnp.int32), jnp.zeros((16,), jnp.float32)
    for args in ((v, s), (v, s, f)):
        text = jax.jit(gather_rows).lower(*args).as_text()
        assert text.count(f"moe_xla_gather_rows_{platform}_v1") == 1 and "gather(" not in text


@pytest.mark.skipif(ON_GPU, reason="names the CPU custom calls of the decomposition")
def test_unpermute_transpose_and_gather_gmm_use_it():
    """unpermute's unique-rows gradient in y_sorted is one gather_rows (with the weights as
    factor); gather_gmm's decomposition (CPU) gathers with it, forward and weight gradient."""
    ys, rm, w = jnp.ones((12, 16)), jnp.arange(12, dtype=jnp.int32), jnp.ones((4, 3))
    grad = jax.jit(jax.grad(lambda ys: jnp.sum(moe_xla.unpermute(ys, rm, w, unique_rows=True))))
    assert "moe_xla_gather_rows_cpu_v1" in grad.lower(ys).as_text()
    x, src, wt, gs = jnp.ones((4, 16)), jnp.arange(12, dtype=jnp.int32) % 4, jnp.ones((2, 16, 8)), jnp.asarray([5, 7],
                                                                                                             jnp.int32)
    f = jax.jit(jax.grad(lambda wt: jnp.sum(moe_xla.gather_gmm(x, src, wt, gs))))
    assert jax.jit(moe_xla.gather_gmm).lower(x, src, wt, gs).as_text().count("moe_xla_gather_rows_cpu_v1") == 1
    assert "moe_xla_gather_rows_cpu_v1" in f.lower(wt).as_text()


V, I, F = jnp.zeros((4, 8)), jnp.zeros((5,), jnp.int32), jnp.zeros((5,), jnp.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: gather_rows(V[0], I), r"gather_rows: expected values of rank 2 \[T, H\], got shape \(8,\)"),
    (lambda: gather_rows(V.astype(jnp.int32), I), "gather_rows: expected values of dtype .*, got int32"),
    (lambda: gather_rows(V.astype(jnp.float8_e4m3fn), I), "got float8_e4m3fn"),
    (lambda: gather_rows(V, I[None]), r"gather_rows: expected src of rank 1 \[R\], got shape \(1, 5\)"),
    (lambda: gather_rows(V, I.astype(jnp.uint32)), "gather_rows: expected int32 src, got uint32"),
    (lambda: gather_rows(V, I.astype(jnp.float32)), "gather_rows: expected int32 src, got float32"),
    (lambda: gather_rows(V, I, F.astype(jnp.bfloat16)), "gather_rows: expected float32 factor, got bfloat16"),
    (lambda: gather_rows(V, I, F[:4]), r"gather_rows: expected factor of shape \(5,\) .*, got \(4,\)"),
    (lambda: gather_rows(V, I, F[None]), r"gather_rows: expected factor of shape \(5,\) .*, got \(1, 5\)"),
    (lambda: gather_rows(V, I, unique_sources=1), "gather_rows: expected unique_sources to be a Python bool"),
])
def test_bad_inputs_raise_at_trace_time(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(call)


@pytest.mark.parametrize("args, result, message", [
    ((((64,), jnp.bfloat16), ((6,), jnp.int32)), ((6, 16), jnp.bfloat16),
     r"values: expected rank 2 \[T, H\], got shape \[64\]"),
    ((((4, 16), jnp.int32), ((6,), jnp.int32)), ((6, 16), jnp.int32), "values: expected dtype float32, bfloat16"),
    ((((4, 16), jnp.bfloat16), ((6,), jnp.float32)), ((6, 16), jnp.bfloat16), "src: expected dtype int32"),
    ((((4, 16), jnp.bfloat16), ((6,), jnp.int32), ((5,), jnp.float32)), ((6, 16), jnp.bfloat16),
     r"factor: expected shape \[6\], got \[5\]"),
    ((((4, 16), jnp.bfloat16), ((6,), jnp.int32), ((6,), jnp.int32)), ((6, 16), jnp.bfloat16),
     "factor: expected dtype float32, got int32"),
    ((((4, 16), jnp.bfloat16), ((6,), jnp.int32)), ((6, 16), jnp.float32), "rows: expected dtype bfloat16"),
    ((((4, 16), jnp.bfloat16), ((6,), jnp.int32)), ((6, 15), jnp.bfloat16), r"rows: expected shape \[6, 16\]"),
])
def test_handler_rejects_inconsistent_buffers(args, result, message):
    """The FFI handlers check what the primitive's shape rule already guarantees, for
    callers that reach the targets without it."""
    from moe_xla import _lib

    call = jax.ffi.ffi_call(_lib.require_kernel("gather_rows", "cpu"), jax.ShapeDtypeStruct(*result))
    operands = [jnp.zeros(*a) for a in args]
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(call)(*operands))


@pytest.mark.parametrize("with_factor", [False, True], ids=["copy", "factor"])
def test_shards_along_rows_and_columns_without_gathering(rng, with_factor):
    """src and factor split along R, values along H (or replicated): each device gathers its
    own rows and columns, no collective; values split along T are gathered first."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "h"))
    named = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa: E731
    values, src, factor = _case(rng, 24, 64, 300, jnp.float32, with_factor)
    one = jax.jit(gather_rows)(*jax.device_get((values, src, factor)))
    f = jax.jit(gather_rows)
    split_factor = None if factor is None else jax.device_put(factor, named("r"))
    for values_spec, out_spec in (((None, "h"), ("r", "h")), ((), ("r",))):
        args = (jax.device_put(values, named(*values_spec)), jax.device_put(src, named("r")), split_factor)
        hlo = f.lower(*args).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
        out = f(*args)
        assert tuple(out.sharding.spec)[: len(out_spec)] == out_spec
        assert_bitwise(out, one, with_factor, "one device")
    out = f(jax.device_put(values, named("r")), jax.device_put(src, named("r")), split_factor)
    assert_bitwise(out, one, with_factor, "one device")


# --- GPU only: big rows, many rows, offsets past 2^31 bytes ------------------------------

@requires_gpu
@pytest.mark.parametrize("with_factor", [False, True], ids=["copy", "factor"])
def test_gpu_big_case_is_the_reference_bitwise(rng, with_factor):
    """R = 70000 rows of H = 4096 bf16 (8 KiB each) from T = 8192 tokens; and rows of every
    copy unit at that size (H + 4, H + 2, H + 1)."""
    for t, r, h in ((8192, 70000, 4096), (1000, 5000, 4100), (1000, 5000, 4098), (1000, 5000, 4097)):
        values = jnp.asarray(rng.standard_normal((t, h), np.float32), jnp.bfloat16)
        src = _src(rng, t, r)
        factor = _factor(rng, r) if with_factor else None
        out = jax.jit(gather_rows)(*_on("gpu", values, src, factor))
        assert_bitwise(out, _reference_on_cpu(values, src, factor), with_factor)


@requires_gpu
def test_gpu_offsets_past_2_31_bytes(rng):
    """Rows past byte 2^31 of the output (and of values) are the right ones: int64 offsets."""
    h = 4096
    t = (2 ** 31) // (2 * h) + 64          # values itself is larger than 2^31 bytes
    r = (2 ** 31) // (2 * h) + 1000         # so is the output
    gpu = jax.devices("gpu")[0]

    @jax.jit
    def make_values():  # each row's bits name it: columns 0 and 1 hold the row's low and high 16 bits
        ids, cols = jnp.arange(t, dtype=jnp.uint32)[:, None], jnp.arange(h, dtype=jnp.uint32)[None, :]
        bits = jnp.where(cols % 2 == 0, ids & 0xFFFF, ids >> 16) ^ ((cols // 2) * 40503 & 0xFFFF)
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)

    with jax.default_device(gpu):
        values = make_values()
    src = jax.device_put(jnp.asarray(rng.integers(0, t, r), jnp.int32).at[-1].set(t - 1).at[-2].set(t), gpu)
    out = jax.jit(gather_rows)(values, src)
    tail = slice(r - 2000, r)
    want = jnp.where((src[tail] < t)[:, None], values[jnp.clip(src[tail], 0, t - 1)], 0)
    np.testing.assert_array_equal(_bits(jax.device_get(out[tail])), _bits(jax.device_get(want)))
