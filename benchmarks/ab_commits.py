"""Benchmark: two checkouts of moe_xla (an old and a new commit, each with its built
library) timed by the same benchmark scripts in alternating turns on one device, and
their speed ratios per case.

    python benchmarks/ab_commits.py --old DIR --new DIR [--out benchmarks/results] [--turns 2]
        [--gmm-args "--skip-ragged-dot --turn-seconds 0.3 --rounds 3"]
        [--moe-args "--skip ragged_dot capacity dense --reps 20"] [--benches gmm moe_layer]

Each checkout DIR holds moe_xla/ (its Python package), benchmarks/ and
moe_xla/_native/libmoe_xla.so. A turn runs one checkout's benchmarks/gmm.py and then its
benchmarks/moe_layer.py in a fresh process (two versions of the package and of its FFI
targets cannot share one), with MOE_XLA_LIBRARY pointing at that checkout's library. The
turns go old, new, new, old, ... (ABBA), so a drift of the GPU's temperature or clock over
the run favours neither; every turn starts on a GPU the previous turn left hot.

Reported per case and metric: new/old speed = median over the old turns of the time /
median over the new turns. For the gmm forward, which each turn also times against
torch._grouped_mm in alternating turns inside the process, the ratio of the two
fwd_vs_torch medians is reported as well: it cancels any clock difference between turns.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import environment, write_results

# (script, its arguments option here, the timed metrics of its rows: lower is better)
SCRIPTS = {
    "gmm": ("gmm.py", "gmm_args", ("gmm_fwd_ms", "gmm_bwd_ms")),
    "moe_layer": ("moe_layer.py", "moe_args", ("moe_xla_fwd_ms", "moe_xla_fwd_bwd_ms", "fp8_fwd_ms", "fp8_fwd_bwd_ms")),
}


def _run_turn(tree: Path, script: str, extra: str, out: Path) -> list[dict]:
    env = dict(os.environ, MOE_XLA_LIBRARY=str(tree / "moe_xla" / "_native" / "libmoe_xla.so"),
               PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the script puts its own checkout first on sys.path
    cmd = [sys.executable, str(tree / "benchmarks" / script), "--out", str(out), *shlex.split(extra)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=tree)
    return json.loads((out / f"{Path(script).stem}.json").read_text())["results"]


def _key(row) -> str:
    return f"{row['case']}/{row['groups']}" if "groups" in row else row["case"]


def compare(turns: dict, benches) -> list[dict]:
    """turns = {label: [{bench: rows} of one turn, ...]} for labels old and new -> one row
    per (bench, case, metric) with both medians and new/old speed."""
    out = []
    for bench in benches:
        metrics = SCRIPTS[bench][2]
        by = {label: {} for label in turns}
        for label, runs in turns.items():
            for run in runs:
                for row in run[bench]:
                    by[label].setdefault(_key(row), []).append(row)
        for case in by["old"]:
            for metric in metrics + (("fwd_vs_torch",) if bench == "gmm" else ()):
                vals = {label: [r[metric] for r in by[label].get(case, []) if isinstance(r.get(metric), float)]
                        for label in by}
                if not vals["old"] or not vals["new"]:
                    continue
                old, new = statistics.median(vals["old"]), statistics.median(vals["new"])
                # A time: old / new is the speed ratio; fwd_vs_torch is a speed already.
                speed = new / old if metric == "fwd_vs_torch" else old / new
                out.append({"bench": bench, "case": case, "metric": metric, "old": old, "new": new,
                            "new_over_old_speed": speed, "old_turns": vals["old"], "new_turns": vals["new"]})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="ab_commits")
    parser.add_argument("--turns", type=int, default=2, help="turns per checkout (order ABBA...)")
    parser.add_argument("--gmm-args", default="--skip-ragged-dot --turn-seconds 0.3 --rounds 3")
    parser.add_argument("--moe-args", default="--skip ragged_dot capacity dense --reps 20")
    parser.add_argument("--benches", nargs="*", choices=list(SCRIPTS), default=list(SCRIPTS))
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    order = [("old", "new"), ("new", "old")]
    turns = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.turns):
            for label in order[i % 2]:
                run = {}
                for bench in args.benches:
                    script, opt, _ = SCRIPTS[bench]
                    out = Path(tmp) / f"{label}{i}_{bench}"
                    run[bench] = _run_turn(trees[label], script, getattr(args, opt), out)
                turns[label].append(run)
    rows = compare(turns, args.benches)
    env = environment()
    env.update(turns=args.turns, gmm_args=args.gmm_args, moe_args=args.moe_args,
               old=str(trees["old"]), new=str(trees["new"]))
    write_results(args.out, args.name, env, rows, ["bench", "case", "metric", "old", "new", "new_over_old_speed"])
    worst = min(r["new_over_old_speed"] for r in rows)
    print(f"lowest new/old speed: {worst:.3f}")


if __name__ == "__main__":
    main()
