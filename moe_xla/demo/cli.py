"""The demo's command line: its options, the training loop, and what it prints and writes
(moe_xla.demo describes a run)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from moe_xla.activations import ACTIVATIONS
from moe_xla.demo.checkpoints import Checkpoints
from moe_xla.demo.data import Vocabulary, make_corpus, read_text
from moe_xla.demo.model import Config, LanguageModel, generate
from moe_xla.demo.plots import plot_expert_load, plot_loss
from moe_xla.demo.train import TrainState, init_state, make_train_step, optimizer, schedule
from moe_xla.grouped import QUANTIZATIONS
from moe_xla.inspect import inspect_hlo
from moe_xla.primitives.route import SCORES

SAMPLE_PROMPT = "the "
# The options of the "MoE layer" group are stored under this prefix and passed to every
# moe_xla.nnx.MoE as keywords of the same name.
MOE_OPTION = "moe."
# The final loss a run reports: the mean over this many last steps (all steps of a shorter run).
FINAL_LOSS_WINDOW = 50
# --quantization's choices: "none" (moe()'s default, bf16/f32 products) or a moe() quantization.
QUANTIZATION_CHOICES = ("none",) + tuple(q for q in QUANTIZATIONS if q is not None)


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


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m moe_xla.demo",
                                description="Train a small MoE language model with moe_xla.nnx.MoE, optax and orbax.")
    data = p.add_argument_group("data")
    data.add_argument("--text", type=Path, default=None, metavar="PATH",
                      help="train on this UTF-8 text file (default: the built-in generated corpus)")
    model = p.add_argument_group("model")
    model.add_argument("--hidden", type=int, default=64, help="model width H (default: %(default)s)")
    model.add_argument("--heads", type=int, default=4,
                       help="attention heads; H / heads must be even (default: %(default)s)")
    model.add_argument("--experts", type=int, default=8, help="experts per MoE layer E (default: %(default)s)")
    model.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    model.add_argument("--ffn", type=int, default=None, help="expert hidden size F (default: H)")
    model.add_argument("--layers", type=int, default=2, help="transformer layers (default: %(default)s)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="compute dtype; parameters and optimiser state stay float32 (default: %(default)s)")
    moe = p.add_argument_group("MoE layer", "keywords of every moe_xla.nnx.MoE layer (see moe_xla.moe)")
    moe.add_argument("--activation", dest=MOE_OPTION + "activation", choices=ACTIVATIONS, default="swiglu",
                     help="expert activation (default: %(default)s)")
    moe.add_argument("--score", dest=MOE_OPTION + "score", choices=SCORES, default="softmax",
                     help="router scores (default: %(default)s)")
    moe.add_argument("--quantization", dest=MOE_OPTION + "quantization", choices=QUANTIZATION_CHOICES,
                     default="none",
                     help="the expert products' arithmetic: none (the --dtype products), fp8_blockwise (E4M3, "
                          "1x128 activation tiles, 128x128 weight blocks, bf16 weight gradients; see moe_xla.fp8) "
                          "or fp8_blockwise_fp8_wgrad (FP8 weight gradients too) (default: %(default)s)")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=400, help="training steps in all (default: %(default)s)")
    train.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    train.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    train.add_argument("--seed", type=int, default=0,
                       help="initialisation, batch sampling and text sampling (default: %(default)s)")
    train.add_argument("--checkpoint-every", type=int, default=100,
                       help="save a checkpoint every this many steps; the last step is always saved "
                            "(default: %(default)s)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint under --out up to --steps (the learning-rate "
                            "schedule spans --steps), with the same model options and text (default: start afresh, "
                            "replacing the checkpoints)")
    out = p.add_argument_group("output")
    out.add_argument("--prompt", default=SAMPLE_PROMPT,
                     help="text the sample starts from; its characters must occur in the text (default: %(default)r)")
    out.add_argument("--sample-chars", type=int, default=200, help="characters to generate (default: %(default)s)")
    out.add_argument("--temperature", type=float, default=0.7,
                     help="sampling temperature, 0 for greedy (default: %(default)s)")
    out.add_argument("--out", type=Path, default=Path("moe_xla_demo_out"), metavar="DIR",
                     help="output directory: HLO, plots, checkpoints (default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (tokens/s excludes the first step)")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden} into an even head size")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts = {args.experts}]")
    if not args.prompt:
        p.error("--prompt must not be empty")
    if args.checkpoint_every < 1:
        p.error("--checkpoint-every must be at least 1")
    return args


def moe_options(args: argparse.Namespace) -> dict:
    """The "MoE layer" options: keyword -> value, as moe_xla.nnx.MoE takes them; quantization
    only when it is not "none" (moe()'s default), so that a bf16/f32 model's config (and the
    checkpoints that hold it) stays as before the option existed."""
    options = {k.removeprefix(MOE_OPTION): v for k, v in vars(args).items() if k.startswith(MOE_OPTION)}
    if options.get("quantization") == "none":
        del options["quantization"]
    return options


def final_loss(losses) -> tuple[float, int]:
    """(the mean loss over the last FINAL_LOSS_WINDOW steps, or over all of them when there
    are fewer; the number of steps averaged)."""
    window = min(FINAL_LOSS_WINDOW, len(losses))
    return float(np.mean(losses[-window:])), window


def _error(message: str):
    sys.exit(f"moe_xla.demo: error: {message}")


def _starting_point(args, checkpoints: Checkpoints, state: TrainState, meta: dict) -> tuple[TrainState, dict]:
    """(state, history) training starts from: with --resume the newest checkpoint's, which
    must hold `meta` (the same model and vocabulary); else `state` and an empty history, and
    the checkpoints there are deleted."""
    if not args.resume:
        checkpoints.delete_all()
        return state, {"loss": [], "tokens_per_expert": []}
    if not checkpoints.steps():
        _error(f"--resume: no checkpoint in {checkpoints.directory}")
    saved = checkpoints.latest_meta()
    if {k: saved[k] for k in meta} != meta:
        _error(f"--resume: the checkpoint in {checkpoints.directory} has another model or text: {saved['model']}, "
               f"vocabulary {saved['vocabulary']!r}")
    state = checkpoints.restore_latest(state)
    if args.steps - int(state.step) < 2:
        _error(f"--resume: the checkpoint is at step {int(state.step)}; --steps {args.steps} leaves fewer than 2 "
               "steps to run")
    print(f"resumed from the checkpoint of step {int(state.step)} in {checkpoints.directory}")
    return state, saved["history"]


def main(argv=None) -> dict:
    """Runs the demo; returns losses (every step, those of a resumed run's checkpoint included),
    final_loss (their mean over the last FINAL_LOSS_WINDOW steps) and final_loss_window,
    tokens_per_s, ms_per_step, custom_calls, tokens_per_expert (the last step's, [L, E]),
    sample, loss_fell, hlo_path, summary_path (summary.json under --out) and state (the final
    TrainState)."""
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}), the first of {jax.device_count()}; jax {jax.__version__}")

    text = read_text(args.text) if args.text else make_corpus()
    if len(text) <= args.seq + 1:
        _error(f"the text has {len(text)} characters; --seq {args.seq} needs more")
    vocab = Vocabulary.of(text)
    corpus = jnp.asarray(vocab.encode(text))
    if not set(args.prompt) <= set(vocab.chars):
        _error(f"--prompt {args.prompt!r} has characters the text lacks")
    print(f"corpus: {args.text or 'built-in'}, {len(text)} characters, vocabulary {len(vocab.chars)}, "
          f"e.g. {text[:60]!r}")

    cfg = Config(vocab=len(vocab.chars), hidden=args.hidden, heads=args.heads, layers=args.layers,
                 experts=args.experts, top_k=args.top_k, ffn=args.ffn or args.hidden, dtype=args.dtype,
                 moe=moe_options(args))
    init_key, train_key, sample_key = jax.random.split(jax.random.key(args.seed), 3)
    model = LanguageModel(cfg, rngs=nnx.Rngs(params=init_key))
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(w.size for w in jax.tree.leaves(params))
    expert_params = model.blocks.moe.w_in.size + model.blocks.moe.w_out.size
    active = n_params - expert_params * (cfg.experts - cfg.top_k) // cfg.experts
    quantization = cfg.moe.get("quantization", "none")
    options = ", ".join(f"{k}={v}" for k, v in dict(cfg.moe, quantization=quantization).items())
    print(f"model: {cfg.layers} layers, H={cfg.hidden}, {cfg.heads} heads, E={cfg.experts} experts of F={cfg.ffn}, "
          f"top_k={cfg.top_k}, {options}, {args.dtype}; {n_params:,} parameters, {active:,} active per token")

    lr = schedule(args.lr, args.steps)
    tx = optimizer(lr)
    state = init_state(params, tx, train_key)
    checkpoints = Checkpoints(args.out / "checkpoints")
    meta = {"model": cfg._asdict(), "vocabulary": vocab.chars}
    state, history = _starting_point(args, checkpoints, state, meta)
    start = int(state.step)
    print(f"training: steps {start + 1}..{args.steps} of {args.batch} x {args.seq} tokens, optax Adam, "
          f"peak lr {args.lr}; checkpoints every {args.checkpoint_every} steps in {checkpoints.directory}")

    t0 = time.perf_counter()
    step_fn = make_train_step(graphdef, tx, lr, args.batch, args.seq)
    compiled = jax.jit(step_fn, donate_argnums=0).lower(state, corpus).compile()
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    hlo_path = args.out / "train_step_hlo.txt"
    hlo = compiled.as_text()
    hlo_path.write_text(hlo)

    log_every = max(1, args.steps // 10)
    bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True, disable=None)

    def record(step, metrics):
        metrics = jax.device_get(metrics)
        history["loss"].append(float(metrics["loss"]))
        history["tokens_per_expert"].append(metrics["tokens_per_expert"].tolist())
        bar.update(1)
        bar.set_postfix_str(f"loss {metrics['loss']:.3f}", refresh=False)
        if step == 1 or step % log_every == 0 or step == args.steps:
            bar.write(f"step {step:5d}  loss {metrics['loss']:.4f}  load_balance {metrics['load_balance_loss']:.3f}"
                      f"  z {metrics['z_loss']:.3f}  grad_norm {metrics['grad_norm']:.2f}  lr {metrics['lr']:.2e}")

    # A step's metrics are read while the next step runs, so the device does not wait on the
    # host; except the first step's (timing starts after it: it pays for first-run
    # allocations) and a checkpoint's step, whose history the checkpoint holds.
    timed_from, saving, pending = None, 0.0, None
    for step in range(start + 1, args.steps + 1):
        state, metrics = compiled(state, corpus)
        if pending is not None:
            record(*pending)
        pending = (step, metrics)
        save = step % args.checkpoint_every == 0 or step == args.steps
        if save or timed_from is None:
            record(*pending)
            pending = None
        if save:
            t0 = time.perf_counter()
            checkpoints.save(step, state, dict(meta, history={k: list(v) for k, v in history.items()}))
            saving += time.perf_counter() - t0
        if timed_from is None:
            timed_from = time.perf_counter()
    elapsed = time.perf_counter() - timed_from - saving
    bar.close()
    checkpoints.close()
    losses = history["loss"]
    tokens_per_s = (args.steps - start - 1) * args.batch * args.seq / elapsed
    ms_per_step = 1e3 * elapsed / (args.steps - start - 1)
    mean_final, window = final_loss(losses)

    print(f"\nloss: step 1 {losses[0]:.4f} -> step {args.steps} {losses[-1]:.4f}")
    print(f"mean loss over the last {window} steps: {mean_final:.4f}")
    print(f"throughput: {tokens_per_s:,.0f} tokens/s ({ms_per_step:.1f} ms/step, "
          f"steps {start + 2}..{args.steps}, checkpoint saving excluded)")
    print(f"checkpoints: steps {checkpoints.steps()} in {checkpoints.directory}")
    tokens_per_expert = np.asarray(history["tokens_per_expert"][-1])
    print(f"\nper-expert load of the last step (top_k={cfg.top_k}):\n{expert_load_chart(tokens_per_expert)}")

    custom_calls = moe_custom_calls(hlo)
    print(f"\noptimised HLO of one training step: {hlo_path} ({len(hlo.splitlines())} lines); moe_xla custom calls:")
    for target, count in custom_calls.items():
        print(f"  {target:32s} x{count}")

    plot_loss(losses, args.out / "loss.png")
    plot_expert_load(history["tokens_per_expert"], args.out / "expert_load.png")
    print(f"plots: {args.out / 'loss.png'}, {args.out / 'expert_load.png'}")

    sampler = jax.jit(functools.partial(generate, graphdef, seq=args.seq, n_new=args.sample_chars,
                                        temperature=args.temperature))
    sample = vocab.decode(sampler(state.params, jnp.asarray(vocab.encode(args.prompt)), sample_key))
    print(f"\nsample (temperature {args.temperature}):\n{sample}")

    loss_fell = losses[-1] < losses[0]
    if not loss_fell:
        print(f"\nFAILED: the final loss {losses[-1]:.4f} is not below the first {losses[0]:.4f}")
    summary = {"device": f"{device.platform} ({device.device_kind})", "platform": device.platform,
               "jax": jax.__version__, "argv": list(sys.argv[1:] if argv is None else argv), "seed": args.seed,
               "steps": args.steps, "batch": args.batch, "seq": args.seq, "model": cfg._asdict(),
               "quantization": quantization, "first_loss": losses[0], "last_loss": losses[-1],
               "final_loss": mean_final, "final_loss_window": window, "ms_per_step": ms_per_step,
               "timed_steps": args.steps - start - 1, "tokens_per_s": tokens_per_s, "loss_fell": loss_fell,
               "custom_calls": custom_calls}
    summary_path = args.out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary: {summary_path}")
    return {"losses": losses, "final_loss": mean_final, "final_loss_window": window, "tokens_per_s": tokens_per_s,
            "ms_per_step": ms_per_step, "custom_calls": custom_calls, "tokens_per_expert": tokens_per_expert,
            "sample": sample, "loss_fell": loss_fell, "hlo_path": hlo_path, "summary_path": summary_path,
            "state": state}
