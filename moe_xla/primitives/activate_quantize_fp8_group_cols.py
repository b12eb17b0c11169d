"""activate_quantize_fp8_group_cols: both FP8 tilings of the expert activation, the FP8
wgrad's operands of the second grouped product's lhs, without a in memory (the contract is
common/fp8_blockwise.h, Fp8GroupColsParams with activated set).

    h [M, 2F] (gate | up; "swiglu", "geglu") or [M, F] ("gelu", "silu", "relu"), float32 /
    bfloat16 / float16, group_sizes [G] int32
      a[m, f] = rnd(g(h[m, f]) * h[m, F + f])   (gated)   or   rnd(g(h[m, f]))
         in float32 (common/expert_activation.h), rnd one rounding to h's dtype: the a
         activate_quantize_fp8 returns
      -> q [M, F] float8_e4m3fn, row_scales [M, ceil(F/128)] float32 = quantize_fp8_rows(a)
         q_t [F, 128 T] float8_e4m3fn, scales [T, F] float32
                         = quantize_fp8_group_cols(a, group_sizes),      T = ceil(M/128) + G
bitwise, on each platform, those of that platform's activate_quantize_fp8 followed by
quantize_fp8_group_cols of its a. The kernels' exp and tanh are their platform's float32
functions, so a may differ from reference.activate_quantize_fp8_group_cols's (the jnp
activation) by a few ulps before rounding.

Where activate_quantize_fp8 writes a for the forward's product and its column tiles would
need a second read of a, this reads h once for both tilings and writes no a. Handlers
MoeXlaActivateQuantizeFp8GroupCols{Cpu,Cuda} in ffi/quantize_fp8_cpu.cc and
ffi/quantize_fp8_group_cols_cuda.cc; kernels cpu/fp8_quantize.cc and cuda/fp8_group_cols.cu
(fp8_quantize_group_cols, activated).

Not differentiable (see _fp8). vmap folds the batch into M (group sizes with a spacer group
per element, the tiles unfolded after, as quantize_fp8_rows_group_cols). It runs on the
whole of h on one device: the column tiles need every row (a sharded h is gathered first).
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding
from moe_xla.primitives._activation import ACTIVATIONS, GATED
from moe_xla.primitives.activate_quantize_fp8 import activation_attributes
from moe_xla.primitives.quantize_fp8_group_cols import unfold_tiles

OP = "activate_quantize_fp8_group_cols"

activate_quantize_fp8_group_cols_p = Primitive("moe_xla_activate_quantize_fp8_group_cols")
activate_quantize_fp8_group_cols_p.multiple_results = True


def activate_quantize_fp8_group_cols(h, group_sizes, activation: str, *, pow2_scale=False):
    """(q [M, F], row_scales [M, ceil(F/128)], q_t [F, 128 T], scales [T, F]) of a = act(h)
    in h's dtype, h [M, 2F] (gated) or [M, F]: quantize_fp8_rows(a) and
    quantize_fp8_group_cols(a, group_sizes), T = ceil(M/128) + G. See the module docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: expected activation in {ACTIVATIONS}, got {activation!r}")
    pow2_scale = _checks.static_bool(OP, "pow2_scale", pow2_scale)
    return tuple(activate_quantize_fp8_group_cols_p.bind(h, group_sizes, activation=activation,
                                                         pow2_scale=pow2_scale))


def _abstract_eval(h, group_sizes, *, activation, pow2_scale):
    _checks.rank(OP, "h", h, 2, "[M, 2F] or [M, F]")
    _checks.float_dtype(OP, "h", h)
    _checks.group_sizes(OP, group_sizes)
    m, c = h.shape
    if activation in GATED and c % 2:
        raise ValueError(f"{OP}: gated activation {activation!r} needs h [M, 2F] (gate | up), got an odd last dim {c}")
    f = c // 2 if activation in GATED else c
    t = _fp8.tiles(m) + group_sizes.shape[0]
    return _fp8.outputs((m, f), (m, _fp8.tiles(f))) + _fp8.outputs((f, _fp8.TILE * t), (t, f))


def _batch(args, dims, *, activation, pow2_scale):
    (h, group_sizes), b = _batching.all_to_front(args, dims)
    _, m, c = h.shape
    folded = _batching.folded_group_sizes(group_sizes, m)  # [B * (G + 1)]: the segments
    q, row_scales, q_t, scales = activate_quantize_fp8_group_cols_p.bind(h.reshape(b * m, c), folded,
                                                                         activation=activation, pow2_scale=pow2_scale)
    f = q.shape[1]
    rows = [q.reshape(b, m, f), row_scales.reshape(b, m, _fp8.tiles(f))]
    return rows + list(unfold_tiles(q_t, scales, folded, b, m)), [0] * 4


def _specs(arg_axes, **_):
    return [tuple(() for _ in a) for a in arg_axes], [((), ())] * 4, ()


# Nothing splits: the column tiles need every row, and the columns of h (gate | up) are not
# those of a; row_scales' F tiles are a factor of their own, as in quantize_fp8_rows_group_cols.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m c, g -> m f, m u, f n, t f", specs=_specs,
                          need_replication=("m", "c", "g", "f", "u", "n", "t"))

_impl.def_jitted_impl(activate_quantize_fp8_group_cols_p)
activate_quantize_fp8_group_cols_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_quantize_fp8_group_cols_p] = _fp8.not_differentiable(OP)
batching.primitive_batchers[activate_quantize_fp8_group_cols_p] = _batch
_lowering.register(activate_quantize_fp8_group_cols_p, OP, activation_attributes, sharding=SHARDING)
