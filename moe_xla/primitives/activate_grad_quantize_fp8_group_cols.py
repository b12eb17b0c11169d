"""activate_grad_quantize_fp8_group_cols: the routing-weighted expert activation's backward
with both FP8 tilings of its d h, the FP8 dgrad's and the FP8 wgrad's operands of the first
grouped product's cotangent, without d h in memory (the contract is common/fp8_blockwise.h,
Fp8GroupColsParams with source kActivationGrad).

    h [M, C] (C = 2F, gate | up: "swiglu", "geglu"; C = F: "gelu", "silu", "relu"), g [M, F],
    both float32 / bfloat16 / float16, omega [M] float32, group_sizes [G] int32
      dh [M, C] in h's dtype: the d h activate_grad_quantize_fp8 returns (the activation's
         derivative at da = omega * g, formed in float32, rounded once)
      -> q [M, C] float8_e4m3fn, row_scales [M, ceil(C/128)] float32 = quantize_fp8_rows(dh)
         q_t [C, 128 T] float8_e4m3fn, scales [T, C] float32
                         = quantize_fp8_group_cols(dh, group_sizes),     T = ceil(M/128) + G
         d_omega_tiles [M, ceil(F/128)] float32: activate_grad_quantize_fp8's, the sums of
                         g * a over 128 columns of F (their sum over tiles is d omega)
q, row_scales, q_t and scales bitwise, on each platform, those of that platform's
activate_grad_quantize_fp8 followed by quantize_fp8_group_cols of its dh; d_omega_tiles
its sums, each in the kernel's own order. The kernels' exp and tanh are their platform's
float32 functions, so dh may differ from reference.activate_grad_quantize_fp8_group_cols's
(jax.vjp of the jnp activation) by a few ulps before rounding.

Where activate_grad_quantize_fp8 writes dh for the bf16 weight gradient and its column
tiles would need a second read of dh, this reads h and g once for both tilings and writes
no dh. Its CUDA kernel is not yet the faster: on an H100 it took 1.9-2.1x the time of
activate_grad_quantize_fp8 followed by quantize_fp8_group_cols (its column-tile kernel
computes each gated element's derivative once for the gate block and again for the up
block, at 2 CTAs per SM; LOG.md, session 48), so moe()'s FP8 layer runs that pair. Handlers MoeXlaActivateGradQuantizeFp8GroupCols{Cpu,Cuda} in ffi/quantize_fp8_cpu.cc
and ffi/quantize_fp8_group_cols_cuda.cc; kernels cpu/fp8_quantize.cc and
cuda/fp8_group_cols.cu (fp8_quantize_group_cols, kActivationGrad).

A primitive of the backward, so not differentiable itself (see _fp8). vmap folds the batch
into M (group sizes with a spacer group per element, the tiles unfolded after, as
quantize_fp8_rows_group_cols). It runs on the whole of h on one device: the column tiles
need every row (sharded operands are gathered first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from moe_xla.primitives import _batching, _checks, _fp8, _impl, _lowering, _sharding
from moe_xla.primitives._activation import ACTIVATIONS, GATED
from moe_xla.primitives.activate_quantize_fp8 import activation_attributes
from moe_xla.primitives.quantize_fp8_group_cols import unfold_tiles

OP = "activate_grad_quantize_fp8_group_cols"

activate_grad_quantize_fp8_group_cols_p = Primitive("moe_xla_activate_grad_quantize_fp8_group_cols")
activate_grad_quantize_fp8_group_cols_p.multiple_results = True


def activate_grad_quantize_fp8_group_cols(h, g, omega, group_sizes, activation: str, *, pow2_scale=False):
    """(q [M, C], row_scales [M, ceil(C/128)], q_t [C, 128 T], scales [T, C], d_omega_tiles
    [M, ceil(F/128)]) of dh, the backward of omega * act(h) at cotangent g, h [M, C] (C = 2F
    gated, else F), g [M, F], omega [M] float32: quantize_fp8_rows(dh),
    quantize_fp8_group_cols(dh, group_sizes) and the tiles of d omega, T = ceil(M/128) + G.
    See the module docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: expected activation in {ACTIVATIONS}, got {activation!r}")
    pow2_scale = _checks.static_bool(OP, "pow2_scale", pow2_scale)
    return tuple(activate_grad_quantize_fp8_group_cols_p.bind(h, g, omega, group_sizes, activation=activation,
                                                              pow2_scale=pow2_scale))


def _abstract_eval(h, g, omega, group_sizes, *, activation, pow2_scale):
    m, c, f = _checks.activation_grad_operands(OP, h, g, omega, activation, activation in GATED)
    _checks.group_sizes(OP, group_sizes)
    t = _fp8.tiles(m) + group_sizes.shape[0]
    d_omega_tiles = jax.core.ShapedArray((m, _fp8.tiles(f)), jnp.float32)
    return _fp8.outputs((m, c), (m, _fp8.tiles(c))) + _fp8.outputs((c, _fp8.TILE * t), (t, c)) + [d_omega_tiles]


def _batch(args, dims, *, activation, pow2_scale):
    (h, g, omega, group_sizes), b = _batching.all_to_front(args, dims)
    _, m, c = h.shape
    folded = _batching.folded_group_sizes(group_sizes, m)  # [B * (G + 1)]: the segments
    q, row_scales, q_t, scales, d_omega_tiles = activate_grad_quantize_fp8_group_cols_p.bind(
        h.reshape(b * m, c), g.reshape(b * m, g.shape[2]), omega.reshape(b * m), folded, activation=activation,
        pow2_scale=pow2_scale)
    rows = [q.reshape(b, m, c), row_scales.reshape(b, m, _fp8.tiles(c))]
    d_omega_tiles = d_omega_tiles.reshape(b, m, d_omega_tiles.shape[1])
    return rows + list(unfold_tiles(q_t, scales, folded, b, m)) + [d_omega_tiles], [0] * 5


def _specs(arg_axes, **_):
    return [tuple(() for _ in a) for a in arg_axes], [((), ())] * 5, ()


# Nothing splits: the column tiles need every row, and each column of d h (gated) needs both
# the gate and the up column of h; the tiles of C and of F are factors of their own.
SHARDING = _sharding.Rule(sharding_rule=lambda **_: "m c, m f, m, g -> m c, m u, c n, t c, m v", specs=_specs,
                          need_replication=("m", "c", "f", "g", "u", "n", "t", "v"))

_impl.def_jitted_impl(activate_grad_quantize_fp8_group_cols_p)
activate_grad_quantize_fp8_group_cols_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[activate_grad_quantize_fp8_group_cols_p] = _fp8.not_differentiable(
    OP, "it is a primitive of the FP8 expert MLP's backward")
batching.primitive_batchers[activate_grad_quantize_fp8_group_cols_p] = _batch
_lowering.register(activate_grad_quantize_fp8_group_cols_p, OP, activation_attributes, sharding=SHARDING)
