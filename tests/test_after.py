"""primitives/after: x once dep is computed, an ordering edge that moves no data: its value,
the alias of its call, its derivative and vmap, and the ordering XLA keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_xla.primitives.after import after


def test_value_derivative_and_vmap():
    x, dep = jnp.arange(12.0).reshape(3, 4), jnp.ones((2, 5))
    np.testing.assert_array_equal(np.asarray(jax.jit(after)(x * 2, dep)), np.asarray(x * 2))
    grad = jax.jit(jax.grad(lambda x, d: jnp.sum(after(x * x, d * d)), argnums=(0, 1)))(x, dep)
    np.testing.assert_array_equal(np.asarray(grad[0]), np.asarray(2 * x))
    np.testing.assert_array_equal(np.asarray(grad[1]), np.zeros_like(dep))  # dep gets no cotangent
    _, tangent = jax.jvp(lambda x, d: after(x, d), (x, dep), (x + 1, dep))
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(x + 1))
    batched = jax.vmap(after, in_axes=(1, None), out_axes=1)(x, dep)
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(x))


def test_the_call_aliases_x_and_waits_for_dep():
    """One custom call whose result is x's buffer and whose second operand is dep's
    producer, so that x's consumers run after it."""
    x, d = jnp.ones((8, 8)), jnp.ones((4, 4))
    f = jax.jit(lambda x, d: after(x + 1, d @ d) * 3)
    assert "output_operand_aliases" in f.lower(x, d).as_text()
    hlo = f.lower(x, d).compile().as_text().split("ENTRY")[1]
    call = next(line for line in hlo.splitlines() if "custom_call_target=\"moe_xla_after_cpu_v1\"" in line)
    assert "output_to_operand_aliasing={{}: (0, {})}" in call
    assert "dot" in call.split("custom-call(")[1].split(")")[0]  # dep's producer is its operand
    np.testing.assert_array_equal(np.asarray(f(x, d)), np.full((8, 8), 6.0))
