"""Train a small Mixture-of-Experts language model with moe_xla: `python3 -m moe_xla.demo`.

The data is a character-level corpus that this module writes itself (no download):
sentences from a small grammar ("the robot paints a red kite near the river."),
additions ("7 plus 5 is 12.") and counting runs ("count 4 5 6 7."), about 260k
characters with a fixed seed. The model learns spelling, word order and the sentence
templates, so the loss falls from about 3.7 to about 0.4 in the default 400 steps.

The model is a decoder-only transformer in plain JAX:

    tokens [B, S] -> embedding [V, H]
    L x (scanned over stacked layer weights with jax.lax.scan):
        x += attention(rms_norm(x))         causal, rotary positions, --heads heads
        x += moe(rms_norm(x))               router [H, E] (kept in float32) ->
                                            moe_xla.moe(x, logits, w_in [E, H, 2F], w_out [E, F, H],
                                                        top_k, activation="swiglu")
    rms_norm -> logits = x @ embedding^T    (tied output head)

    loss = cross_entropy + 0.01 * load_balance_loss + 0.001 * z_loss
           (the two router losses from moe()'s MoeAux, averaged over layers)

One training step (batch sampling from the corpus on the device, value_and_grad, global
norm clipping, Adam with warmup and cosine decay) is a single jitted function, compiled
ahead of time; its optimised HLO goes to <out>/train_step_hlo.txt and the moe_xla custom
calls in it (moe_xla_<op>_<platform>_v1) are listed. At the end the demo prints the
per-expert load of the last step and a text sample drawn from the model.

The defaults run in under a minute on a 2-core CPU; scale up on a GPU, e.g.
`python3 -m moe_xla.demo --steps 2000 --batch 64 --seq 256 --hidden 512 --heads 8
--experts 64 --top-k 4 --layers 8 --dtype bfloat16`.
The exit status is 1 when the final loss is not below the first one.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import moe_xla
from moe_xla.inspect import inspect_hlo

LOAD_BALANCE_COEF = 0.01
Z_LOSS_COEF = 0.001
CORPUS_CHARS = 1 << 18
CORPUS_SEED = 0
SAMPLE_PROMPT = "the "

# ---------------------------------------------------------------------------- data

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher",
             "our neighbour", "the farmer", "a tired fox", "the young queen", "his brother"]
_VERBS = ["sees", "likes", "follows", "paints", "finds", "helps", "watches", "carries", "loves", "visits"]
_OBJECTS = ["a red kite", "the green door", "an apple", "the little boat", "a blue hat", "the old clock",
            "a yellow ball", "the tall tree", "a wooden box", "the river"]
_PLACES = ["in the garden", "at the station", "near the river", "on the hill", "under the bridge",
           "in the kitchen", "at school", ""]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        place = rng.choice(_PLACES)
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)] + ([place] if place else [])
        return " ".join(words) + "."
    if kind < 0.85:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"{a} plus {b} is {a + b}."
    start = rng.randrange(30)
    return "count " + " ".join(str(n) for n in range(start, start + rng.randrange(3, 7))) + "."


def make_corpus(n_chars: int = CORPUS_CHARS, seed: int = CORPUS_SEED) -> str:
    """A deterministic character corpus: lines of 1-4 generated sentences."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:n_chars]


def sample_batch(key, corpus, batch: int, length: int):
    """batch random windows of `length` tokens from the corpus (on the device)."""
    starts = jax.random.randint(key, (batch,), 0, corpus.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(corpus, (s,), (length,)))(starts)


# ---------------------------------------------------------------------------- model


class Config(NamedTuple):
    vocab: int
    hidden: int
    heads: int
    layers: int
    experts: int
    top_k: int
    ffn: int
    dtype: jnp.dtype


def init_params(key, cfg: Config) -> dict:
    """float32 parameters; layer weights are stacked along a leading [L] axis for lax.scan."""
    h, e, f, n = cfg.hidden, cfg.experts, cfg.ffn, cfg.layers
    k = iter(jax.random.split(key, 6))

    def normal(shape, std):
        return std * jax.random.normal(next(k), shape, jnp.float32)

    residual_std = 0.02 / math.sqrt(2 * n)  # output projections of the 2n residual branches
    return {
        "embed": normal((cfg.vocab, h), 0.02),
        "final_norm": jnp.ones((h,), jnp.float32),
        "layers": {
            "attn_norm": jnp.ones((n, h), jnp.float32),
            "wqkv": normal((n, h, 3 * h), 0.02),
            "wo": normal((n, h, h), residual_std),
            "moe_norm": jnp.ones((n, h), jnp.float32),
            "router": normal((n, h, e), 0.02),
            "w_in": normal((n, e, h, 2 * f), 0.02),
            "w_out": normal((n, e, f, h), residual_std),
        },
    }


