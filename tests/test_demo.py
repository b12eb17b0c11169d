"""The README demo trains end to end: the loss falls and the HLO shows the moe_xla custom calls."""

from __future__ import annotations

import jax

from moe_xla import demo

PLATFORM = "cuda" if jax.default_backend() == "gpu" else "cpu"
TINY = ["--steps", "30", "--batch", "8", "--seq", "32", "--hidden", "32", "--heads", "2", "--experts", "4",
        "--top-k", "2", "--layers", "1", "--sample-chars", "20"]


def test_demo_trains_and_dumps_hlo(tmp_path, capsys):
    result = demo.main(TINY + ["--out", str(tmp_path)])

    losses = result["losses"]
    assert len(losses) == 30
    assert result["loss_fell"] and losses[-1] < losses[0] - 0.2, losses
    assert result["tokens_per_s"] > 0
    assert result["tokens_per_expert"].shape == (1, 4)
    assert result["tokens_per_expert"].sum() == 8 * 32 * 2  # dropless: every (token, expert) pair is routed
    assert result["sample"].startswith(demo.SAMPLE_PROMPT) and len(result["sample"]) == len(demo.SAMPLE_PROMPT) + 20

    hlo_path = tmp_path / "train_step_hlo.txt"
    assert hlo_path.is_file()
    hlo = hlo_path.read_text()
    for op in ("gmm", "route", "permute", "unpermute"):
        target = f"moe_xla_{op}_{PLATFORM}_v1"
        assert f'custom_call_target="{target}"' in hlo
        assert result["custom_calls"][target] >= 1
    assert result["custom_calls"] == demo.moe_custom_calls(hlo)

    out = capsys.readouterr().out
    assert "device:" in out and "tokens/s" in out and f"moe_xla_gmm_{PLATFORM}_v1" in out


def test_moe_custom_calls_counts_only_moe_xla_targets():
    hlo = ('ENTRY %main (x: f32[2]) -> f32[2] {\n'
           '  %x = f32[2] parameter(0)\n'
           '  %a = f32[2] custom-call(%x), custom_call_target="moe_xla_gmm_cpu_v1"\n'
           '  %b = f32[2] custom-call(%a), custom_call_target="moe_xla_gmm_cpu_v1"\n'
           '  ROOT %c = f32[2] custom-call(%b), custom_call_target="__onednn$matmul"\n'
           '}\n')
    assert demo.moe_custom_calls(hlo) == {"moe_xla_gmm_cpu_v1": 2}


def test_corpus_is_deterministic():
    assert demo.make_corpus(1000) == demo.make_corpus(1000)
    assert len(demo.make_corpus(1000)) == 1000
