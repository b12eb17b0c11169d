"""quantize_fp8_rows: FP8 blockwise quantisation in 1 x 128 row tiles (the contract is
common/fp8_blockwise.h).

    x [M, K] float32 / bfloat16 / float16
      -> q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32
    tile (m, j) = x[m, 128 j : 128 (j + 1)] (the last one partial when 128 does not divide K)
    amax     = max |x| over the tile's finite elements with |x| >= 2^-126 (0 if none)
    scale    = 1 if amax == 0, else max(fl(amax / 448), 2^-126), rounded up to a power of
               two when pow2_scale
    q[m, k]  = e4m3(fl(x[m, k] / scales[m, k // 128])): round to nearest even, saturated to
               +-448 (+-inf too), NaN stays NaN; float32 subnormals quantise to signed zero
    so x[m, k] ~ q[m, k] * scales[m, k // 128].

The activation tiling of the FP8 grouped GEMMs: x along K for the forward, dy along N for
the dgrad. Rows are independent: the op shards along M and vmaps by
folding the batch into M. Bitwise the same on the CPU and CUDA kernels and in
reference.quantize_fp8_rows. Not differentiable (see _fp8).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

quantize_fp8_rows_p = Primitive("moe_xla_quantize_fp8_rows")
quantize_fp8_rows_p.multiple_results = True


def quantize_fp8_rows(x, *, pow2_scale=False):
    """(q, scales) of x [..., K] in 1 x 128 tiles along K: q has x's shape, scales
    [..., ceil(K/128)]. See the module docstring for the rules."""
    pow2_scale = _checks.static_bool("quantize_fp8_rows", "pow2_scale", pow2_scale)
    if jnp.ndim(x) < 2:
        raise ValueError(f"quantize_fp8_rows: expected x of rank >= 2 [..., M, K], got shape {jnp.shape(x)}")
    lead, k = x.shape[:-1], x.shape[-1]
    q, scales = quantize_fp8_rows_p.bind(x.reshape(math.prod(lead), k), pow2_scale=pow2_scale)
    return q.reshape(x.shape), scales.reshape(*lead, scales.shape[-1])


def _abstract_eval(x, *, pow2_scale):
    _checks.rank("quantize_fp8_rows", "x", x, 2, "[M, K]")
    _checks.float_dtype("quantize_fp8_rows", "x", x)
    m, k = x.shape
    return _fp8.outputs(x.shape, (m, _fp8.tiles(k)))


def _batch(args, dims, *, pow2_scale):
    (x,), _ = _batching.batched_to_front(args, dims)
    b, m, k = x.shape
    q, scales = quantize_fp8_rows_p.bind(x.reshape(b * m, k), pow2_scale=pow2_scale)
    return [q.reshape(b, m, k), scales.reshape(b, m, _fp8.tiles(k))], [0, 0]


def _specs(arg_axes, **_):
    m = arg_axes[0][0]
    return ([(m, ())], [(m, ()), (m, ())], ())


# Rows are independent: split along M; K (and its tiles) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m k -> m k, m t", specs=_specs, need_replication=("k", "t"))

_impl.def_jitted_impl(quantize_fp8_rows_p)
quantize_fp8_rows_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[quantize_fp8_rows_p] = _fp8.not_differentiable("quantize_fp8_rows")
batching.primitive_batchers[quantize_fp8_rows_p] = _batch
_lowering.register(quantize_fp8_rows_p, "quantize_fp8_rows", _fp8.attributes, sharding=SHARDING)
