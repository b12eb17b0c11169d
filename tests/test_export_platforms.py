"""MOE_XLA_IMPL=reference lowers every op on platforms without kernels (exported here with
jax.export for platforms this machine lacks); without it, such a platform is a clear error."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla
from conftest import normal

T, H, E, K, F = 12, 8, 4, 2, 6


def _layer_grads(x, logits, w):
    """route, permute, gmm, unpermute forward; gmm, tgmm and unpermute again backward."""

    def loss(x, logits, w):
        weights, ids = moe_xla.route(logits, K, score="sigmoid")
        x_sorted, sizes, row_map = moe_xla.permute(x, ids, E)
        y = moe_xla.unpermute(moe_xla.gmm(x_sorted, w, sizes), row_map, weights)
        return jnp.sum(y ** 2)

    return jax.grad(loss, (0, 1, 2))(x, logits, w)


def _export(platforms, args):
    # A fresh function each time: jit caches lowerings, and MOE_XLA_IMPL is read while lowering.
    return jax.export.export(jax.jit(lambda *a: _layer_grads(*a)), platforms=platforms)(*args)


def _args(rng):
    return normal(rng, (T, H), jnp.float32), normal(rng, (T, E), jnp.float32), normal(rng, (E, H, H), jnp.float32)


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_reference_exports_for_a_platform_without_kernels(monkeypatch, rng, platform):
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    exported = _export((platform,), _args(rng))
    assert exported.platforms == (platform,)
    assert not re.search(r"moe_xla_\w+_v\d+", exported.mlir_module()), "a kernel call in the reference module"


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_platform_without_kernels_needs_the_reference(monkeypatch, rng, platform):
    monkeypatch.setenv("MOE_XLA_IMPL", "kernel")
    with pytest.raises(NotImplementedError, match=rf"no route kernel for platform {platform}\b.*MOE_XLA_IMPL=reference"):
        _export((platform,), _args(rng))


def test_multi_platform_export_runs_here(monkeypatch, rng):
    # One module for cpu and tpu; its cpu branch runs on this machine and agrees with jit.
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    args = _args(rng)
    exported = _export(("cpu", "tpu"), args)
    if jax.default_backend() != "cpu":
        pytest.skip("runs the exported module's cpu branch")
    for got, want in zip(exported.call(*args), jax.jit(_layer_grads)(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
