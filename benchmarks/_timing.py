"""Timing helpers shared by the benchmark scripts: inputs of the benchmark cases (cases.json),
batch timing on the device, turns that alternate implementations, trace parsing, results files."""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import glob
import gzip
import json
import math
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run from a source checkout without installing: the repository root holds moe_xla/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

CASES = json.loads((Path(__file__).parent / "cases.json").read_text())


def group_sizes(m: int, g: int, kind: str) -> np.ndarray:
    """'uniform' or 'zipf1.2' group sizes of cases.json (numpy default_rng(seed=1))."""
    rng = np.random.default_rng(seed=1)
    if kind == "uniform":
        p = np.full(g, 1.0 / g)
    elif kind == "zipf1.2":
        p = 1.0 / np.arange(1, g + 1) ** 1.2
        p /= p.sum()
    else:
        raise ValueError(f"group sizes: expected 'uniform' or 'zipf1.2', got {kind!r}")
    return rng.multinomial(m, p).astype(np.int32)


def routing_options(case) -> dict:
    """The moe_xla.moe / moe_xla.route routing arguments of a moe_layer case of cases.json."""
    return dict(top_k=case["top_k"], score=case["score"], n_groups=case.get("n_groups"),
                topk_groups=case.get("topk_groups"))


def grouped_matmul_inputs(names=None, kinds=None, m_scale: float = 1.0):
    """Yields (case, kind, lhs, rhs, group_sizes) for the grouped_matmul cases of cases.json
    (those in `names`, default all) and group-size kinds (default all): bf16 lhs [M, K] ~ N(0, 1),
    rhs [G, K, N] ~ N(0, 1/K), M scaled by m_scale, made on the device (normal()). The same
    data on every call (key 0)."""
    for i, case in enumerate(CASES["grouped_matmul"]):
        if names and case["name"] not in names:
            continue
        m, g, k, n = int(case["M"] * m_scale), case["G"], case["K"], case["N"]
        keys = jax.random.split(jax.random.fold_in(jax.random.key(0), i))
        lhs = normal(keys[0], (m, k), jnp.bfloat16)
        rhs = normal(keys[1], (g, k, n), jnp.bfloat16, 1.0 / math.sqrt(k))
        for kind in kinds or CASES["group_sizes"]:
            yield case, kind, lhs, rhs, jnp.asarray(group_sizes(m, g, kind))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def normal(key, shape, dtype, scale=1.0):
    """N(0, scale^2) in dtype, made on the device; a 3-d array one leading slice at a time
    so the f32 intermediate stays small."""
    one = lambda k, s: (jax.random.normal(k, s, jnp.float32) * scale).astype(dtype)  # noqa: E731
    if len(shape) == 3:
        return jax.lax.map(lambda k: one(k, shape[1:]), jax.random.split(key, shape[0]))
    return one(key, shape)


def moe_inputs(key, tokens: int, hidden: int, ffn: int, experts: int):
    """((x, router logits, w_in, w_out), ct) for moe_xla.moe and fwd_bwd: x [T, H] bf16 and
    logits [T, E] f32 ~ N(0, 1), w_in [E, H, 2F] and w_out [E, F, H] bf16 ~ N(0, 1/fan_in),
    the cotangent ct [T, H] bf16 ~ N(0, 1) (the layer's output dtype, as a model's backward
    hands it over)."""
    keys = jax.random.split(key, 5)
    inputs = (normal(keys[0], (tokens, hidden), jnp.bfloat16), normal(keys[1], (tokens, experts), jnp.float32),
              normal(keys[2], (experts, hidden, 2 * ffn), jnp.bfloat16, 1.0 / math.sqrt(hidden)),
              normal(keys[3], (experts, ffn, hidden), jnp.bfloat16, 1.0 / math.sqrt(ffn)))
    return inputs, normal(keys[4], (tokens, hidden), jnp.bfloat16)


def moe_input_shapes(tokens: int, hidden: int, ffn: int, experts: int, sharding):
    """moe_inputs' structure as ShapeDtypeStructs placed by `sharding`, nothing materialised
    (for compile-only memory figures of full-size cases)."""
    shapes = jax.eval_shape(lambda: moe_inputs(jax.random.key(0), tokens, hidden, ffn, experts))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), shapes)


def fwd_bwd(layer, n_inputs: int):
    """A training step's work: (y, the vector-Jacobian product of y = layer(*inputs) with ct
    w.r.t. the first n_inputs inputs), ct the last arg (cast to y's dtype: moe_inputs makes
    it so). y is an output, as the next layer of a model reads it, so XLA keeps every forward
    stage; no loss is reduced, so the step holds the layer's own work alone, like torch's
    y.backward(ct)."""

    def step(*args):
        *inputs, ct = args
        rest = inputs[n_inputs:]
        y, vjp = jax.vjp(lambda *diff: layer(*diff, *rest), *inputs[:n_inputs])
        return y, vjp(ct.astype(y.dtype))

    return step


