"""quantize_fp8_weight_layouts: FP8 blockwise quantisation of expert weights in 128 x 128
blocks, written in both layouts the FP8 products read, in one pass (the contract is
common/fp8_blockwise.h, Fp8QuantizeParams with q_t).

    w [G, K, N] float32 / bfloat16 / float16
      -> q [G, K, N] float8_e4m3fn, q_t [G, N, K] float8_e4m3fn,
         scales [G, ceil(K/128), ceil(N/128)] float32
    (q, scales) = quantize_fp8_blocks(w), bitwise
    q_t[g, n, k] = q[g, k, n]   (q with its last two axes swapped, code for code)

The forward's product reads q_t (each expert's matrix transposed, K contiguous), the
dgrad's reads q; moe_xla.fp8.quantize_fp8_weights builds its Fp8Weights from the three.
Where quantize_fp8_blocks followed by XLA's transpose reads q once more to write q_t, the
kernel writes each block's codes to both places as it makes them. FFI op
quantize_fp8_weights: handlers MoeXlaQuantizeFp8Weights{Cpu,Cuda} in
ffi/quantize_fp8_{cpu,cuda}.cc, targets moe_xla_quantize_fp8_weights_{cpu,cuda}_v1; kernels
cpu::fp8_quantize and cuda::fp8_quantize with p.q_t set.

Groups are independent: the op shards along G and vmaps by folding the batch into G.
Bitwise the same on the CPU and CUDA kernels and in reference.quantize_fp8_weight_layouts.
Not differentiable (see _fp8).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding

quantize_fp8_weight_layouts_p = Primitive("moe_xla_quantize_fp8_weight_layouts")
quantize_fp8_weight_layouts_p.multiple_results = True


def quantize_fp8_weight_layouts(w, *, pow2_scale=False):
    """(q, q_t, scales) of w [..., K, N] in 128 x 128 blocks: q has w's shape, q_t
    [..., N, K] is q with its last two axes swapped, scales [..., ceil(K/128), ceil(N/128)].
    See the module docstring for the rules."""
    pow2_scale = _checks.static_bool("quantize_fp8_weight_layouts", "pow2_scale", pow2_scale)
    if jnp.ndim(w) < 2:
        raise ValueError(f"quantize_fp8_weight_layouts: expected w of rank >= 2 [..., K, N], got shape {jnp.shape(w)}")
    lead, (k, n) = w.shape[:-2], w.shape[-2:]
    q, q_t, scales = quantize_fp8_weight_layouts_p.bind(w.reshape(math.prod(lead), k, n), pow2_scale=pow2_scale)
    return q.reshape(w.shape), q_t.reshape(*lead, n, k), scales.reshape(*lead, *scales.shape[-2:])


def _abstract_eval(w, *, pow2_scale):
    _checks.rank("quantize_fp8_weight_layouts", "w", w, 3, "[G, K, N]")
    _checks.float_dtype("quantize_fp8_weight_layouts", "w", w)
    g, k, n = w.shape
    q, scales = _fp8.outputs(w.shape, (g, _fp8.tiles(k), _fp8.tiles(n)))
    return [q, jax.core.ShapedArray((g, n, k), _fp8.FP8_DTYPE), scales]


def _batch(args, dims, *, pow2_scale):
    (w,), _ = _batching.batched_to_front(args, dims)
    b, g, k, n = w.shape
    q, q_t, scales = quantize_fp8_weight_layouts_p.bind(w.reshape(b * g, k, n), pow2_scale=pow2_scale)
    return [q.reshape(w.shape), q_t.reshape(b, g, n, k), scales.reshape(b, g, *scales.shape[1:])], [0, 0, 0]


def _specs(arg_axes, **_):
    g = arg_axes[0][0]
    return ([(g, (), ())], [(g, (), ())] * 3, ())


# Groups are independent: split along G; the blocks of one group (both layouts) stay whole.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "g k n -> g k n, g n k, g i j", specs=_specs,
                          need_replication=("k", "n", "i", "j"))

_impl.def_jitted_impl(quantize_fp8_weight_layouts_p)
quantize_fp8_weight_layouts_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[quantize_fp8_weight_layouts_p] = _fp8.not_differentiable("quantize_fp8_weight_layouts")
batching.primitive_batchers[quantize_fp8_weight_layouts_p] = _batch
_lowering.register(quantize_fp8_weight_layouts_p, "quantize_fp8_weights", _fp8.attributes, sharding=SHARDING)
