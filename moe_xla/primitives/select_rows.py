"""select_rows: rows of an array picked by a static per-rank table, with a transpose that adds
each row's places in a fixed order (the EP layer's replica weights, ep/replicas.py).

    out[i] = x[table[rank, i]]        out [I, ...]; an entry outside [0, N) gives a zero row

The transpose XLA would derive for x[table[rank]] is a scatter-add, whose atomics on a GPU
add a row's places in a different order from run to run. Here it is a gather and a chain
of adds in ascending place order, d x[e] = ((ct[i_1] + ct[i_2]) + ...) + ct[i_n]: bitwise
the same in every run.

The primitive rows_p(x, index [I, C], inverse [N, C']) computes out[i] = (x[index[i, 0]] +
x[index[i, 1]]) + ... left to right, an index outside [0, N) adding nothing (jnp.take with
mode="fill"). inverse lists, for each row of x, the places that name it (i appears in
inverse[e] as often as e in index[i]), so the transpose is rows_p with the two swapped:
select_rows' transpose, and that one's the selection again. A primitive, linear with its
own transpose, keeps what the layer does under jax.jvp, jax.vmap and second order (a
custom_vjp has no forward mode, linear_call no batching rule). Lowered through jnp on
every platform.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

rows_p = Primitive("moe_xla_select_rows")


def select_rows(x, table: np.ndarray, rank):
    """[I, ...]: out[i] = x[table[rank, i]], a copy of rows; a place whose entry is outside
    [0, N) (N = x.shape[0]) is a zero row. table [R, I] is static (numpy), rank traced.

    Linear in x; its transpose gathers each row's places and adds them in ascending place
    order, a gather and a fixed-order sum where XLA would transpose x[table] to a scatter-add:
        d x[e] = ((ct[i_1] + ct[i_2]) + ...) + ct[i_n],  i_1 < ... < i_n the places i with
                 table[rank, i] == e (none: +0; places outside [0, N) add nothing)
    """
    return rows_p.bind(x, jnp.asarray(table)[rank][:, None], jnp.asarray(_inverse(table, x.shape[0]))[rank])


def _inverse(table: np.ndarray, rows: int) -> np.ndarray:
    """[R, rows, C] int32: [r, e] the places i with table[r, i] == e in ascending order, then
    table.shape[1] (no place) up to C, the largest count (at least 1)."""
    places = [[np.flatnonzero(t == e) for e in range(rows)] for t in table]
    width = max([1] + [len(i) for row in places for i in row])
    inverse = np.full((len(table), rows, width), table.shape[1], np.int32)
    for r, row in enumerate(places):
        for e, i in enumerate(row):
            inverse[r, e, :len(i)] = i
    return inverse


def _impl(x, index, inverse):
    del inverse
    out = jnp.take(x, index[:, 0], axis=0, mode="fill", fill_value=0)
    for c in range(1, index.shape[1]):
        out = out + jnp.take(x, index[:, c], axis=0, mode="fill", fill_value=0)
    return out


def _transpose(ct, x, index, inverse):
    if type(ct) is ad.Zero:
        return ad.Zero(x.aval), None, None
    return rows_p.bind(ct, inverse, index), None, None


def _batch(args, dims):
    (x, index, inverse), (dim, index_dim, inverse_dim) = args, dims
    if index_dim is not None or inverse_dim is not None:
        raise NotImplementedError(f"select_rows: expected an unbatched table (one per rank), got batch axes "
                                  f"{index_dim} of index, {inverse_dim} of inverse")
    return rows_p.bind(jnp.moveaxis(x, dim, 1), index, inverse), 1


rows_p.def_impl(_impl)
rows_p.def_abstract_eval(lambda x, index, inverse: x.update(shape=index.shape[:1] + x.shape[1:]))
ad.defjvp(rows_p, lambda dx, x, index, inverse: rows_p.bind(dx, index, inverse), None, None)
ad.primitive_transposes[rows_p] = _transpose
batching.primitive_batchers[rows_p] = _batch
mlir.register_lowering(rows_p, mlir.lower_fun(_impl, multiple_results=False))
