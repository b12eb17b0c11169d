"""The GPU pytest suite under `compute-sanitizer --tool memcheck`, in chunks.

    python3 benchmarks/memcheck_pytest.py [--chunk 10] [--jobs 2] [--timeout 120] [--attempts 2] [--only I,J,...] [--out DIR] [TEST_PATH ...]

One sanitizer over one pytest process for the whole suite dies in the sanitizer's own
host process after some tens of tests. This collects the test ids,
runs them `--chunk` at a time, each chunk in its own `compute-sanitizer --tool memcheck
--error-exitcode 86 python3 -m pytest ...`, `--jobs` chunks at once on the one GPU, and
reports per chunk: pytest's summary, the sanitizer's ERROR SUMMARY and the exit status.
A chunk that runs past --timeout is run again, up to --attempts runs in all (pytest's
faulthandler_timeout puts the Python stacks of a stuck test in its log), and reported as
such. Exit status 0 only when every chunk passed with 0 sanitizer errors. Logs of chunks
that did not pass go to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collect(paths):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def run_chunk(index, ids, args, env, attempt=1):
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", "-o",
           f"faulthandler_timeout={args.timeout // 2}", *ids]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        out = [b if isinstance(b, str) else (b or b"").decode() for b in (err.stdout, err.stderr)]
        text, rc = "".join(out) + "\nTIMEOUT", "timeout"
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", text, re.M)
    result = {"chunk": index, "tests": len(ids), "attempt": attempt, "rc": rc,
              "sanitizer_errors": errors[-1] if errors else "none", "pytest": summary[-1] if summary else "no summary",
              "seconds": round(time.time() - start)}
    if not (rc == 0 and result["sanitizer_errors"] == "0"):
        (args.out / f"memcheck_chunk{index:03d}_attempt{attempt}.log").write_text(text)
    if rc == "timeout" and attempt < args.attempts:
        return [result] + run_chunk(index, ids, args, env, attempt=attempt + 1)
    return [result]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("paths", nargs="*", default=["tests"])
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=120)
    parser.add_argument("--attempts", type=int, default=2, help="runs of a chunk that times out")
    parser.add_argument("--only", type=lambda v: {int(i) for i in v.split(",")}, help="chunk indexes to run, as 3,7,9")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ids = collect(args.paths)
    chunks = list(enumerate(ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)))
    if args.only:
        chunks = [c for c in chunks if c[0] in args.only]
    # Several processes share the GPU: no preallocation of most of its memory by each. No
    # XLA autotuning: under memcheck, timing every candidate of every XLA fusion (scan, grad
    # tests) keeps one compile busy for minutes; it runs XLA's kernels, not ours. One
    # compile thread and no command buffers: with XLA's parallel compilation, compiles of
    # the grad / scan / EP tests never finished under the sanitizer (500 s; 3-37 s without).
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
             " --xla_gpu_force_compilation_parallelism=1 --xla_gpu_enable_command_buffer=").strip()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS=flags)
    print(f"{len(ids)} tests in {len(chunks)} chunks, {args.jobs} at a time", flush=True)
    ok = True
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for attempts in pool.map(lambda c: run_chunk(c[0], c[1], args, env), chunks):
            for r in attempts:
                good = r["rc"] == 0 and r["sanitizer_errors"] == "0"
                print(("ok  " if good else "BAD ") + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
            ok &= good  # the last attempt decides
    print("memcheck pytest:", "all chunks passed with 0 errors" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
