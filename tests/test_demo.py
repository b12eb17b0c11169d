"""The README demo trains end to end on moe_xla.nnx.MoE: the loss falls, the HLO shows the
moe_xla custom calls, the plots and summary.json are written, orbax checkpoints restore and
resume, a text file can replace the built-in corpus, and --quantization fp8_blockwise trains
with the FP8 grouped products."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", minversion="0.12.6")  # nnx.capture
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from matplotlib.image import imread  # noqa: E402

from moe_xla._lib import target_name  # noqa: E402
from moe_xla.demo import cli, data  # noqa: E402
from moe_xla.demo.checkpoints import Checkpoints  # noqa: E402
from moe_xla.demo.model import Config, LanguageModel  # noqa: E402

PLATFORM = "cuda" if jax.default_backend() == "gpu" else "cpu"
TINY = ["--batch", "8", "--seq", "32", "--hidden", "32", "--heads", "2", "--experts", "4", "--top-k", "2",
        "--layers", "1", "--sample-chars", "20"]


def test_demo_trains_dumps_hlo_and_plots(tmp_path, capsys):
    result = cli.main(TINY + ["--steps", "30", "--out", str(tmp_path)])

    losses = result["losses"]
    assert len(losses) == 30
    assert result["loss_fell"] and losses[-1] < losses[0] - 0.2, losses
    assert result["tokens_per_s"] > 0
    assert result["tokens_per_expert"].shape == (1, 4)
    assert result["tokens_per_expert"].sum() == 8 * 32 * 2  # dropless: every (token, expert) pair is routed
    assert result["sample"].startswith(cli.SAMPLE_PROMPT) and len(result["sample"]) == len(cli.SAMPLE_PROMPT) + 20

    hlo_path = tmp_path / "train_step_hlo.txt"
    assert hlo_path.is_file()
    hlo = hlo_path.read_text()
    for op in ("gmm", "route", "permute", "unpermute"):
        target = target_name(op, PLATFORM)
        assert f'custom_call_target="{target}"' in hlo
        assert result["custom_calls"][target] >= 1
    assert result["custom_calls"] == cli.moe_custom_calls(hlo)

    for name in ("loss.png", "expert_load.png"):
        height, width, _ = imread(tmp_path / name).shape
        assert height > 200 and width > 200, name
    assert Checkpoints(tmp_path / "checkpoints").steps() == [30]  # --checkpoint-every 100: the last step only

    # The final loss: the mean over the last 50 steps, here all 30.
    assert result["final_loss_window"] == 30
    np.testing.assert_allclose(result["final_loss"], np.mean(losses), rtol=1e-6)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert result["summary_path"] == tmp_path / "summary.json"
    assert summary["quantization"] == "none" and "quantization" not in summary["model"]["moe"]
    assert summary["final_loss"] == result["final_loss"] and summary["final_loss_window"] == 30
    assert summary["first_loss"] == losses[0] and summary["last_loss"] == losses[-1]
    assert summary["ms_per_step"] == result["ms_per_step"] > 0 and summary["steps"] == 30 and summary["seed"] == 0

    out = capsys.readouterr().out
    assert "device:" in out and "tokens/s" in out and f"moe_xla_gmm_{PLATFORM}_v1" in out
    assert f"mean loss over the last 30 steps: {result['final_loss']:.4f}" in out
    assert "quantization=none" in out


def test_final_loss_is_the_mean_of_the_last_50_steps():
    assert cli.final_loss([4.0, 2.0]) == (3.0, 2)
    assert cli.final_loss([9.0] * 10 + [1.0] * 50) == (1.0, 50)


def test_demo_trains_with_fp8_blockwise(tmp_path, capsys):
    """--quantization fp8_blockwise: both expert products run in moe_xla_gmm_fp8 (the bf16
    gmm is gone from the step), and the loss stays finite and falls."""
    result = cli.main(TINY + ["--steps", "16", "--sample-chars", "4", "--quantization", "fp8_blockwise",
                              "--out", str(tmp_path)])
    losses = np.asarray(result["losses"])
    assert losses.shape == (16,) and np.all(np.isfinite(losses)), losses
    assert result["loss_fell"] and losses[-1] < losses[0] - 0.2, losses
    assert losses[-4:].mean() < losses[:4].mean() - 0.2, losses
    assert result["custom_calls"].get(f"moe_xla_gmm_fp8_{PLATFORM}_v2", 0) >= 2
    assert f"moe_xla_gmm_{PLATFORM}_v1" not in result["custom_calls"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quantization"] == summary["model"]["moe"]["quantization"] == "fp8_blockwise"
    assert np.isfinite(summary["final_loss"]) and summary["final_loss_window"] == 16
    assert "quantization=fp8_blockwise" in capsys.readouterr().out


def test_checkpoint_restores_parameters_and_training_resumes(tmp_path, capsys):
    args = TINY + ["--steps", "6", "--checkpoint-every", "3", "--sample-chars", "1", "--out", str(tmp_path)]
    full = cli.main(args)
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    assert checkpoints.steps() == [3, 6]

    zeros = jax.tree.map(jnp.zeros_like, full["state"])
    restored = checkpoints.restore_latest(zeros)
    assert int(restored.step) == 6
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(full["state"]), strict=True):
        np.testing.assert_array_equal(got, want)
    assert checkpoints.latest_meta()["history"]["loss"] == full["losses"]

    ocp.CheckpointManager(checkpoints.directory).delete(6)  # as if the run had stopped after step 3
    capsys.readouterr()
    resumed = cli.main(args + ["--resume"])
    assert "resumed from the checkpoint of step 3" in capsys.readouterr().out
    # Steps 1-3 come from the checkpoint's history, 4-6 are run again from its state.
    assert resumed["losses"][:3] == full["losses"][:3]
    np.testing.assert_allclose(resumed["losses"][3:], full["losses"][3:], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(full["state"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

    with pytest.raises(SystemExit, match="another model or text"):
        cli.main(args + ["--resume", "--hidden", "16"])


def test_trains_on_a_text_file(tmp_path, capsys):
    text = "the owl and the pussy-cat went to sea in a beautiful pea-green boat.\n" * 20
    path = tmp_path / "poem.txt"
    path.write_text(text)
    result = cli.main(TINY + ["--steps", "2", "--text", str(path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert f"corpus: {path}, {len(text)} characters, vocabulary {len(set(text))}" in out
    assert set(result["sample"]) <= set(text)

    with pytest.raises(SystemExit, match="characters the text lacks"):
        cli.main(TINY + ["--text", str(path), "--prompt", "xyz"])


def test_fp8_comparison_defaults_to_gpu_check_demo_args():
    """benchmarks/demo_fp8_vs_bf16.py compares the runs of gpu_check.sh's demo step."""
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("demo_fp8_vs_bf16", root / "benchmarks" / "demo_fp8_vs_bf16.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    line = re.search(r"^DEMO_ARGS=\((.*)\)$", (root / "benchmarks" / "gpu_check.sh").read_text(), re.M)
    assert shlex.split(line.group(1)) == script.GPU_DEMO_ARGS
    cli.parse_args(script.GPU_DEMO_ARGS + script.RUNS["fp8_blockwise"])  # valid demo arguments
    with pytest.raises(SystemExit):
        script.main(["--out", "unused", "--", "--quantization", "fp8_blockwise"])


def test_moe_options_reach_every_moe_layer():
    options = cli.moe_options(cli.parse_args(["--activation", "gelu", "--score", "sigmoid"]))
    assert options == {"activation": "gelu", "score": "sigmoid"}  # quantization "none": moe()'s default
    cfg = Config(vocab=5, hidden=8, heads=2, layers=3, experts=4, top_k=2, ffn=6, dtype="float32", moe=options)
    moe = LanguageModel(cfg, rngs=nnx.Rngs(0)).blocks.moe
    assert moe.activation == "gelu" and moe.moe_options == {"score": "sigmoid"}
    assert moe.w_in.shape == (3, 4, 8, 6)  # [L, E, H, F]: not gated

    options = cli.moe_options(cli.parse_args(["--quantization", "fp8_blockwise"]))
    assert options == {"activation": "swiglu", "score": "softmax", "quantization": "fp8_blockwise"}
    moe = LanguageModel(cfg._replace(moe=options), rngs=nnx.Rngs(0)).blocks.moe
    assert moe.moe_options == {"score": "softmax", "quantization": "fp8_blockwise"}
    with pytest.raises(SystemExit):
        cli.parse_args(["--quantization", "int8"])


def test_moe_custom_calls_counts_only_moe_xla_targets():
    hlo = ('ENTRY %main (x: f32[2]) -> f32[2] {\n'
           '  %x = f32[2] parameter(0)\n'
           '  %a = f32[2] custom-call(%x), custom_call_target="moe_xla_gmm_cpu_v1"\n'
           '  %b = f32[2] custom-call(%a), custom_call_target="moe_xla_gmm_cpu_v1"\n'
           '  ROOT %c = f32[2] custom-call(%b), custom_call_target="__onednn$matmul"\n'
           '}\n')
    assert cli.moe_custom_calls(hlo) == {"moe_xla_gmm_cpu_v1": 2}


def test_corpus_and_vocabulary():
    assert data.make_corpus(1000) == data.make_corpus(1000)
    assert len(data.make_corpus(1000)) == 1000
    vocab = data.Vocabulary.of("banana")
    assert vocab.chars == "abn"
    np.testing.assert_array_equal(vocab.encode("nab"), [2, 0, 1])
    assert vocab.decode(vocab.encode("banana")) == "banana"
