"""The ragged transport's stand-in packing (moe_xla/ep/transports._slabs): slab d of P*block rows holds
the grouped rows [starts[d], starts[d] + sizes[d]), then the fill. Its values and
gradients against a plain gather, and that its transpose in the rows is no scatter-add
over [rows, H] in a forward + backward EP step (the dispatch's backward on the H200 spent
0.35 ms of a qwen3-30b-a3b step in such a scatter-add; benchmarks/results/LOG.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_8_devices
from jax.sharding import Mesh

import moe_xla
from moe_xla.ep.transports import _slabs

STARTS = np.array([0, 5, 5, 9], np.int32)   # disjoint ranges, one empty, one cut at the block
SIZES = np.array([5, 0, 4, 3], np.int32)
BLOCK, N, H = 4, 12, 3


def _gathered(rows, fill):
    out = np.full((len(STARTS) * BLOCK,) + rows.shape[1:], fill, rows.dtype)
    for d, (s, n) in enumerate(zip(STARTS, SIZES)):
        n = min(n, BLOCK)
        out[d * BLOCK:d * BLOCK + n] = rows[s:s + n]
    return out


@pytest.mark.parametrize("dtype, fill", [(jnp.float32, 0), (jnp.bfloat16, 0), (jnp.int32, 7), (jnp.float32, 2.0)])
def test_slabs_hold_the_rows_then_the_fill(rng, dtype, fill):
    rows = np.asarray(rng.standard_normal((N, H)) * 10, np.float32).astype(dtype)
    out = jax.jit(lambda r: _slabs(r, jnp.asarray(STARTS), jnp.asarray(SIZES), BLOCK, fill))(rows)
    np.testing.assert_array_equal(np.asarray(out), _gathered(np.asarray(rows), fill))


def test_slabs_gradient_and_forward_mode_are_the_gathers(rng):
    rows = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((len(STARTS) * BLOCK, H)), jnp.float32)
    slabs = lambda r: _slabs(r, jnp.asarray(STARTS), jnp.asarray(SIZES), BLOCK, 0)  # noqa: E731
    want = np.zeros((N, H), np.float32)
    for d, (s, n) in enumerate(zip(STARTS, SIZES)):
        n = min(n, BLOCK)
        want[s:s + n] += np.asarray(ct)[d * BLOCK:d * BLOCK + n]
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda r: jnp.sum(slabs(r) * ct))(rows)), want)
    tangent = jax.jvp(slabs, (rows,), (ct[:N],))[1]
    np.testing.assert_array_equal(np.asarray(tangent), _gathered(np.asarray(ct[:N]), 0))


def _scatter_adds(jaxpr, found):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add":
            found.append(eqn.outvars[0].aval)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _scatter_adds(inner, found)
    return found


@requires_8_devices
@pytest.mark.parametrize("transport", ["padded", "ragged"])
def test_ep_step_has_no_scatter_add_over_rows(rng, transport):
    t, h, f, e, k = 64, 48, 16, 16, 3
    args = (jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((t, e)), jnp.float32),
            jnp.asarray(rng.standard_normal((e, h, 2 * f)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((e, f, h)), jnp.bfloat16))
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))

    def loss(*a):
        y = moe_xla.moe(*a, top_k=k, mesh=mesh, expert_axis="ep", transport=transport)
        return jnp.sum(y.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 2, 3)))(*args).jaxpr
    over_rows = [aval for aval in _scatter_adds(jaxpr, []) if aval.ndim == 2 and aval.shape[-1] == h]
    assert not over_rows, f"scatter-adds over rows of H = {h}: {over_rows}"
