"""The expert-parallel layer on one device: a one-device mesh with each transport, the
padded one (all_to_all, the default; on every backend) and the ragged one (XLA's
ragged_all_to_all, not implemented on XLA:CPU, so GPU only; test_parallel.py covers its
CPU stand-in on 8 devices).

With one rank every row is sent to itself, so in f32 (whose GEMMs sum in a fixed order
whatever the row count) the layer must reproduce the single-device moe() bitwise in the
forward pass without dedup, also when a small capacity_factor forces further rounds; in
bf16 the GPU grouped GEMM's tile choice depends on the buffer's row count, so to bf16
rounding there (the CPU kernels sum in a fixed order in every dtype: bitwise). Gradients
to f32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_xla
from conftest import ON_GPU, assert_close, normal, requires_gpu

T, H, F, E = 256, 64, 32, 8


def _inputs(rng, dtype):
    x = normal(rng, (T, H), dtype)
    logits = normal(rng, (T, E), jnp.float32).at[:, 3].add(1.5)  # skewed: expert 3 is popular
    w_in = (normal(rng, (E, H, 2 * F), jnp.float32) / np.sqrt(H)).astype(dtype)
    w_out = (normal(rng, (E, F, H), jnp.float32) / np.sqrt(F)).astype(dtype)
    return x, logits, w_in, w_out


def _ep(mesh, dedup, capacity_factor, transport):
    return lambda *a: moe_xla.moe(*a, top_k=2, mesh=mesh, expert_axis="ep", transport=transport, dedup=dedup,
                                  capacity_factor=capacity_factor)


TRANSPORTS = ["padded", pytest.param("ragged", marks=requires_gpu)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 0.25])
def test_one_device_transport_matches(rng, dtype, capacity_factor, transport):
    args = _inputs(rng, dtype)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    ep = jax.jit(_ep(mesh, False, capacity_factor, transport))
    # (the padded transport's all_to_all over a one-device axis is elided by JAX)
    assert ("@ragged_all_to_all" in ep.lower(*args).as_text()) == (transport == "ragged")
    y = ep(*args)
    y_one = jax.jit(lambda *a: moe_xla.moe(*a, top_k=2))(*args)
    if dtype == jnp.float32 or not ON_GPU:
        np.testing.assert_array_equal(y, y_one)
    assert_close(y, y_one, dtype)
    np.testing.assert_array_equal(ep(*args), y)  # run to run
    assert_close(jax.jit(_ep(mesh, True, capacity_factor, transport))(*args), y_one, dtype)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_device_transport_gradients(rng, transport):
    args = _inputs(rng, jnp.float32)
    ct = normal(rng, (T, H), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))

    def grads(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3)))(*args)

    one = grads(lambda *a: moe_xla.moe(*a, top_k=2))
    for capacity_factor in (None, 0.25):
        for g, g_one in zip(grads(_ep(mesh, True, capacity_factor, transport)), one):
            assert_close(g, g_one, jnp.float32, scale=10)


@pytest.mark.parametrize("dedup", [True, False])
def test_one_device_gathered_first_product(rng, dedup):
    """bf16 (on a Hopper GPU the first product's gather_gmm kernel): the receiving rank's
    experts reading the received rows in place give the values and gradients of the copied
    rows (to bf16 rounding on the GPU, whose kernels may tile the two differently; bitwise
    on CPU), also with a capacity factor's further rounds."""
    args = _inputs(rng, jnp.bfloat16)
    ct = normal(rng, (T, H), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    results = {}
    for mode in ("gather", "copy"):
        with moe_xla.first_product.forced(mode):
            for capacity_factor in (None, 0.25):
                # Fresh functions per mode: jit reuses a function's trace, made under one mode.
                layer = _ep(mesh, dedup, capacity_factor, "padded")
                y = jax.jit(lambda *a: layer(*a))(*args)
                g = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) * ct), (0, 1, 2, 3)))(*args)
                results[mode, capacity_factor] = (y, *g)
    for capacity_factor in (None, 0.25):
        for a, b in zip(results["gather", capacity_factor], results["copy", capacity_factor]):
            if ON_GPU:
                assert_close(a, b, jnp.bfloat16, scale=4)
            else:
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
