"""bfloat16 (and float16) results element by element against float32-accumulated references
computed from the same low-precision inputs.

The kernels' contract (common/grouped_gemm.h, common/routing.h) is: accumulate in float32,
round once to the output dtype. Against a reference that does the same in float64, the
only error left is that final rounding, at most half a unit in the last place: |out -
ref| <= u |ref| with u = 2^-8 (bf16) or 2^-11 (f16), plus a slack for float32 summation
(a few 2^-24 of sum |a_k b_k|). A norm-wise 1e-2 (conftest.TOLERANCE) lets a kernel that
accumulates in bf16, or truncates instead of rounding, pass; this bound does not, and
test_the_bound_rejects_* show it on the same data with emulated faulty kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla
import independent as ind
from conftest import normal

UNIT = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}


def to_dtype(x, dtype):
    """float64 -> dtype, rounding to nearest (even) once."""
    return np.asarray(jnp.asarray(np.asarray(x, np.float32), dtype), np.float64)


def violations(out, exact, slack, dtype):
    """Elements with |out - exact| > u |exact| + slack (slack: an absolute bound, an array
    or a number); every element if out has a NaN or inf."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    if not np.all(np.isfinite(out)):
        return np.size(out)
    return int(np.sum(np.abs(out - exact) > UNIT[jnp.dtype(dtype)] * np.abs(exact) + slack))


def check_rounding_only(out, exact, slack, dtype, what):
    bad = violations(out, exact, slack, dtype)
    assert bad == 0, f"{what}: {bad} of {np.size(exact)} elements beyond one rounding to {jnp.dtype(dtype).name}"


def summation_slack(magnitude):
    """Room for float32 summation against the float64 reference: 2^-16 of sum |a_k b_k|
    (K <= 256 terms, each add off by at most 2^-24 of the running magnitude)."""
    return 2.0**-16 * magnitude


def _grouped(m=96, k=64, n=48, g=5):
    sizes = np.array([20, 0, 31, 33, 7], np.int32)[:g]  # 91 < m rows: the last 5 belong to no group
    return m, k, n, g, sizes


def _gmm_exact(lhs, rhs, sizes):
    """float64 (exact, |.|) of gmm on the rows of each group; rows past the groups are 0."""
    a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, mag, start = np.zeros((a.shape[0], b.shape[2])), np.zeros((a.shape[0], b.shape[2])), 0
    for grp, size in enumerate(sizes):
        out[start:start + size] = a[start:start + size] @ b[grp]
        mag[start:start + size] = np.abs(a[start:start + size]) @ np.abs(b[grp])
        start += size
    return out, mag


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gmm_and_tgmm_round_once(rng, dtype):
    m, k, n, g, sizes = _grouped()
    lhs, rhs, other = normal(rng, (m, k), dtype), normal(rng, (g, k, n), dtype), normal(rng, (m, n), dtype)
    gs = jnp.asarray(sizes)
    out = jax.jit(moe_xla.gmm)(lhs, rhs, gs)
    exact, mag = _gmm_exact(lhs, rhs, sizes)
    check_rounding_only(out, exact, summation_slack(mag), dtype, "gmm")
    out_t = jax.jit(lambda a, b, s: moe_xla.gmm(a, b, s, transpose_rhs=True))(lhs, jnp.swapaxes(rhs, 1, 2), gs)
    check_rounding_only(out_t, exact, summation_slack(mag), dtype, "gmm transpose_rhs")
    t = jax.jit(moe_xla.tgmm)(lhs, other, gs)
    a, b = np.asarray(lhs, np.float64), np.asarray(other, np.float64)
    ends = np.cumsum(sizes)
    t_exact = np.stack([a[e - s:e].T @ b[e - s:e] for s, e in zip(sizes, ends)])
    t_mag = np.stack([np.abs(a[e - s:e]).T @ np.abs(b[e - s:e]) for s, e in zip(sizes, ends)])
    check_rounding_only(t, t_exact, summation_slack(t_mag), dtype, "tgmm")


def _bf16_accumulated_gmm(lhs, rhs, sizes, dtype):
    """A faulty kernel: the running sum rounded to dtype after every add."""
    a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, start = np.zeros((a.shape[0], b.shape[2])), 0
    for grp, size in enumerate(sizes):
        acc = np.zeros((size, b.shape[2]))
        for kk in range(a.shape[1]):
            acc = to_dtype(acc + to_dtype(a[start:start + size, kk:kk + 1] * b[grp, kk][None, :], dtype), dtype)
        out[start:start + size] = acc
        start += size
    return out


