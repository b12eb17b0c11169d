"""Draws benchmark results (the JSON files of gmm.py and moe_layer.py) as PNG bar charts of
TFLOP/s per case, each beside its JSON as <name>.png:

  gmm        moe_xla.gmm against torch._grouped_mm and jax.lax.ragged_dot, forward, and the
             backward pair (gmm + tgmm) against ragged_dot's backward; from a gmm JSON that
             has ragged_dot timings (default: the newest gmm_h200_*.json that has them)
  moe_layer  the moe_xla layer against the same layer in pure JAX (ragged_dot), the pure-JAX
             capacity layer and the dense FLOP ceiling, forward and forward+backward
             (default: the newest moe_layer_h200_*.json)

    python benchmarks/plots.py [--results benchmarks/results] [--out DIR (default: --results)]
                               [--gmm FILE] [--moe-layer FILE]

"Newest" is by the date in the file's "environment". A baseline's TFLOP/s count the same
FLOPs as moe_xla's (useful FLOPs, not what the baseline executes), so bar ratios are time
ratios; gmm.py records ragged_dot as times only, so its TFLOP/s are moe_xla's scaled by the
time ratio. A run that ran out of memory (or was skipped) is a missing bar labelled with the
reason. Drawn with matplotlib's object-oriented API (Figure, saved through Agg).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parent / "results"
GMM_PATTERN, GMM_COLUMNS = "gmm_h200_*.json", ("gmm_fwd_tflops", "torch_fwd_tflops", "ragged_dot_fwd_ms")
LAYER_PATTERN, LAYER_COLUMNS = "moe_layer_h200_*.json", ("moe_xla_fwd_tflops", "ragged_dot_fwd_tflops")
LAYER_IMPLEMENTATIONS = {"moe_xla": "moe_xla.moe", "ragged_dot": "pure JAX (jax.lax.ragged_dot)",
                         "capacity": "pure JAX, capacity layer (GShard)", "dense": "dense MLP, same FLOPs (ceiling)"}


def newest(directory: Path, pattern: str, columns) -> Path:
    """The file matching `pattern` in `directory` whose rows have all of `columns`, with the
    latest environment date."""
    found = []
    for path in directory.glob(pattern):
        result = json.loads(path.read_text())
        if all(any(c in row for row in result["results"]) for c in columns):
            found.append((result["environment"]["date"], path))
    if not found:
        raise FileNotFoundError(f"no {pattern} in {directory} with the columns {', '.join(columns)}")
    return max(found)[1]


def _same_flops(row: dict, base: str, ms_column: str):
    """TFLOP/s of a baseline timed in row[ms_column] doing the FLOPs of row's `base` (gmm_fwd,
    gmm_bwd); the baseline's entry itself where it holds no time (OOM, skipped)."""
    ms = row.get(ms_column)
    if not isinstance(ms, (int, float)):
        return ms
    return row[f"{base}_tflops"] * row[f"{base}_ms"] / ms


def gmm_panels(rows: list[dict]) -> dict:
    """Panel title -> {implementation: a value per row (TFLOP/s, or why there is none)}."""
    return {
        "forward": {
            "moe_xla.gmm": [r["gmm_fwd_tflops"] for r in rows],
            "torch._grouped_mm": [r.get("torch_fwd_tflops") for r in rows],
            "jax.lax.ragged_dot": [_same_flops(r, "gmm_fwd", "ragged_dot_fwd_ms") for r in rows],
        },
        "backward (d lhs + d rhs; moe_xla: gmm + tgmm)": {
            "moe_xla.gmm": [r["gmm_bwd_tflops"] for r in rows],
            "jax.lax.ragged_dot": [_same_flops(r, "gmm_bwd", "ragged_dot_bwd_ms") for r in rows],
        },
    }


def layer_panels(rows: list[dict]) -> dict:
    """Panel title -> {implementation: a value per row}, for the implementations the rows have."""
    return {title: {label: [r.get(f"{impl}_{tag}_tflops") for r in rows]
                    for impl, label in LAYER_IMPLEMENTATIONS.items() if any(f"{impl}_{tag}_tflops" in r for r in rows)}
            for tag, title in (("fwd", "forward"), ("fwd_bwd", "forward + backward"))}


def draw(path: Path, title: str, cases: list[str], panels: dict) -> None:
    """Horizontal bars, one group per case and one panel per entry of `panels`, one colour per
    implementation; each bar is labelled with its value, a missing one with the reason (OOM, ...)."""
    colors = {}
    for series in panels.values():
        for label in series:
            colors.setdefault(label, f"C{len(colors)}")
    fig = Figure(figsize=(6 * len(panels), 1.5 + 0.3 * len(cases) * max(len(s) for s in panels.values())),
                 layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    y = np.arange(len(cases))
    for ax, (panel, series) in zip(axes, panels.items(), strict=True):
        height = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            numbers = [v if isinstance(v, (int, float)) else 0.0 for v in values]
            bars = ax.barh(y - 0.4 + height * (i + 0.5), numbers, height, color=colors[label], label=label)
            ax.bar_label(bars, [f"{v:.3g}" if isinstance(v, (int, float)) else str(v or "n/a") for v in values],
                         padding=2, fontsize=7)
        ax.set(title=panel, xlabel="TFLOP/s")
        ax.margins(x=0.12)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(y, cases, fontsize=8)
    axes[0].invert_yaxis()
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def _title(what: str, path: Path, environment: dict) -> str:
    versions = ", ".join(f"{k} {environment[k]}" for k in ("jax", "torch") if k in environment)
    return f"{what} on {environment.get('device', '?')} ({versions}): {path.name}"


def _plot(path: Path, out: Path, what: str, label, panels) -> Path:
    """Draws the results JSON at `path` as out/<stem>.png: one bar group per row, labelled label(row)."""
    result = json.loads(path.read_text())
    rows = result["results"]
    png = out / f"{path.stem}.png"
    draw(png, _title(what, path, result["environment"]), [label(r) for r in rows], panels(rows))
    return png


def plot_gmm(path: Path, out: Path) -> Path:
    return _plot(path, out, "grouped GEMM", lambda r: f"{r['case']} ({r['groups']})", gmm_panels)


def plot_moe_layer(path: Path, out: Path) -> Path:
    return _plot(path, out, "MoE layer", lambda r: f"{r['case']} (T={r['T']})", layer_panels)


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description="Draw the gmm and moe_layer benchmark results as PNG bar charts.")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="where the default inputs are looked for (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: --results)")
    p.add_argument("--gmm", type=Path, default=None,
                   help=f"a gmm.py JSON (default: the newest {GMM_PATTERN} with ragged_dot timings)")
    p.add_argument("--moe-layer", type=Path, default=None,
                   help=f"a moe_layer.py JSON (default: the newest {LAYER_PATTERN})")
    args = p.parse_args(argv)
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_gmm(args.gmm or newest(args.results, GMM_PATTERN, GMM_COLUMNS), out),
               plot_moe_layer(args.moe_layer or newest(args.results, LAYER_PATTERN, LAYER_COLUMNS), out)]
    for png in written:
        print(f"wrote {png}")
    return written


if __name__ == "__main__":
    main()
