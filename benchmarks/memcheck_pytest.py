"""The GPU pytest suite under `compute-sanitizer --tool memcheck`, in chunks.

    python3 benchmarks/memcheck_pytest.py [--chunk 12] [--jobs 6] [--timeout 600] [--out DIR] [TEST_PATH ...]

One sanitizer over one pytest process for the whole suite dies in the sanitizer's own
host process after some tens of tests (session 1, LOG.md). This collects the test ids,
runs them `--chunk` at a time, each chunk in its own `compute-sanitizer --tool memcheck
--error-exitcode 86 python3 -m pytest ...`, `--jobs` chunks at once on the one GPU, and
reports per chunk: pytest's summary, the sanitizer's ERROR SUMMARY and the exit status.
Exit status 0 only when every chunk passed with 0 sanitizer errors. Logs go to --out.
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


def run_chunk(index, ids, args, env):
    log = args.out / f"memcheck_chunk{index:03d}.log"
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        text, rc = (err.stdout or b"").decode() + (err.stderr or b"").decode() + "\nTIMEOUT", "timeout"
    log.write_text(text)
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", text, re.M)
    return {"chunk": index, "tests": len(ids), "rc": rc, "sanitizer_errors": errors[-1] if errors else "none",
            "pytest": summary[-1] if summary else "no summary", "seconds": round(time.time() - start)}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("paths", nargs="*", default=["tests"])
    parser.add_argument("--chunk", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ids = collect(args.paths)
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    # Several processes share the GPU: no preallocation of most of its memory by each.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    print(f"{len(ids)} tests in {len(chunks)} chunks, {args.jobs} at a time", flush=True)
    ok = True
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for r in pool.map(lambda c: run_chunk(c[0], c[1], args, env), enumerate(chunks)):
            good = r["rc"] == 0 and r["sanitizer_errors"] == "0"
            ok &= good
            print(("ok  " if good else "BAD ") + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    print("memcheck pytest:", "all chunks passed with 0 errors" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