def _truncated(x):
    """A faulty kernel: float32 sums cut (not rounded) to bf16."""
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


def test_the_bound_rejects_bf16_accumulation_and_truncation(rng):
    """The check of test_gmm_and_tgmm_round_once can fail: on the same kind of data it rejects
    a bf16-accumulating kernel and a truncating one, and accepts round-to-nearest of the
    float32 sum, while the norm-wise 1e-2 of conftest accepts all three."""
    m, k, n, g, sizes = _grouped()
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (g, k, n), jnp.bfloat16)
    exact, mag = _gmm_exact(lhs, rhs, sizes)
    f32_sum = np.asarray(exact, np.float32)
    honest = to_dtype(f32_sum, jnp.bfloat16)
    faulty = {"bf16 accumulation": _bf16_accumulated_gmm(lhs, rhs, sizes, jnp.bfloat16),
              "truncation": _truncated(f32_sum)}
    assert violations(honest, exact, summation_slack(mag), jnp.bfloat16) == 0
    for name, out in faulty.items():
        norm_err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        assert norm_err < 1e-2, f"{name} would pass the norm-wise check ({norm_err:.2g})"
        assert violations(out, exact, summation_slack(mag), jnp.bfloat16) > np.size(exact) // 20, name


# moe() in bf16: the layer rounds to bf16 where its arrays are bf16 (the grouped GEMMs'
# outputs, the activation's output, the combined y); the oracle below rounds at the same
# places, so the result may differ from it by one rounding of y plus the rare one-unit
# flips of an intermediate whose float32 and float64 values straddle a rounding boundary.
T, H, F, E = 40, 32, 16, 8


def _moe_bf16_oracle(x, logits, w_in, w_out, ids, weights, activation, accumulate=None):
    """y of the bf16 layer in float64 with bf16 roundings where the layer's arrays are bf16.
    accumulate(a, b) replaces the float32-accumulated matrix product (to emulate a fault)."""
    matmul = accumulate or (lambda a, b: to_dtype(a @ b, jnp.bfloat16))
    act = ind.activation_fn(activation)
    xs = np.asarray(x, np.float64)
    y = np.zeros_like(xs)
    for e in range(w_in.shape[0]):
        h = matmul(xs, np.asarray(w_in[e], np.float64))
        a = to_dtype(np.asarray(act(jnp.asarray(h, jnp.float32))), jnp.bfloat16)
        y_e = matmul(a, np.asarray(w_out[e], np.float64))
        y += np.sum(np.where(ids == e, weights, 0.0), axis=-1)[:, None] * y_e
    return y


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_bf16_rounds_like_its_dtype(rng, activation):
    width = 2 * F if activation in ind.GATED_ACTIVATIONS else F
    x = normal(rng, (T, H), jnp.bfloat16)
    logits = ind.separated_logits(rng, (T, E), 2)
    w_in = (normal(rng, (E, H, width), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
    w_out = (normal(rng, (E, F, H), jnp.float32) / np.sqrt(F)).astype(jnp.bfloat16)
    y = jax.jit(lambda *a: moe_xla.moe(*a, top_k=2, activation=activation))(x, logits, w_in, w_out)
    assert y.dtype == jnp.bfloat16
    weights, ids = ind.np_route(logits, 2)
    exact = _moe_bf16_oracle(x, logits, w_in, w_out, ids, weights, activation)
    # Slack: one bf16 unit of an intermediate that rounds the other way moves y by about
    # 2^-8 of one term; 2^-9 of the largest |y| bounds that with room.
    slack = 2.0**-9 * np.abs(exact).max()
    check_rounding_only(y, exact, slack, jnp.bfloat16, f"moe bf16 {activation}")

    # ... and the same bound rejects the layer with bf16-accumulating grouped GEMMs.
    def bf16_sum(a, b):
        acc = np.zeros((a.shape[0], b.shape[1]))
        for kk in range(a.shape[1]):
            acc = to_dtype(acc + to_dtype(a[:, kk:kk + 1] * b[kk][None, :], jnp.bfloat16), jnp.bfloat16)
        return acc

    faulty = _moe_bf16_oracle(x, logits, w_in, w_out, ids, weights, activation, accumulate=bf16_sum)
    assert violations(faulty, exact, slack, jnp.bfloat16) > exact.size // 20
