"""Eager calls of the public ops compile once per shapes and params: repeating a call on
fresh data of the same shapes compiles nothing."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla
from conftest import normal

# The event jax records for every XLA compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# Shapes of this file only, so the first call of a case compiles here.
T, H, E, K, F = 13, 6, 5, 2, 7


@contextlib.contextmanager
def compiled_functions():
    """Collects the names of the functions XLA compiles inside the block."""
    names = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _routed(rng):
    ids = jnp.asarray(rng.integers(0, E, size=(T, K)).astype(np.int32))
    return ids, jnp.asarray(rng.permutation(T * K).astype(np.int32))


def _sizes(rng, m, g=E):
    return jnp.asarray(np.diff(np.concatenate([[0], np.sort(rng.integers(0, m + 1, g - 1)), [m]])).astype(np.int32))


CASES = {
    "gmm": lambda rng: moe_xla.gmm(normal(rng, (T, H), jnp.float32), normal(rng, (E, H, F), jnp.float32),
                                   _sizes(rng, T)),
    "gmm_transpose_rhs": lambda rng: moe_xla.gmm(normal(rng, (T, H), jnp.float32), normal(rng, (E, F, H), jnp.float32),
                                                 _sizes(rng, T), transpose_rhs=True),
    "tgmm": lambda rng: moe_xla.tgmm(normal(rng, (T, H), jnp.float32), normal(rng, (T, F), jnp.float32),
                                     _sizes(rng, T)),
    "ragged_dot": lambda rng: moe_xla.ragged_dot(normal(rng, (T, H), jnp.float32), normal(rng, (E, H, F), jnp.float32),
                                                 _sizes(rng, T)),
    "route": lambda rng: moe_xla.route(normal(rng, (T, E), jnp.float32), K),
    "route_sigmoid_bias": lambda rng: moe_xla.route(normal(rng, (T, E), jnp.float32), K, score="sigmoid",
                                                    bias=normal(rng, (E,), jnp.float32)),
    "permute": lambda rng: moe_xla.permute(normal(rng, (T, H), jnp.float32), _routed(rng)[0], E),
    "unpermute": lambda rng: moe_xla.unpermute(normal(rng, (T * K, H), jnp.float32), _routed(rng)[1],
                                               normal(rng, (T, K), jnp.float32)),
    "unpermute_grad": lambda rng: jax.grad(lambda y: jnp.sum(moe_xla.unpermute(y, _routed(rng)[1], jnp.ones((T, K)))))(
        normal(rng, (T * K, H), jnp.float32)),
    "gmm_grad": lambda rng: jax.grad(lambda a, b: jnp.sum(moe_xla.gmm(a, b, _sizes(rng, T)) ** 2), (0, 1))(
        normal(rng, (T, H), jnp.float32), normal(rng, (E, H, F), jnp.float32)),
    "moe": lambda rng: moe_xla.moe(normal(rng, (T, H), jnp.float32), normal(rng, (T, E), jnp.float32),
                                   normal(rng, (E, H, 2 * F), jnp.float32), normal(rng, (E, F, H), jnp.float32),
                                   top_k=K),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_repeated_eager_calls_compile_once(rng, name):
    call = CASES[name]
    jax.block_until_ready(call(rng))
    with compiled_functions() as compiled:
        for _ in range(3):
            jax.block_until_ready(call(rng))
    assert not compiled, f"eager {name} compiled again on the same shapes: {compiled}"


def test_new_shapes_and_params_compile():
    # The listener sees compilations: a shape and a param not used above compile anew.
    rng = np.random.default_rng(0)
    lhs, rhs, sizes = normal(rng, (T + 1, H), jnp.float32), normal(rng, (E, H, F), jnp.float32), _sizes(rng, T + 1)
    with compiled_functions() as compiled:
        jax.block_until_ready(moe_xla.gmm(lhs, rhs, sizes, preferred_element_type=jnp.bfloat16))
    assert "jit(moe_xla_gmm)" in compiled, compiled


def test_calls_under_disable_jit_run_the_kernels(rng):
    lhs, rhs, sizes = normal(rng, (T, H), jnp.float32), normal(rng, (E, H, F), jnp.float32), _sizes(rng, T)
    expected = moe_xla.gmm(lhs, rhs, sizes)
    with jax.disable_jit():
        np.testing.assert_array_equal(moe_xla.gmm(lhs, rhs, sizes), expected)
