"""Acceptance run: the demo trained with FP8 blockwise expert products against the same run
without, same seed and arguments (issue 15 item 7: the mean loss over the last 50 steps
within 2% of bf16's).

    python benchmarks/demo_fp8_vs_bf16.py [--out DIR] [--tolerance 0.02] [-- DEMO ARGS ...]

Runs `python3 -m moe_xla.demo DEMO_ARGS --out DIR/demo_<run>` once per run, one process each
(each gets the device to itself): "bf16" (the demo's default arithmetic; bf16 with --dtype
bfloat16), "fp8_blockwise" (the same arguments plus --quantization fp8_blockwise) and
"fp8_blockwise_fp8_wgrad" (FP8 weight gradients too). The DEMO ARGS after `--` go to every
run unchanged (so both have the same --seed, default 0);
without them, the DEMO_ARGS of benchmarks/gpu_check.sh. Each run's stdout goes to
DIR/demo_<run>.log; its summary.json gives:

    final_loss   the mean loss over the last 50 steps (all steps of a shorter run)
    ms_per_step  training steps 2..N, checkpoint saving excluded (the demo's timing)

Writes DIR/demo_fp8_vs_bf16_<platform>.json and .md (the runs and each FP8 run's relative
difference (fp8 - bf16) / bf16 of the final losses). Exit status 0 when every run succeeded
and every |relative difference| <= --tolerance, else 1. This script imports no jax itself, so the
runs are not sharing the device with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/gpu_check.sh's DEMO_ARGS (the GPU configuration the demo step runs).
GPU_DEMO_ARGS = ["--steps", "300", "--batch", "32", "--seq", "256", "--hidden", "512", "--heads", "8",
                 "--experts", "32", "--top-k", "4", "--layers", "4", "--dtype", "bfloat16"]
RUNS = {"bf16": [], "fp8_blockwise": ["--quantization", "fp8_blockwise"],
        "fp8_blockwise_fp8_wgrad": ["--quantization", "fp8_blockwise_fp8_wgrad"]}
# Options the script sets itself.
OWN = ("--out", "--quantization", "--resume")
COLUMNS = ["run", "quantization", "dtype", "final_loss", "final_loss_window", "first_loss", "last_loss",
           "ms_per_step", "tokens_per_s", "exit_status", "wall_s"]


def run_demo(name: str, demo_args: list[str], out: Path) -> dict:
    """One demo process; its summary.json with run, exit_status and wall_s added (summary
    fields None when it wrote none)."""
    run_out = out / f"demo_{name}"
    summary_path = run_out / "summary.json"
    summary_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "moe_xla.demo", *demo_args, *RUNS[name], "--out", str(run_out)]
    print(f"--- {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"demo_{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary.update(run=name, exit_status=rc, wall_s=wall)
    if not summary.get("model"):
        print(f"    exit status {rc}, no summary.json; the end of {out / f'demo_{name}.log'}:")
        print("".join(open(out / f"demo_{name}.log").readlines()[-20:]))
    else:
        summary["dtype"] = summary["model"]["dtype"]
        print(f"    exit status {rc}, final loss {summary['final_loss']:.4f} (mean of the last "
              f"{summary['final_loss_window']} steps), {summary['ms_per_step']:.1f} ms/step, {wall:.0f} s in all",
              flush=True)
    return summary


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo_fp8_vs_bf16_out"),
                        help="the runs' directories, logs and the results (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="the largest |fp8 - bf16| / bf16 of the final losses that passes (default: %(default)s)")
    parser.add_argument("demo_args", nargs="*", metavar="DEMO_ARG",
                        help="after --: the demo's arguments for both runs (default: gpu_check.sh's DEMO_ARGS)")
    args = parser.parse_args(argv)
    demo_args = args.demo_args or GPU_DEMO_ARGS
    own = [a for a in demo_args if a.split("=")[0] in OWN]
    if own:
        parser.error(f"{own}: the script sets these itself")
    args.out.mkdir(parents=True, exist_ok=True)

    runs = [run_demo(name, demo_args, args.out) for name in RUNS]
    bf16, fp8_runs = runs[0], runs[1:]
    ok = all(r["exit_status"] == 0 and r.get("final_loss") is not None for r in runs)
    rel = {r["run"]: (r["final_loss"] - bf16["final_loss"]) / bf16["final_loss"] for r in fp8_runs} if ok else None
    passed = ok and all(abs(v) <= args.tolerance for v in rel.values())
    speedup = {r["run"]: bf16["ms_per_step"] / r["ms_per_step"] for r in fp8_runs} if ok else None

    first = next((r for r in runs if r.get("device")), bf16)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": first.get("device") or "unknown", "jax": first.get("jax"), "python": platform.python_version()}
    name = f"demo_fp8_vs_bf16_{first.get('platform') or 'unknown'}"
    result = {"environment": env, "demo_args": demo_args, "results": [{c: r.get(c) for c in COLUMNS} for r in runs],
              "relative_difference": rel, "tolerance": args.tolerance, "fp8_speedup": speedup, "passed": passed}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# {name}", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             f"demo arguments (every run): `{' '.join(demo_args)}`", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in runs]
    lines.append("")
    if rel is None:
        lines.append("relative difference of the final losses: n/a (a run failed)")
    else:
        for run, v in rel.items():
            lines.append(f"{run}: relative difference of the final losses (fp8 - bf16) / bf16 {100 * v:+.2f}%, "
                         f"ms/step bf16 / fp8 {speedup[run]:.2f}x")
    lines.append(f"tolerance {100 * args.tolerance:.1f}%: {'PASSED' if passed else 'FAILED'}")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))
    print(f"results: {args.out / name}.json, .md")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
