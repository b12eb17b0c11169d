"""Autodiff helpers shared by the primitives' JVP rules."""

from __future__ import annotations

import jax
from jax.interpreters import ad


def zero_tangent(primal_out):
    """The symbolic zero tangent of a primal output (float0 for integer outputs)."""
    return ad.Zero(jax.typeof(primal_out).to_tangent_aval())


def bilinear_jvp(prim, a: int, b: int):
    """The JVP rule of a primitive bilinear in operands a and b (the others held fixed):
    d out = prim(..., da, ..., b, ...) + prim(..., a, ..., db, ...)."""

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        terms = []
        for i in (a, b):
            if type(tangents[i]) is not ad.Zero:
                args = list(primals)
                args[i] = tangents[i]
                terms.append(prim.bind(*args, **params))
        if not terms:
            return out, zero_tangent(out)
        return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]

    return jvp
