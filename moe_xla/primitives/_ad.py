"""Autodiff helpers shared by the primitives' JVP rules."""

from __future__ import annotations

import jax
from jax.interpreters import ad


def zero_tangent(primal_out):
    """The symbolic zero tangent of a primal output (float0 for integer outputs)."""
    return ad.Zero(jax.typeof(primal_out).to_tangent_aval())
