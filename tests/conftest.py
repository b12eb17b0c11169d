"""Shared test helpers: random data, group sizes with the hard cases, error metrics."""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_enable_x64", False)
# References are evaluated at full float32 precision (no TF32 on GPUs).
jax.config.update("jax_default_matmul_precision", "highest")

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}
ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
# Meshes of 8 devices: CI's 8 CPU devices (XLA_FLAGS above); skipped on a one-GPU host.
requires_8_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def rel_err(out, ref) -> float:
    """|out - ref| / |ref| in float64 (Frobenius norms); NaN anywhere gives inf."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)


def assert_close(out, ref, dtype, scale: float = 1.0):
    err = rel_err(out, ref)
    tol = TOLERANCE[jnp.dtype(dtype)] * scale
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def group_sizes_cases(m: int, g: int, rng) -> dict[str, np.ndarray]:
    """Named group-size vectors of length g for m rows, covering the hard cases."""
    cases = {}
    cuts = np.sort(rng.integers(0, m + 1, size=g - 1))
    cases["random"] = np.diff(np.concatenate([[0], cuts, [m]]))
    with_zeros = cases["random"].copy()
    with_zeros[rng.choice(g, size=max(1, g // 2), replace=False)] = 0
    with_zeros[-1] += m - with_zeros.sum() if g > 1 else 0
    cases["zeros"] = with_zeros
    giant = np.zeros(g, np.int64)
    giant[g // 2] = m
    cases["one_giant"] = giant
    cases["sum_below_m"] = np.floor(cases["random"] * 0.6).astype(np.int64)
    return {k: np.asarray(v, np.int32) for k, v in cases.items()}


@pytest.fixture
def rng(request):
    # Fresh data per test, the same in every run: seeded by a checksum of the test's id
    # (Python's str hash changes from process to process).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
