"""The README demo trains end to end on moe_xla.nnx.MoE: the loss falls, the HLO shows the
moe_xla custom calls, the plots are written, orbax checkpoints restore and resume, and a text
file can replace the built-in corpus."""

from __future__ import annotations

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
        target = f"moe_xla_{op}_{PLATFORM}_v1"
        assert f'custom_call_target="{target}"' in hlo
        assert result["custom_calls"][target] >= 1
    assert result["custom_calls"] == cli.moe_custom_calls(hlo)

    for name in ("loss.png", "expert_load.png"):
        height, width, _ = imread(tmp_path / name).shape
        assert height > 200 and width > 200, name
    assert Checkpoints(tmp_path / "checkpoints").steps() == [30]  # --checkpoint-every 100: the last step only

    out = capsys.readouterr().out
    assert "device:" in out and "tokens/s" in out and f"moe_xla_gmm_{PLATFORM}_v1" in out


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


def test_moe_options_reach_every_moe_layer():
    options = cli.moe_options(cli.parse_args(["--activation", "gelu", "--score", "sigmoid"]))
    assert options == {"activation": "gelu", "score": "sigmoid"}
    cfg = Config(vocab=5, hidden=8, heads=2, layers=3, experts=4, top_k=2, ffn=6, dtype="float32", moe=options)
    moe = LanguageModel(cfg, rngs=nnx.Rngs(0)).blocks.moe
    assert moe.activation == "gelu" and moe.moe_options == {"score": "sigmoid"}
    assert moe.w_in.shape == (3, 4, 8, 6)  # [L, E, H, F]: not gated


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
