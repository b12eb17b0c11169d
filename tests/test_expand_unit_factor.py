"""expand_quantize_fp8_rows without a factor (factor=None: every factor 1), the form moe()'s
FP8 dispatch takes: the same bits as a factor of ones (rows, q and scales; strictly, NaN
payloads included, on one platform) for every dtype, width and special value, with no
[T, k] array of ones in the program. Under vmap (batched and unbatched operands), eager,
the reference lowering and sharded operands; the call takes two operands, the handler
rejects a second trailing operand and a factor of the wrong dtype, naming it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_expand_quantize_fp8_rows import (DTYPES, MIN_NORMAL, PLATFORMS, SHAPES, _bits, _case, _on, _per_batch,
                                           _quantized, _reference_on_cpu, _unscaled_rows, assert_outputs_bitwise)
from test_fp8_quantize import assert_bitwise, tricky

from moe_xla import _lib
from moe_xla.primitives.expand_quantize_fp8_rows import expand_quantize_fp8_rows, expand_quantize_fp8_rows_p

CALL = re.compile(r"stablehlo.custom_call @moe_xla_expand_quantize_fp8_rows_\w+\(([^)]*)\)")


def assert_same_bits(out, want, what):
    """(rows, q, scales) bitwise want's, NaN payloads included (one platform, one product)."""
    assert_bitwise(out, want, what, names=("rows", "q", "scales"))


def _unit_and_ones(platform, values, slots, num_rows, pow2=False):
    """The op without a factor and with a factor of ones, jitted on `platform`."""
    f = jax.jit(lambda v, s, *factor: expand_quantize_fp8_rows(v, s, factor[0] if factor else None, num_rows,
                                                               pow2_scale=pow2))
    ones = jnp.ones(slots.shape, jnp.float32)
    return f(*_on(platform, values, slots)), f(*_on(platform, values, slots, ones))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("permutation", [False, True], ids=["any_slots", "permutation"])
def test_unit_factor_is_a_factor_of_ones_bitwise(rng, permutation, shape, dtype, pow2, platform):
    """Every special value (NaN, inf, subnormals, +-2^-126, zeros), slots naming rows twice,
    none and outside [0, R), empty shapes: the bits of factors of ones; the rows are numpy's
    unscaled rows (entries of magnitude at most 2^-126 zeros of their sign) and the
    reference's unit form."""
    t, k, r, h = shape
    if permutation:
        r = t * k
    values, slots, _ = _case(rng, t, k, r, h, dtype, permutation=permutation)
    unit, ones = _unit_and_ones(platform, values, slots, r, pow2)
    assert_same_bits(unit, ones, "the op with factors of ones")
    assert_outputs_bitwise(unit, _reference_on_cpu(values, slots, None, r, pow2), "the reference without factor")
    unscaled = _unscaled_rows(values, slots, r)
    nan = np.isnan(np.asarray(unscaled, np.float32))
    assert np.array_equal(np.isnan(np.asarray(unit[0], np.float32)), nan)
    assert np.array_equal(_bits(unit[0])[~nan], _bits(unscaled)[~nan]), "rows: not numpy's unscaled rows"
    assert_bitwise(unit[1:], _quantized(unscaled, pow2), "quantize_fp8_rows of the unscaled rows")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_entries_and_zeros_are_zeros_of_their_sign(dtype, platform):
    """Zeros, float32 subnormals (bfloat16's too), +-2^-126 and the next values up: the unit
    form rounds 1 * v with the same flushing as a factor of ones, so it is not a copy."""
    tiny = np.float32([0.0, -0.0, 1e-40, -1e-40, MIN_NORMAL, -MIN_NORMAL, np.nextafter(np.float32(MIN_NORMAL), 1),
                       -2.0 ** -120, 2.0 ** -14, 3.0])
    values = jnp.asarray(np.tile(tiny, (3, 13))[:, :130], dtype)
    slots = jnp.asarray([[2, 0], [1, -1], [5, 3]], jnp.int32)
    unit, ones = _unit_and_ones(platform, values, slots, 6)
    assert_same_bits(unit, ones, "the op with factors of ones")
    v = np.asarray(values, np.float32)
    flushed = np.where(np.abs(v) <= np.float32(MIN_NORMAL), np.copysign(np.float32(0), v), v).astype(dtype)
    rows = np.asarray(unit[0])
    for r, t in ((2, 0), (0, 0), (1, 1), (5, 2), (3, 2)):
        np.testing.assert_array_equal(_bits(rows[r]), _bits(flushed[t]), f"row {r} (token {t})")
    assert np.all(_bits(rows[4]) == 0), "row 4, which no pair names, is +0"
    if dtype != jnp.float16:  # float16 holds no value of magnitude at most 2^-126 but zeros
        assert np.any(_bits(rows[0]) != _bits(np.asarray(values)[0])), "some entries flushed"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_slots_naming_no_row_give_zero_rows(rng, platform):
    """Every slot outside [0, R), and no tokens at all: rows +0, q 0, scales 1."""
    slots = jnp.asarray([[-1, 3], [4, -(2 ** 31)], [2 ** 31 - 1, 1000]], jnp.int32)
    for values, s in [(tricky(rng, (3, 260), jnp.bfloat16), slots), (jnp.zeros((0, 260), jnp.bfloat16), slots[:0])]:
        rows, q, scales = jax.jit(lambda v, s: expand_quantize_fp8_rows(v, s, None, 3))(*_on(platform, values, s))
        assert np.all(_bits(rows) == 0) and np.all(_bits(q) == 0)
        np.testing.assert_array_equal(np.asarray(scales), np.ones((3, 3), np.float32))


