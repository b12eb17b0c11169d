"""Trace-time argument checks with messages that name the argument, expected and actual."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def rank(op: str, name: str, x, expected: int, layout: str) -> None:
    if len(x.shape) != expected:
        raise ValueError(f"{op}: expected {name} of rank {expected} {layout}, got shape {tuple(x.shape)}")


def float_dtype(op: str, name: str, x) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: expected {name} of dtype {_names(FLOAT_DTYPES)}, got {x.dtype}")


def same_dtype(op: str, a_name: str, a, b_name: str, b) -> None:
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        raise TypeError(f"{op}: expected {b_name} of the dtype of {a_name} ({a.dtype}), got {b.dtype}")


def int32(op: str, name: str, x) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{op}: expected int32 {name}, got {x.dtype}")


def int_at_least(op: str, name: str, value, least: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise ValueError(f"{op}: expected an int {name} >= {least}, got {value!r}")


def dim(op: str, what: str, expected: int, actual: int) -> None:
    if expected != actual:
        raise ValueError(f"{op}: expected {what} = {expected}, got {actual}")


def group_sizes(op: str, gs, num_groups: int | None = None) -> None:
    if len(gs.shape) != 1:
        raise ValueError(f"{op}: expected group_sizes of rank 1 [G], got shape {tuple(gs.shape)}")
    if jnp.dtype(gs.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{op}: expected int32 group_sizes, got {gs.dtype}")
    if num_groups is not None and gs.shape[0] != num_groups:
        raise ValueError(f"{op}: expected group_sizes of shape ({num_groups},) (one per group), "
                         f"got {tuple(gs.shape)}")


def gather_inputs(op: str, x, src, other_name: str, other, other_rank: int, other_layout: str) -> None:
    """The checks the gather products share: x [T, K] and src [M] by rank, `other` (w or dy)
    by rank and layout, x of a float dtype that `other` shares, and src int32."""
    rank(op, "x", x, 2, "[T, K]")
    rank(op, "src", src, 1, "[M]")
    rank(op, other_name, other, other_rank, other_layout)
    float_dtype(op, "x", x)
    same_dtype(op, "x", x, other_name, other)
    if jnp.dtype(src.dtype) != jnp.int32:
        raise TypeError(f"{op}: expected int32 src, got {src.dtype}")


def out_dtype(op: str, preferred_element_type, default):
    """The output dtype: preferred_element_type if given (a float dtype), else `default`."""
    if preferred_element_type is None:
        return jnp.dtype(default)
    dt = jnp.dtype(preferred_element_type)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{op}: expected preferred_element_type of {_names(FLOAT_DTYPES)} or None, got {dt}")
    return dt


def positive_int(op: str, name: str, value) -> int:
    """value as an int, or a TypeError (not an int) / ValueError (below 1) naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: expected {name} to be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{op}: expected {name} to be an int >= 1, got {value!r}")
    return int(value)


def static_bool(op: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: expected {name} to be a Python bool, got {value!r}")
    return bool(value)


def activation_grad_operands(op: str, h, g, omega, activation: str, gated: bool) -> tuple[int, int, int]:
    """(M, C, F) of an activation's backward operands h [M, C] (C = 2F gated, gate | up; else
    F), g [M, F] of h's float dtype and omega [M] float32, each checked."""
    rank(op, "h", h, 2, "[M, 2F] or [M, F]")
    rank(op, "g", g, 2, "[M, F]")
    rank(op, "omega", omega, 1, "[M]")
    float_dtype(op, "h", h)
    same_dtype(op, "h", h, "g", g)
    if jnp.dtype(omega.dtype) != jnp.float32:
        raise TypeError(f"{op}: expected float32 omega, got {omega.dtype}")
    m, c = h.shape
    if gated and c % 2:
        raise ValueError(f"{op}: gated activation {activation!r} needs h [M, 2F] (gate | up), got an odd last dim {c}")
    f = c // 2 if gated else c
    if tuple(g.shape) != (m, f):
        raise ValueError(f"{op}: expected g of shape {(m, f)} ([M, F] for h {tuple(h.shape)}), got {tuple(g.shape)}")
    if tuple(omega.shape) != (m,):
        raise ValueError(f"{op}: expected omega of shape ({m},) (M of h), got {tuple(omega.shape)}")
    return m, c, f
