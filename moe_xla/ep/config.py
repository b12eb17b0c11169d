"""The EP layer's options, checked, and the static configuration they give (EpConfig)."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
from jax.sharding import AbstractMesh, Mesh

from moe_xla.ep.placement import check_placement

TRANSPORTS = ("auto", "padded", "ragged")


class EpConfig(NamedTuple):
    """The EP layer's static configuration (ep_config), a closure of its shard_map body."""

    axis: str               # the expert axis: every collective runs over it
    token_axes: tuple       # the axes tokens are split over (data axes, then the expert axis)
    peers: int
    experts: int
    top_k: int
    activation: str
    routing: dict           # route() options other than bias
    transport: str          # "padded" or "ragged"
    native_ragged: bool     # the platform has ragged_all_to_all (else the all_to_all stand-in)
    dedup: bool
    capacity_factor: float | None
    chunks: int
    quantization: str | None  # moe_xla.gmm's option for the expert products
    placement: tuple        # redundant experts: placement[p] the experts rank p hosts as replicas (placement.py)


def ep_config(mesh, *, dims, top_k, activation, routing, expert_axis, data_axes, transport, dedup, capacity_factor,
              chunks, quantization=None, redundant_experts=None):
    """(the mesh to shard over, EpConfig) from moe()'s options, or a ValueError naming the
    option that is wrong. dims = (tokens, hidden, experts) as moe() derived them."""
    mesh = _resolve_mesh(mesh, expert_axis)
    names = tuple(mesh.axis_names)
    if expert_axis not in names:
        raise ValueError(f"moe: expected expert_axis to be one of the mesh axes {names}, got {expert_axis!r}")
    if data_axes is None:
        data_axes = tuple(a for a in names if a != expert_axis)
    else:
        data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if expert_axis in data_axes or any(a not in names for a in data_axes) or len(set(data_axes)) < len(data_axes):
        raise ValueError(f"moe: expected distinct data_axes among the mesh axes {names} other than the expert "
                         f"axis {expert_axis!r}, got {data_axes}")
    if transport not in TRANSPORTS:
        raise ValueError(f"moe: expected transport in {TRANSPORTS}, got {transport!r}")
    if capacity_factor is not None and not 0 < capacity_factor < math.inf:
        raise ValueError(f"moe: expected a finite capacity_factor > 0 or None, got {capacity_factor!r}")
    if not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ValueError(f"moe: expected a positive int chunks, got {chunks!r}")
    tokens, _, experts = dims
    peers = mesh.shape[expert_axis]
    if experts % peers:
        raise ValueError(f"moe: expected the {experts} experts (w_in.shape[0]) to split evenly over expert_axis "
                         f"{expert_axis!r} of size {peers}")
    placement = check_placement(redundant_experts, experts, peers)
    token_axes = data_axes + (expert_axis,)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if tokens % shards:
        raise ValueError(f"moe: expected the {tokens} tokens of x to split evenly over the axes {token_axes} "
                         f"({shards} devices)")
    # "auto" is the padded transport: on an H200 XLA's ragged_all_to_all kernel took most
    # of a step's time, even at EP 1 where it only copies rows to itself.
    transport = "padded" if transport == "auto" else transport
    return mesh, EpConfig(expert_axis, token_axes, peers, experts, top_k, activation, routing, transport,
                          _platform(mesh) != "cpu", bool(dedup), capacity_factor,
                          max(1, min(int(chunks), tokens // shards)), quantization, placement)


def _resolve_mesh(mesh, expert_axis):
    """The mesh to shard over: `mesh`, or jax.set_mesh's. An AbstractMesh built from axis
    sizes and names alone (no devices) is replaced by jax.set_mesh's mesh of the same axes,
    which knows its devices; outside jax.set_mesh it is used as it is, under jax.jit with
    arguments placed on its devices."""
    context = jax.sharding.get_abstract_mesh()
    if mesh is None:
        if context.empty:
            raise ValueError(f"moe: expert_axis={expert_axis!r} needs a mesh: pass mesh= or call under "
                             f"jax.set_mesh(mesh)")
        mesh = context
    if expert_axis is None:
        raise ValueError("moe: a mesh needs expert_axis, the mesh axis the experts are split over")
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"moe: expected mesh to be a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}")
    if isinstance(mesh, AbstractMesh) and mesh.abstract_device is None and not context.empty:
        axes = lambda m: (m.axis_names, m.axis_sizes, m.axis_types)  # noqa: E731
        if axes(mesh) != axes(context):
            raise ValueError(f"moe: expected mesh, an AbstractMesh without devices, to have the axes of the "
                             f"jax.set_mesh mesh {context}, got {mesh}")
        mesh = context
    return mesh


def _platform(mesh) -> str:
    """The platform of the mesh's devices; the default backend's for an AbstractMesh without devices."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return jax.default_backend() if mesh.abstract_device is None else mesh.abstract_device.platform
