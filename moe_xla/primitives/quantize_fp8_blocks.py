"""quantize_fp8_blocks: FP8 blockwise quantisation of weights in 128 x 128 blocks (the
contract is common/fp8_blockwise.h).

    w [G, K, N] float32 / bfloat16 / float16
      -> q [G, K, N] float8_e4m3fn, scales [G, ceil(K/128), ceil(N/128)] float32
    block (g, i, j) = w[g, 128 i : 128 (i + 1), 128 j : 128 (j + 1)] (partial at the K and
               N tails)
    amax, scale and q per block as for quantize_fp8_rows (1 x 128 tiles there), so
    w[g, k, n] ~ q[g, k, n] * scales[g, k // 128, n // 128].

The weight tiling of the FP8 grouped GEMMs: the forward uses (q, scales); the dgrad uses
the same blocks transposed, q[g].T with scales[g].T, so weights are quantised once (issue
15, item 3). Groups are independent: the op shards along G and vmaps by folding the batch
into G. Bitwise the same on the CPU and CUDA kernels and in
reference.quantize_fp8_blocks. Not differentiable (see _fp8).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

quantize_fp8_blocks_p = Primitive("moe_xla_quantize_fp8_blocks")
quantize_fp8_blocks_p.multiple_results = True


def quantize_fp8_blocks(w, *, pow2_scale=False):
    """(q, scales) of w [..., K, N] in 128 x 128 blocks: q has w's shape, scales
    [..., ceil(K/128), ceil(N/128)]. See the module docstring for the rules."""
    pow2_scale = _checks.static_bool("quantize_fp8_blocks", "pow2_scale", pow2_scale)
    if jnp.ndim(w) < 2:
        raise ValueError(f"quantize_fp8_blocks: expected w of rank >= 2 [..., K, N], got shape {jnp.shape(w)}")
    lead, (k, n) = w.shape[:-2], w.shape[-2:]
    q, scales = quantize_fp8_blocks_p.bind(w.reshape(math.prod(lead), k, n), pow2_scale=pow2_scale)
    return q.reshape(w.shape), scales.reshape(*lead, *scales.shape[-2:])


def _abstract_eval(w, *, pow2_scale):
    _checks.rank("quantize_fp8_blocks", "w", w, 3, "[G, K, N]")
    _checks.float_dtype("quantize_fp8_blocks", "w", w)
    g, k, n = w.shape
    return _fp8.outputs(w.shape, (g, _fp8.tiles(k), _fp8.tiles(n)))


def _batch(args, dims, *, pow2_scale):
    (w,), _ = _batching.batched_to_front(args, dims)
    b, g, k, n = w.shape
    q, scales = quantize_fp8_blocks_p.bind(w.reshape(b * g, k, n), pow2_scale=pow2_scale)
    return [q.reshape(w.shape), scales.reshape(b, g, *scales.shape[1:])], [0, 0]


def _specs(arg_axes, **_):
    g = arg_axes[0][0]
    return ([(g, (), ())], [(g, (), ()), (g, (), ())], ())


# Groups are independent: split along G; the blocks of one group stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "g k n -> g k n, g i j", specs=_specs,
                          need_replication=("k", "n", "i", "j"))

_impl.def_jitted_impl(quantize_fp8_blocks_p)
quantize_fp8_blocks_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[quantize_fp8_blocks_p] = _fp8.not_differentiable("quantize_fp8_blocks")
batching.primitive_batchers[quantize_fp8_blocks_p] = _batch
_lowering.register(quantize_fp8_blocks_p, "quantize_fp8_blocks", _fp8.attributes, sharding=SHARDING)
