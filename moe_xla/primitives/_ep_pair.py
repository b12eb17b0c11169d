"""The EP layer's pair of row primitives, ep_expand and ep_gather_sum, each the other's
transpose: both Primitive objects are declared here so that ep_expand.py and
ep_gather_sum.py, which register their rules, bind each other without importing each
other; the rules the two share sit beside them."""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad

from moe_xla.primitives import _ad
from moe_xla.primitives._batching import folded_rows

expand_p = Primitive("moe_xla_ep_expand")
gather_sum_p = Primitive("moe_xla_ep_gather_sum")


def register_bilinear_rules(prim, data_transpose, weights_transpose):
    """JVP and transpose of prim(data, slots, weights), linear in data and in weights:
    data_transpose(ct, slots, weights, data_aval) and weights_transpose(ct, data, slots)."""

    def transpose(ct, data, slots, weights, **params):
        if ad.is_undefined_primal(data):
            d = ad.Zero(data.aval) if type(ct) is ad.Zero else data_transpose(ct, slots, weights, data.aval)
            return d, None, None
        d = ad.Zero(weights.aval) if type(ct) is ad.Zero else weights_transpose(ct, data, slots)
        return None, None, d

    ad.primitive_jvps[prim] = _ad.bilinear_jvp(prim, 0, 2)
    ad.primitive_transposes[prim] = transpose


def folded_slots(slots, per_batch: int):
    """[B, N, mult] slots into B blocks of per_batch rows -> [B N, mult] slots into the stack."""
    return folded_rows(slots, per_batch).reshape(slots.shape[0] * slots.shape[1], slots.shape[2])