def rms_norm(x, weight, eps: float = 1e-6):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x):
    """Rotary position embedding on [B, S, heads, head_dim] (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def attention(x, p, cfg: Config):
    b, s, h = x.shape
    q, k, v = jnp.split(x @ p["wqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, cfg.heads, h // cfg.heads) for t in (q, k, v))
    out = jax.nn.dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
    return out.reshape(b, s, h) @ p["wo"]


def moe_block(x, p, cfg: Config):
    router_logits = x.astype(jnp.float32) @ p["router"]
    return moe_xla.moe(x, router_logits, p["w_in"], p["w_out"], top_k=cfg.top_k, activation="swiglu",
                       return_aux=True)


def forward(params, tokens, cfg: Config):
    """tokens [B, S] int32 -> (logits [B, S, V] float32, MoeAux with a leading [L] axis)."""
    layers = {name: w if name == "router" else w.astype(cfg.dtype) for name, w in params["layers"].items()}
    embed = params["embed"].astype(cfg.dtype)

    def layer(x, p):
        x = x + attention(rms_norm(x, p["attn_norm"]), p, cfg)
        y, aux = moe_block(rms_norm(x, p["moe_norm"]), p, cfg)
        return x + y, aux

    x, aux = jax.lax.scan(layer, embed[tokens], layers)
    logits = rms_norm(x, params["final_norm"]) @ embed.T
    return logits.astype(jnp.float32), aux


def loss_fn(params, tokens, cfg: Config):
    """Next-token cross entropy on tokens [B, S+1] plus the router losses."""
    logits, aux = forward(params, tokens[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    balance, z = jnp.mean(aux.load_balance_loss), jnp.mean(aux.z_loss)
    total = ce + LOAD_BALANCE_COEF * balance + Z_LOSS_COEF * z
    return total, {"loss": ce, "load_balance_loss": balance, "z_loss": z, "tokens_per_expert": aux.tokens_per_expert}


# ---------------------------------------------------------------------------- optimiser


class Adam(NamedTuple):
    mu: dict
    nu: dict


def adam_init(params) -> Adam:
    return Adam(jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))


def adam_update(params, grads, state: Adam, step, lr, b1=0.9, b2=0.95, eps=1e-8, clip=1.0):
    """Adam with bias correction after clipping the gradients to global norm `clip`."""
    grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (grad_norm + 1e-6)), grads)
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    t = (step + 1).astype(jnp.float32)
    lr_t = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, m, v: p - lr_t * m / (jnp.sqrt(v) + eps), params, mu, nu)
    return params, Adam(mu, nu), grad_norm


def learning_rate(step, peak: float, total_steps: int):
    """Linear warmup over the first 5% of the steps, then cosine decay to peak / 10."""
    warmup = max(1, total_steps // 20)
    progress = jnp.clip((step - warmup) / max(1, total_steps - warmup), 0.0, 1.0)
    decayed = peak * (0.1 + 0.45 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < warmup, peak * (step + 1) / warmup, decayed)


# ---------------------------------------------------------------------------- training


class TrainState(NamedTuple):
    params: dict
    adam: Adam
    step: jax.Array
    key: jax.Array


def make_train_step(cfg: Config, batch: int, seq: int, peak_lr: float, total_steps: int):
    """(state, corpus) -> (state, metrics): sample a batch, value_and_grad, Adam update."""

    def train_step(state: TrainState, corpus):
        key, batch_key = jax.random.split(state.key)
        tokens = sample_batch(batch_key, corpus, batch, seq + 1)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, tokens, cfg)
        lr = learning_rate(state.step, peak_lr, total_steps)
        params, adam, grad_norm = adam_update(state.params, grads, state.adam, state.step, lr)
        return TrainState(params, adam, state.step + 1, key), dict(metrics, grad_norm=grad_norm, lr=lr)

    return train_step


def make_generate(cfg: Config, seq: int, n_new: int, temperature: float):
    """(params, prompt [P] int32, key) -> [P + n_new] tokens; the model sees the last `seq`."""

    def generate(params, prompt, key):
        size = max(prompt.shape[0] + n_new, seq)
        buf = jnp.zeros((size,), jnp.int32).at[: prompt.shape[0]].set(prompt)

        def body(i, carry):
            buf, key = carry
            pos = prompt.shape[0] - 1 + i  # the last known token
            start = jnp.maximum(0, pos + 1 - seq)
            window = jax.lax.dynamic_slice(buf, (start,), (seq,))
            logits = forward(params, window[None], cfg)[0][0, pos - start]
            key, sub = jax.random.split(key)
            if temperature > 0:
                nxt = jax.random.categorical(sub, logits / temperature)
            else:
                nxt = jnp.argmax(logits)
            return buf.at[pos + 1].set(nxt.astype(jnp.int32)), key

        buf, _ = jax.lax.fori_loop(0, n_new, body, (buf, key))
        return buf[: prompt.shape[0] + n_new]

    return generate


# ---------------------------------------------------------------------------- reporting


class _Bar:
    """A minimal stand-in for tqdm: a progress line on stderr (a terminal only), redrawn once per percent."""

    def __init__(self, total: int, width: int = 30):
        self.total, self.width, self.n, self.postfix, self.percent = total, width, 0, "", -1
        self.live = sys.stderr.isatty()

    def update(self, n: int = 1):
        self.n += n
        if self.n * 100 // self.total != self.percent:
            self._draw()

    def set_postfix_str(self, text: str, refresh: bool = True):
        self.postfix = text

    def write(self, text: str):
        if self.live:
            sys.stderr.write("\r\033[K")
        print(text, flush=True)
        self._draw()

    def close(self):
        if self.live:
            sys.stderr.write("\n")

    def _draw(self):
        self.percent = self.n * 100 // self.total
        if self.live:
            filled = self.width * self.n // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.n}/{self.total} {self.postfix}")
            sys.stderr.flush()


def progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Bar(total)
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def expert_load_chart(tokens_per_expert: np.ndarray, width: int = 40) -> str:
    """Text bar chart of [L, E] routed (token, expert) pairs, one block per layer."""
    lines = []
    for layer, counts in enumerate(tokens_per_expert):
        total = int(counts.sum())
        lines.append(f"layer {layer}: {total} routed pairs, {total / len(counts):.0f} per expert if balanced")
        top = max(int(counts.max()), 1)
        for e, c in enumerate(counts):
            bar = "#" * round(width * int(c) / top)
            lines.append(f"  e{e:<3d} {bar:<{width}} {int(c):6d} {100 * int(c) / max(total, 1):5.1f}%")
    return "\n".join(lines)


def moe_custom_calls(hlo: str) -> dict[str, int]:
    """Counts of the distinct moe_xla custom-call targets of an HLO module's text (read by
    moe_xla.inspect: the computations the entry runs), sorted by target."""
    return dict(sorted(Counter(c.target for c in inspect_hlo(hlo).custom_calls).items()))


# ---------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python3 -m moe_xla.demo",
                                description="Train a small MoE language model with moe_xla on a generated corpus.")
    p.add_argument("--steps", type=int, default=400, help="training steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="model width H (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4,
                   help="attention heads; H / heads must be even (default: %(default)s)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer E (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--ffn", type=int, default=None, help="expert hidden size F (default: H)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype; parameters and Adam state stay float32 (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch sampling (default: %(default)s)")
    p.add_argument("--sample-chars", type=int, default=200, help="characters to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature, 0 for greedy (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("moe_xla_demo_out"),
                   help="output directory (default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (tokens/s excludes the first step)")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden} into an even head size")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts = {args.experts}]")
    return args


def main(argv=None) -> dict:
    """Runs the demo; returns losses, tokens_per_s, custom_calls, tokens_per_expert, sample, loss_fell."""
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}), the first of {jax.device_count()}; jax {jax.__version__}")

    text = make_corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    corpus = jnp.asarray([index[c] for c in text], jnp.int32)
    cfg = Config(vocab=len(chars), hidden=args.hidden, heads=args.heads, layers=args.layers, experts=args.experts,
                 top_k=args.top_k, ffn=args.ffn or args.hidden, dtype=jnp.dtype(args.dtype))
    print(f"corpus: {len(text)} characters, vocabulary {cfg.vocab}, e.g. {text[:60]!r}")

    init_key, train_key, sample_key = jax.random.split(jax.random.key(args.seed), 3)
    params = init_params(init_key, cfg)
    n_params = sum(w.size for w in jax.tree.leaves(params))
    expert_params = cfg.layers * cfg.experts * 3 * cfg.hidden * cfg.ffn
    active = n_params - expert_params * (cfg.experts - cfg.top_k) // cfg.experts
    print(f"model: {cfg.layers} layers, H={cfg.hidden}, {cfg.heads} heads, E={cfg.experts} experts of F={cfg.ffn} "
          f"(swiglu), top_k={cfg.top_k}, {args.dtype}; {n_params:,} parameters, {active:,} active per token")
    print(f"training: {args.steps} steps of {args.batch} x {args.seq} tokens, Adam, peak lr {args.lr}")

    state = TrainState(params, adam_init(params), jnp.zeros((), jnp.int32), train_key)
    step_fn = make_train_step(cfg, args.batch, args.seq, args.lr, args.steps)
    t0 = time.perf_counter()
    compiled = jax.jit(step_fn, donate_argnums=0).lower(state, corpus).compile()
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    hlo_path = args.out / "train_step_hlo.txt"
    hlo = compiled.as_text()
    hlo_path.write_text(hlo)

    log_every = max(1, args.steps // 10)
    losses = []
    bar = progress_bar(args.steps)

    def record(metrics):
        losses.append(float(metrics["loss"]))
        step = len(losses)
        bar.update(1)
        bar.set_postfix_str(f"loss {losses[-1]:.3f}", refresh=False)
        if step == 1 or step % log_every == 0 or step == args.steps:
            bar.write(f"step {step:5d}  loss {losses[-1]:.4f}  load_balance {metrics['load_balance_loss']:.3f}"
                      f"  z {metrics['z_loss']:.3f}  grad_norm {metrics['grad_norm']:.2f}  lr {metrics['lr']:.2e}")
        return metrics

    state, first = compiled(state, corpus)
    record(jax.device_get(first))  # step 1 is not timed: it pays for first-run allocations
    start = time.perf_counter()
    # Step i's metrics are read while step i + 1 runs, so the device never waits on the host.
    pending = None
    for _ in range(args.steps - 1):
        state, running = compiled(state, corpus)
        if pending is not None:
            record(jax.device_get(pending))
        pending = running
    metrics = record(jax.device_get(pending))
    elapsed = time.perf_counter() - start
    bar.close()
    tokens_per_s = (args.steps - 1) * args.batch * args.seq / elapsed

    print(f"\nloss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")
    print(f"throughput: {tokens_per_s:,.0f} tokens/s ({1e3 * elapsed / (args.steps - 1):.1f} ms/step, "
          f"steps 2..{args.steps})")
    tokens_per_expert = np.asarray(metrics["tokens_per_expert"])
    print(f"\nper-expert load of the last step (top_k={cfg.top_k}):\n{expert_load_chart(tokens_per_expert)}")

    custom_calls = moe_custom_calls(hlo)
    print(f"\noptimised HLO of one training step: {hlo_path} ({len(hlo.splitlines())} lines); moe_xla custom calls:")
    for target, count in custom_calls.items():
        print(f"  {target:32s} x{count}")

    prompt = jnp.asarray([index[c] for c in SAMPLE_PROMPT], jnp.int32)
    generate = jax.jit(make_generate(cfg, args.seq, args.sample_chars, args.temperature))
    sample = "".join(chars[t] for t in np.asarray(generate(state.params, prompt, sample_key)))
    print(f"\nsample (temperature {args.temperature}):\n{sample}")

    loss_fell = losses[-1] < losses[0]
    if not loss_fell:
        print(f"\nFAILED: the final loss {losses[-1]:.4f} is not below the first {losses[0]:.4f}")
    return {"losses": losses, "tokens_per_s": tokens_per_s, "custom_calls": custom_calls,
            "tokens_per_expert": tokens_per_expert, "sample": sample, "loss_fell": loss_fell, "hlo_path": hlo_path}


if __name__ == "__main__":
    sys.exit(0 if main()["loss_fell"] else 1)
