"""Eager evaluation of the moe_xla primitives: one jitted bind per (primitive, params).

jax.jit keeps its compiled programs per function object and argument shapes, so
reusing one jitted function per (primitive, params) compiles an eager call once per
shapes and params; a fresh jax.jit per call would compile on every call.
"""

from __future__ import annotations

import functools

import jax


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params: tuple):
    kwargs = dict(params)

    def bind(*args):
        return prim.bind(*args, **kwargs)

    bind.__name__ = bind.__qualname__ = prim.name  # what profiles and compile logs show
    return jax.jit(bind)


def def_jitted_impl(prim) -> None:
    """Makes `prim`'s eager evaluation run its lowering through one cached jitted bind."""

    def impl(*args, **params):
        # Under jax.disable_jit the jitted bind would call this impl again, without end.
        with jax.disable_jit(False):
            return _jitted_bind(prim, tuple(sorted(params.items())))(*args)

    prim.def_impl(impl)