def torch_sync(_=None):
    """Waits for the GPU work torch queued (a sync for batch_times / alternating_times)."""
    import torch

    torch.cuda.synchronize()


def torch_grouped_mm(lhs, rhs, gs):
    """A no-argument call of torch._grouped_mm on copies of (lhs [M, K], rhs [G, K, N],
    group sizes) on the GPU, the weights K-major per group (the layout it runs fastest);
    None where torch, CUDA or _grouped_mm is missing."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return None
    a = torch.from_numpy(np.array(lhs, np.float32)).to("cuda", torch.bfloat16)
    b = torch.from_numpy(np.array(rhs, np.float32)).to("cuda", torch.bfloat16)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)
    offs = torch.from_numpy(np.cumsum(np.asarray(gs)).astype(np.int32)).to("cuda")
    return lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)


def batch_times(call, sync, inner: int, reps: int = 0, seconds: float = 0.0) -> list[float]:
    """Wall seconds per call of batches of `inner` back-to-back calls of call() (so host
    dispatch overlaps device work), each ended by sync(last output): `reps` batches, and
    more until `seconds` have passed."""
    start = time.perf_counter()
    times = []
    while len(times) < reps or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(inner):
            out = call()
        sync(out)
        times.append((time.perf_counter() - t0) / inner)
    return times


def alternating_times(impls: dict, seconds: float, rounds: int, inner: int = 20):
    """Implementations taking turns on the device, for comparisons that do not favour
    whichever runs first on a cooler GPU (under sustained load these GEMMs sit at the
    power cap and the clock drops): impls = {name: (call, sync)}; an untimed turn of each
    (compiles, and heats the GPU so that no timed turn starts on an idle one), then `rounds`
    rounds in which each runs `seconds` of batch_times batches of `inner` calls, the order
    rotating by one every round. Returns ({name: per-call seconds of every batch but each
    turn's first}, {name: [(start, end) of each timed turn]})."""
    names = list(impls)
    times = {n: [] for n in names}
    spans = {n: [] for n in names}
    for name in names:
        batch_times(*impls[name], inner, reps=1, seconds=seconds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call, sync = impls[name]
            start = time.perf_counter()
            times[name] += batch_times(call, sync, inner, reps=3, seconds=seconds)[1:]
            spans[name].append((start, time.perf_counter()))
    return times, spans


OP_COLUMNS = ["case", "op", "shape", "ms", "gbps", "fraction_of_copy"]


def op_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The command line of the benchmarks that time device ops in turns with a copy of the
    same bytes (op_rows): --out, --name, --ops, --seconds, --rounds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default=name)
    parser.add_argument("--ops", nargs="*", help="ops to measure (default: all)")
    parser.add_argument("--seconds", type=float, default=0.3, help="seconds per turn")
    parser.add_argument("--rounds", type=int, default=4)
    return parser


def op_rows(args, case: str, shape: str, ops: dict, operands: tuple, nbytes: int) -> list[dict]:
    """The ops {name: fn(*operands)} named by args.ops (all when none is), each jitted, timed
    in alternating turns (args.seconds, args.rounds); a row per op (OP_COLUMNS): median ms,
    GB/s of nbytes, and fraction_of_copy = the "copy" op's time / the op's time."""
    impls = {}
    for op, fn in ops.items():
        if args.ops and op not in args.ops:
            continue
        jitted = jax.jit(fn)
        impls[op] = (lambda jitted=jitted: jitted(*operands), jax.block_until_ready)
    times, _ = alternating_times(impls, args.seconds, args.rounds)
    seconds = {op: statistics.median(ts) for op, ts in times.items()}
    rows = []
    for op, t in seconds.items():
        row = {"case": case, "op": op, "shape": shape, "ms": t * 1e3, "gbps": nbytes / t / 1e9,
               "fraction_of_copy": seconds["copy"] / t if "copy" in seconds else None}
        print(row, flush=True)
        rows.append(row)
    return rows


def time_jax(fn, *args, reps: int = 20, inner: int = 5) -> float:
    """Median seconds per call of a jitted fn: warm up, then `reps` batch_times of `inner`
    calls, each ended by a block."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    return statistics.median(batch_times(lambda: fn(*args), jax.block_until_ready, inner, reps))


def time_jax_batched(fn, *args, reps: int = 20, batch_seconds: float = 0.05) -> float:
    """time_jax with as many calls a batch (2 to 50) as take about batch_seconds: short
    calls run many to a batch, so that the host's dispatch of a batch's first call, which
    no device work hides, weighs little in their time; long calls run 2 to a batch."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = min(50, max(2, math.ceil(batch_seconds / (time.perf_counter() - start))))
    return time_jax(fn, *args, reps=reps, inner=inner)


def trace_events(fn, args, calls: int) -> list[dict]:
    """The events (Chrome trace format) of a jax.profiler trace of `calls` back-to-back calls
    of fn(*args), after one untraced call. Call it before anything starts torch.profiler:
    the two cannot share CUPTI in one process."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        trace = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
        events = json.load(gzip.open(trace))
    return events["traceEvents"] if isinstance(events, dict) else events


def _trace_names(events):
    """({pid: process name}, {(pid, tid): thread name}) from trace_events' metadata events."""
    meta = [e for e in events if e.get("ph") == "M"]
    return ({e["pid"]: str(e["args"].get("name", "")) for e in meta if e.get("name") == "process_name"},
            {(e["pid"], e["tid"]): str(e["args"].get("name", "")) for e in meta if e.get("name") == "thread_name"})


def gpu_kernels(events) -> dict:
    """{GPU process name (one per device, e.g. /device:GPU:0): its kernels (complete "X"
    events on its stream threads), by start time} of trace_events' events; empty where the
    backend records no device kernels."""
    procs, threads = _trace_names(events)
    gpu = {pid: name for pid, name in procs.items() if "GPU" in name}
    kernels = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] in gpu and "stream" in threads.get((e["pid"], e["tid"]), "").lower():
            kernels[gpu[e["pid"]]].append(e)
    return {name: sorted(ks, key=lambda e: e["ts"]) for name, ks in sorted(kernels.items())}


def device_kernels(fn, args, calls: int):
    """(span us, Counter {kernel name: total us}) on the GPUs of `calls` back-to-back calls of
    fn(*args), from trace_events (empty where the backend records no device kernels)."""
    kernels = [e for ks in gpu_kernels(trace_events(fn, args, calls)).values() for e in ks]
    totals = collections.Counter()
    for e in kernels:
        totals[e["name"]] += e["dur"]
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0.0
    return span, totals


_D2H = re.compile(r"dtoh|d2h|devicetohost", re.IGNORECASE)
_D2D = re.compile(r"dtod|d2d|devicetodevice", re.IGNORECASE)


def host_syncs(events, steps: int) -> dict:
    """Per-step counts, in trace_events' events of `steps` steps, of: d2h_copies,
    device-to-host memory copies on the GPUs (CUPTI memcpy activity named D2H / DtoH: XLA:GPU
    copies a while loop's predicate to the host and waits for it before each iteration, so
    each one is a host synchronisation; the trace does not record the wait itself);
    d2d_copies, device-to-device copies outside kernels (e.g. loop carries); kernels, the
    kernels run; summed over the GPUs. And "names": the names behind each count (for
    reading the trace by hand)."""
    procs, threads = _trace_names(events)
    counts, names = collections.Counter(), collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") != "X":
            continue
        name, on_gpu = e["name"], "gpu" in procs.get(e["pid"], "").lower()
        stream = "stream" in threads.get((e["pid"], e["tid"]), "").lower()
        if on_gpu and "memcpy" in name.lower() and _D2H.search(name):
            kind = "d2h_copies"
        elif on_gpu and "memcpy" in name.lower() and _D2D.search(name):
            kind = "d2d_copies"
        elif on_gpu and stream and "memcpy" not in name.lower() and "memset" not in name.lower():
            kind = "kernels"
        else:
            continue
        counts[kind] += 1
        names[kind][name[:60]] += 1
    row = {k: counts[k] / steps for k in ("d2h_copies", "d2d_copies", "kernels")}
    row["names"] = {k: dict(v.most_common(8)) for k, v in names.items() if k != "kernels"}
    return row


def time_torch(fn, reps: int = 20, inner: int = 5) -> float:
    """Median seconds per call with CUDA events, same scheme as time_jax."""
    import torch

    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemory" in type(err).__name__


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    return env


def write_results(out_dir: Path, name: str, env: dict, rows: list[dict], columns: list[str]) -> None:
    """Writes <name>.json and <name>.md (a table of `columns`) under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    lines = [f"# {name}", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def compiled_memory_bytes(compiled) -> int | None:
    """Peak-memory estimate of a compiled executable (`jax.jit(f).lower(...).compile()`):
    memory_analysis() temp + argument + output bytes (aliasing not subtracted), or None
    where the backend gives no analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes)


def fwd_bwd_memory_bytes(layer, inputs, ct) -> int | None:
    """compiled_memory_bytes of jax.jit(fwd_bwd(layer)) on (abstract or concrete) inputs and ct."""
    return compiled_memory_bytes(jax.jit(fwd_bwd(layer, len(inputs))).lower(*inputs, ct).compile())


def gib(nbytes):
    """Bytes in GiB; None stays None (no memory analysis)."""
    return None if nbytes is None else nbytes / 2**30