def _unit_call_operands(text):
    """The operand count of every expand custom call in lowered StableHLO text."""
    return [c.count("%") for c in CALL.findall(text)]


def test_vmap_of_the_unit_form(rng):
    """Batched and unbatched values and slots: each batch entry's own unit form, bitwise its
    factor of ones under vmap, and the folded call still takes no factor operand."""
    b, t, k, r, h = 3, 9, 3, 30, 140
    cases = [_case(rng, t, k, r, h, jnp.bfloat16) for _ in range(b)]
    values, slots = (jnp.stack([c[i] for c in cases]) for i in (0, 1))
    slots = slots.at[:, 4, 0].set(r).at[:, 4, 1].set(-1).at[:, 5, 0].set(2 * r - 1)
    ones = jnp.ones(slots.shape, jnp.float32)
    unit = lambda v, s: expand_quantize_fp8_rows(v, s, None, r, pow2_scale=True)  # noqa: E731
    with_ones = lambda v, s, f: expand_quantize_fp8_rows(v, s, f, r, pow2_scale=True)  # noqa: E731
    got = jax.jit(jax.vmap(unit))(values, slots)
    assert_same_bits(got, jax.jit(jax.vmap(with_ones))(values, slots, ones), "vmap with factors of ones")
    assert_outputs_bitwise(got, _per_batch(values, slots, ones, r, True), "the op per batch entry")
    for in_axes, v, s in [((None, 0), values[0], slots), ((0, None), values, slots[1])]:
        out = jax.jit(jax.vmap(unit, in_axes=in_axes))(v, s)
        full = [jnp.broadcast_to(a, (b,) + a.shape) if ax is None else a for a, ax in zip((v, s), in_axes)]
        assert_same_bits(out, _per_batch(*full, ones, r, True), "the op per batch entry")
    text = jax.jit(jax.vmap(unit)).lower(values, slots).as_text()
    assert _unit_call_operands(text) == [2], text


def test_eager_and_reference_lowering_are_the_kernel(monkeypatch, rng):
    values, slots, _ = _case(rng, 12, 3, 33, 300, jnp.bfloat16)
    args = _on("cpu", values, slots)
    g = lambda v, s: expand_quantize_fp8_rows(v, s, None, 33)  # noqa: E731
    kernel = jax.jit(g)(*args)
    assert_same_bits(g(*args), kernel, "the jitted kernel")
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    f = jax.jit(lambda *a: g(*a))  # a fresh jit: MOE_XLA_IMPL is read while lowering
    text = f.lower(*args).as_text()
    assert "moe_xla_expand_quantize_fp8_rows" not in text
    assert_outputs_bitwise(f(*args), kernel, "the kernel")
    assert_outputs_bitwise(jax.jit(jax.vmap(g))(*(jnp.stack([a, a]) for a in args)),
                           [jnp.stack([o, o]) for o in kernel], "the kernel per batch entry")


