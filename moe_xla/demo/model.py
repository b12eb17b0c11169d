"""The demo's model: a decoder-only transformer in Flax NNX whose feed-forward layers are
moe_xla.nnx.MoE.

    tokens [B, S] -> embed [V, H]
    L x (nnx.scan over Blocks stacked with nnx.vmap):
        x += attention(rms_norm(x))     causal, rotary positions, `heads` heads
        x += moe(rms_norm(x))           moe_xla.nnx.MoE(H, F, E, top_k, **moe): router [H, E]
                                        (float32), w_in [E, H, 2F], w_out [E, F, H]
    rms_norm -> logits = x @ embed^T    (tied output head)

Parameters are float32; `dtype` is the computation dtype. Every kernel starts as a normal
of std 0.02.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moe_xla.nnx import MoE

INIT = nnx.initializers.normal(0.02)


class Config(NamedTuple):
    """The model's shape; `moe` holds the keywords passed to every moe_xla.nnx.MoE
    (activation, routing, quantisation, ...)."""

    vocab: int
    hidden: int
    heads: int
    layers: int
    experts: int
    top_k: int
    ffn: int
    dtype: str
    moe: dict


def rotary(x):
    """Rotary position embedding of x [B, S, heads, head_dim] (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary positions: x [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.qkv = nnx.Linear(cfg.hidden, 3 * cfg.hidden, use_bias=False, kernel_init=INIT, dtype=cfg.dtype,
                              rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, cfg.hidden, use_bias=False, kernel_init=INIT, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x):
        b, s, h = x.shape
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads) for t in jnp.split(self.qkv(x), 3, axis=-1))
        out = jax.nn.dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.out(out.reshape(b, s, h))


class Block(nnx.Module):
    """One transformer layer: x += attention(rms_norm(x)); x += moe(rms_norm(x))."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.hidden, dtype=cfg.dtype, rngs=rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(cfg.hidden, dtype=cfg.dtype, rngs=rngs)
        self.moe = MoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, rngs=rngs, dtype=cfg.dtype, router_init=INIT,
                       kernel_init=INIT, **cfg.moe)

    def __call__(self, x):
        x = x + self.attention(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class LanguageModel(nnx.Module):
    """tokens [B, S] int32 -> (logits [B, S, V] float32, MoeAux of every layer stacked on a leading [L] axis)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, embedding_init=INIT, dtype=cfg.dtype, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = nnx.RMSNorm(cfg.hidden, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def run_blocks(x, block):
            x, sown = nnx.capture(block, nnx.Intermediate)(x)
            return x, sown["moe"]["moe_aux"].get_value()[0]

        x, aux = run_blocks(self.embed(tokens), self.blocks)
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32), aux


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt, key, *, seq: int, n_new: int,
             temperature: float):
    """prompt [P] int32 followed by n_new tokens drawn from the model nnx.merge(graphdef,
    params) (at `temperature`, or greedy at 0), which sees the last `seq` tokens; [P + n_new] int32."""
    size = max(prompt.shape[0] + n_new, seq)
    buf = jnp.zeros((size,), jnp.int32).at[: prompt.shape[0]].set(prompt)

    def body(i, carry):  # params ride in the carry: nnx.scan takes no variables from an outer trace
        buf, key, params = carry
        pos = prompt.shape[0] - 1 + i  # the last known token
        start = jnp.maximum(0, pos + 1 - seq)
        window = jax.lax.dynamic_slice(buf, (start,), (seq,))
        logits = nnx.merge(graphdef, params)(window[None])[0][0, pos - start]
        key, sub = jax.random.split(key)
        nxt = jax.random.categorical(sub, logits / temperature) if temperature > 0 else jnp.argmax(logits)
        return buf.at[pos + 1].set(nxt.astype(jnp.int32)), key, params

    buf, _, _ = jax.lax.fori_loop(0, n_new, body, (buf, key, params))
    return buf[: prompt.shape[0] + n_new]
