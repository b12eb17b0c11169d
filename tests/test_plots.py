"""benchmarks/plots.py: which results file it picks, the TFLOP/s it plots, and the PNGs it writes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from benchmarks import plots  # noqa: E402

GMM_ROW = {"case": "a.gate_up", "groups": "uniform", "gmm_fwd_ms": 2.0, "gmm_fwd_tflops": 500.0,
           "gmm_bwd_ms": 3.0, "gmm_bwd_tflops": 600.0, "torch_fwd_tflops": 490.0}


def _write(path, date, rows):
    path.write_text(json.dumps({"environment": {"date": date, "device": "NVIDIA H200", "jax": "0.11.2"},
                                "results": rows}))
    return path


@pytest.fixture
def results(tmp_path):
    """A results folder: gmm files with and without ragged_dot timings, two moe_layer files."""
    folder = tmp_path / "results"
    folder.mkdir()
    with_ragged = [dict(GMM_ROW, ragged_dot_fwd_ms=100.0, ragged_dot_bwd_ms="OOM"),
                   dict(GMM_ROW, case="b.down", ragged_dot_fwd_ms=40.0, ragged_dot_bwd_ms=30.0)]
    _write(folder / "gmm_h200_old.json", "2026-11-29T09:00:00+00:00", with_ragged)
    _write(folder / "gmm_h200_new.json", "2026-11-29T15:00 (a visit)", with_ragged)
    _write(folder / "gmm_h200_newest_no_ragged.json", "2026-11-30T10:00:00+00:00", [GMM_ROW])
    layer = {"case": "qwen3", "T": 16, "moe_xla_fwd_tflops": 400.0, "moe_xla_fwd_bwd_tflops": 450.0,
             "ragged_dot_fwd_tflops": 5.0, "ragged_dot_fwd_bwd_tflops": "OOM"}
    _write(folder / "moe_layer_h200_b.json", "2026-11-29T10:00:00+00:00", [layer])
    _write(folder / "moe_layer_h200_a.json", "2026-12-01T10:00:00+00:00", [layer, dict(layer, case="mixtral")])
    return folder


def test_newest_file_with_the_columns(results):
    assert plots.newest(results, plots.GMM_PATTERN, plots.GMM_COLUMNS).name == "gmm_h200_new.json"
    assert plots.newest(results, plots.LAYER_PATTERN, plots.LAYER_COLUMNS).name == "moe_layer_h200_a.json"
    with pytest.raises(FileNotFoundError, match="ragged_dot_fwd_ms"):
        plots.newest(results, "gmm_h200_newest*.json", plots.GMM_COLUMNS)


def test_gmm_baselines_count_the_same_flops(results):
    rows = json.loads((results / "gmm_h200_new.json").read_text())["results"]
    forward, backward = plots.gmm_panels(rows).values()
    assert forward == {"moe_xla.gmm": [500.0, 500.0], "torch._grouped_mm": [490.0, 490.0],
                       "jax.lax.ragged_dot": [500.0 * 2.0 / 100.0, 500.0 * 2.0 / 40.0]}
    assert backward == {"moe_xla.gmm": [600.0, 600.0], "jax.lax.ragged_dot": ["OOM", 600.0 * 3.0 / 30.0]}


def test_layer_panels_hold_the_implementations_measured(results):
    rows = json.loads((results / "moe_layer_h200_b.json").read_text())["results"]
    forward, fwd_bwd = plots.layer_panels(rows).values()
    assert list(forward) == list(fwd_bwd) == ["moe_xla.moe", "pure JAX (jax.lax.ragged_dot)"]
    assert list(forward.values()) == [[400.0], [5.0]]
    assert list(fwd_bwd.values()) == [[450.0], ["OOM"]]


def test_main_writes_a_png_per_input(results, tmp_path, capsys):
    out = tmp_path / "out"
    written = plots.main(["--results", str(results), "--out", str(out)])
    assert [p.name for p in written] == ["gmm_h200_new.png", "moe_layer_h200_a.png"]
    printed = capsys.readouterr().out
    for png in written:
        assert f"wrote {png}" in printed
        height, width, _ = imread(png).shape
        assert height > 200 and width > 400

    explicit = plots.main(["--gmm", str(results / "gmm_h200_old.json"), "--moe-layer",
                           str(results / "moe_layer_h200_b.json"), "--out", str(out)])
    assert [p.name for p in explicit] == ["gmm_h200_old.png", "moe_layer_h200_b.png"]
    assert all(p.is_file() for p in explicit)
