"""Inputs and a lowering probe shared by the gather product tests (test_gather_gmm.py,
test_gather_tgmm.py): row sources with out-of-range entries, named group-size cases, the
parametrized shape cases and the custom-call targets of a CUDA lowering."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import group_sizes_cases


def src_with_bad_rows(rng, t: int, m: int, outside):
    """Row sources with every kind of entry: tokens, repeats and, in about one row in ten,
    a value drawn from `outside` (out of range of the T tokens)."""
    src = rng.integers(0, max(t, 1), size=m)
    bad = rng.choice(m, size=max(1, m // 10), replace=False)
    src[bad] = rng.choice(outside, size=bad.size)
    return jnp.asarray(src, jnp.int32)


def group_sizes(rng, m: int, g: int, name: str):
    """The group sizes of case `name`: one of conftest.group_sizes_cases, or "sum_above_m"
    (clamped to the M rows: the last groups lose rows) or "extremes" (negative and
    INT32-extreme sizes, clamped)."""
    if name == "sum_above_m":
        return jnp.asarray(group_sizes_cases(m, g, rng)["random"] + m // g + 1, jnp.int32)
    if name == "extremes":
        sizes = np.resize(np.array([-5, 2**31 - 1, -(2**31), 3, m // 2], np.int64), g)
        return jnp.asarray(sizes, jnp.int32)
    return jnp.asarray(group_sizes_cases(m, g, rng)[name])


def cases(shapes, dtypes, size_names):
    """pytest params (t, m, k, n, g, dtype, sizes) of every shape, dtype and size case."""
    for (t, m, k, n, g), dtype in itertools.product(shapes, dtypes):
        for sizes in size_names:
            yield pytest.param(t, m, k, n, g, dtype, sizes, id=f"{t}-{m}x{k}x{n}g{g}-{jnp.dtype(dtype).name}-{sizes}")


def cuda_targets(fn, *args) -> list[str]:
    """The moe_xla custom-call targets of fn lowered for CUDA (on any machine)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"custom_call @(moe_xla_\w+)", text)