def test_unit_call_takes_two_operands_and_builds_no_ones():
    t, k, h = 8, 4, 256
    args = (jnp.zeros((t, h), jnp.bfloat16), jnp.zeros((t, k), jnp.int32))
    text = jax.jit(lambda v, s: expand_quantize_fp8_rows(v, s, None, t * k)).lower(*args).as_text()
    platform = "cuda" if jax.default_backend() == "gpu" else "cpu"
    assert text.count(f"moe_xla_expand_quantize_fp8_rows_{platform}_v2") == 1
    assert _unit_call_operands(text) == [2] and "broadcast" not in text, text
    text = jax.jit(lambda v, s, f: expand_quantize_fp8_rows(v, s, f, t * k)).lower(
        *args, jnp.ones((t, k), jnp.float32)).as_text()
    assert _unit_call_operands(text) == [3], text


def test_not_differentiable_but_stop_gradient_works():
    values, slots = jnp.ones((4, 130)), jnp.arange(8, dtype=jnp.int32).reshape(4, 2)
    loss = lambda v: jnp.sum(expand_quantize_fp8_rows(v, slots, None, 8)[0])  # noqa: E731
    with pytest.raises(TypeError, match="expand_quantize_fp8_rows is not differentiable"):
        jax.grad(loss)(values)
    grad = jax.grad(lambda v: loss(jax.lax.stop_gradient(v)) + jnp.sum(v))(values)
    assert np.all(np.asarray(grad) == 1.0)


V, I = jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32)


@pytest.mark.parametrize("call, exc, message", [
    (lambda: expand_quantize_fp8_rows(V, I, 1.0, 8), ValueError, r"expected factor of shape \(4, 2\), got \(\)"),
    (lambda: expand_quantize_fp8_rows_p.bind(V, I, num_rows=8, pow2_scale=False, has_factor=True), ValueError,
     r"expected one factor operand \(has_factor=True\), got 0"),
    (lambda: expand_quantize_fp8_rows_p.bind(V, I, jnp.ones((4, 2)), num_rows=8, pow2_scale=False,
                                             has_factor=False), ValueError,
     r"expected no factor operand \(has_factor=False\), got 1"),
    (lambda: expand_quantize_fp8_rows(V, I[:3], None, 8), ValueError,
     r"expected slots.shape\[0\] \(T of values \[T, H\]\) = 4, got 3"),
])
def test_bad_inputs_raise_at_trace_time(call, exc, message):
    with pytest.raises(exc, match=f"expand_quantize_fp8_rows: {message}"):
        jax.eval_shape(call)


RESULTS = (((6, 16), jnp.bfloat16), ((6, 16), jnp.float8_e4m3fn), ((6, 1), jnp.float32))


def _handler(*operands):
    call = jax.ffi.ffi_call(_lib.require_kernel("expand_quantize_fp8_rows", "cpu"),
                            [jax.ShapeDtypeStruct(*r) for r in RESULTS])
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.block_until_ready(jax.jit(lambda *a: call(*a, pow2_scale=False))(*operands))


@pytest.mark.parametrize("extra, message", [
    ([((4, 2), jnp.float32), ((4, 2), jnp.float32)], r"expand_quantize_fp8_rows: expected at most one operand "
                                                      r"after slots \(factor\), got 2"),
    ([((4, 2), jnp.bfloat16)], "factor: expected float32, got bfloat16"),
])
def test_handler_rejects_a_bad_trailing_operand(extra, message):
    operands = [jnp.zeros((4, 16), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32)] + [jnp.zeros(*a) for a in extra]
    with pytest.raises(Exception, match=message):
        _handler(*operands)


def test_handler_without_factor_is_the_primitive(rng):
    values = jnp.asarray(rng.standard_normal((4, 16)), jnp.bfloat16)
    slots = jnp.asarray([[5, 0], [1, -1], [2, 2], [4, 9]], jnp.int32)
    assert_same_bits(_handler(values, slots), jax.jit(lambda v, s: expand_quantize_fp8_rows(v, s, None, 6))(
        values, slots), "the primitive")


def test_sharded_operands_give_the_one_device_result(rng):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    values, slots, _ = _case(rng, 24, 4, 96, 300, jnp.float32, permutation=True)
    f = jax.jit(lambda v, s: expand_quantize_fp8_rows(v, s, None, 96))
    one = f(*jax.device_get((values, slots)))
    assert_same_bits(f(*(jax.device_put(a, split) for a in (values, slots))), one, "one device")
