"""The EP layer's dispatch with FP8 expert products: the tokens' FP8 rows and their scales
travel instead of the tokens, about half the bytes (H + 4 ceil(H / 128) per row against
2 H in bf16).

Each chunk quantises its tokens once, in token order (quantize_fp8_rows: 1 x 128 row
tiles do not depend on the row order, so a rank receives exactly the FP8 rows that
moe() would quantise from its sorted rows). sent_tokens sends them with the round's
`send` (pack into the send buffer, then the transport) and returns, at the receiving
rank,

    x_hat = dequantize_fp8_rows(q, scales) in x's dtype,   (q, scales)

(q as uint8 bits: the packing and the collectives move it as integers). The expert
products multiply (q, scales); x_hat stands for the rows where the backward needs them:
the weight gradient of the first product is x_hat^T d h (the rows the forward
multiplied; moe() on one device uses x itself, so the two differ by x's quantisation
error, about 2^-5 relative per element), and d x is the straight-through estimate:
x_hat's cotangent sent back through the transpose of `send`, as if x itself had
travelled (send is linear).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_xla.fp8 import dequantize_fp8_rows
from moe_xla.primitives.quantize_fp8_rows import quantize_fp8_rows


def quantized_tokens(x):
    """(q as uint8 bits [T, H], scales [T, ceil(H/128)]): x's FP8 rows, quantised once, with
    no gradient."""
    q, scales = quantize_fp8_rows(jax.lax.stop_gradient(x))
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scales


def sent_tokens(send, arrays, x, q, scales):
    """(x_hat, q, scales) at the receiving rank, from the sender's tokens x [T, H] and their
    quantized_tokens (q, scales); send(rows, arrays) maps [T, ...] rows to the received
    [N, ...] rows, linear in rows, with every array it reads in `arrays` (a pytree of
    integer arrays: a custom_jvp must not close over traced values). See the module
    docstring."""

    @jax.custom_jvp
    def sent(x, q, scales, arrays):
        q_recv, s_recv = send(q, arrays), send(scales, arrays)
        fp8 = jax.lax.bitcast_convert_type(q_recv, jnp.float8_e4m3fn)
        return dequantize_fp8_rows(fp8, s_recv, x.dtype), q_recv, s_recv

    @sent.defjvp
    def sent_jvp(primals, tangents):
        x_hat, q_recv, s_recv = out = sent(*primals)
        dx = send(tangents[0], primals[3])
        return out, (dx, np.zeros(q_recv.shape, jax.dtypes.float0), jnp.zeros_like(s_recv))

    return sent(x, q, scales, arrays)
