"""moe()'s mesh argument as a jax.sharding.AbstractMesh, on 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_xla
from conftest import assert_close, normal, requires_8_devices

pytestmark = requires_8_devices

T, H, F, E = 64, 16, 8, 8


def _meshes():
    """A 1-D mesh of Auto axes and a 2-D one of Explicit axes (jax.make_mesh's default)."""
    return {"auto": Mesh(np.array(jax.devices()[:4]), ("ep",)),
            "explicit": jax.make_mesh((2, 4), ("data", "ep"), devices=jax.devices())}


def _bare(mesh):
    """The AbstractMesh of mesh's axes alone: no devices."""
    return AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types)


def _args(rng):
    return (normal(rng, (T, H), jnp.float32), normal(rng, (T, E), jnp.float32),
            normal(rng, (E, H, 2 * F), jnp.float32) / np.sqrt(H), normal(rng, (E, F, H), jnp.float32) / np.sqrt(F))


def _ep(mesh):
    return jax.jit(lambda *a: moe_xla.moe(*a, top_k=2, mesh=mesh, expert_axis="ep"))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_abstract_mesh_with_arguments_on_its_devices(rng, kind):
    mesh = _meshes()[kind]
    args = _args(rng)
    one = jax.jit(lambda *a: moe_xla.moe(*a, top_k=2))(*args)
    placed = jax.device_put(args, NamedSharding(mesh, P()))
    for abstract in (mesh.abstract_mesh, _bare(mesh)):
        assert_close(_ep(abstract)(*placed), one, jnp.float32)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_abstract_mesh_without_devices_under_set_mesh(rng, kind):
    mesh = _meshes()[kind]
    args = _args(rng)
    with jax.set_mesh(mesh):
        y = _ep(_bare(mesh))(*args)
    assert_close(y, jax.jit(lambda *a: moe_xla.moe(*a, top_k=2))(*args), jnp.float32)


def test_abstract_mesh_of_other_axes_than_set_mesh(rng):
    with jax.set_mesh(_meshes()["auto"]), pytest.raises(ValueError, match=r"expected mesh, an AbstractMesh"):
        _ep(AbstractMesh((2, 4), ("data", "ep")))(*_args(rng))


def test_mesh_that_is_no_mesh(rng):
    with pytest.raises(ValueError, match=r"expected mesh to be a jax.sharding.Mesh or AbstractMesh, got tuple"):
        moe_xla.moe(*_args(rng), top_k=2, mesh=(2, 4), expert_axis="ep")
