"""Benchmark: device-to-host synchronisations of one forward+backward step of the MoE layer,
counted in a profiler trace, and the host's time per step, for moe() and for the
expert-parallel layer on a one-device mesh without and with capacity_factor.

    python benchmarks/ep_host_syncs.py [--out benchmarks/results] [--case qwen3-30b-a3b]
                                       [--tokens 4096] [--steps 10] [--capacity-factors 1.25 0.25]
                                       [--host-reps 7] [--graph-loops]

What it counts, per step (events of `--steps` back-to-back steps / steps):
  while_loops  while instructions in the compiled step's HLO;
  d2h_copies   device-to-host memory copies on the GPU (CUPTI memcpy activity named
               D2H / DtoH): XLA:GPU copies a while loop's predicate to the host and waits
               for it before each iteration, so each one is a host synchronisation (the
               trace does not record the wait itself: its driver calls are graph launches
               and kernel launches);
  d2d_copies   device-to-device copies outside kernels (e.g. loop carries);
  kernels      kernels run, for scale.
And from the optimised HLO (any platform, no run): launches, the instructions that can
launch work, counted once each outside fused and reducer computations (fusions, custom
calls, copies, scatters, ...; not parameters, tuples, bitcasts, constants or the calls and
loops that only hold others). On XLA:GPU these become the step's CUDA-graph nodes, whose
count the host pays to update and launch every step.
The batch's final block_until_ready is outside the steps and not counted. And the host's
time per step (host_ms: the median, over --host-reps batches of --steps back-to-back steps
with the device drained before each, of the wall time to enqueue one step, so the host
waits only on itself (host_ms's docstring); the layers take turns,
a batch each, so that they share the host's drift), with its ratio to moe()'s (host_vs_moe): a
step that the host drives iteration by iteration, or that reads back a predicate, costs
host time here even where the trace shows no copy. temp_mib: the compiled
step's temporary buffers (XLA's memory analysis). With --graph-loops every
step is also built with while loops and conditionals in XLA:GPU's command buffers (column
command_buffers), which runs a loop of known trip count without the host.

With one peer, capacity_factor 1.25 sizes the exchange for the worst case (one round, no
loop) and 0.25 makes the overflow rounds run: a loop of a trip count fixed by the shapes
(moe_xla/ep/rounds.py), once forward and once backward. XLA:GPU launches each of its
iterations from the host but reads nothing back, so both rows should show 0 D2H copies
(before, the rounds were a lax.while_loop whose predicate XLA:GPU read back to the host
each iteration: one D2H copy and wait per round); what the 0.25 row adds over the 1.25
row is the loops themselves, their loop-carry copies and the R - 1 rounds' kernels.
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from pathlib import Path

from _timing import CASES, environment, fwd_bwd, host_syncs, moe_inputs, routing_options, trace_events, write_results

import jax
import numpy as np
from jax.sharding import Mesh

import moe_xla


# XLA:GPU's command buffer kinds with while loops and conditionals added (CUDA graph
# conditional nodes): a loop of known trip count then runs inside the step's graph instead of
# being launched from the host iteration by iteration.
GRAPH_LOOPS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


# Opcodes that launch nothing themselves.
_HOLDERS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "call", "while", "conditional",
            "after-all", "partition-id", "replica-id"}


def launches(hlo: str) -> int:
    """Instructions of an optimised HLO module that can launch work (module docstring):
    those of every computation no fusion or reducer calls (`calls=` of a fusion,
    `to_apply=` of a reduce, scatter, sort, ...)."""
    inner = set(re.findall(r" fusion\(.*?calls=%?([\w.-]+)", hlo)) | set(re.findall(r"to_apply=%?([\w.-]+)", hlo))
    count, skipping = 0, False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.-]+) .*\{$", line)
        if head and not line.startswith(" "):
            skipping = head.group(1) in inner
            continue
        op = re.search(r"= (?:\([^=]*\)|\S+) ([\w-]+)\(", line)
        if op and not skipping and op.group(1) not in _HOLDERS:
            count += 1
    return count


def count_syncs(fn, args, steps: int) -> dict:
    """Per-step counts of the trace events described in the module docstring
    (_timing.host_syncs), and the names behind each count (for reading the trace by hand)."""
    return host_syncs(trace_events(fn, args, steps), steps)


def host_ms(calls: dict, steps: int, reps: int) -> dict:
    """{name: median wall milliseconds for the host to enqueue one call of fn(*args)} for
    calls {name: (fn, args)} (a call returns before the device finishes). Each rep enqueues
    `steps` calls back to back, the device drained before it, and each call is timed on its
    own: the median over every call of every rep leaves out the host's rare stalls (a
    garbage collection, a descheduled thread) that a batch's mean keeps. `steps` must stay
    below the depth of the dispatch queue, or the late calls wait for the device (with 50
    qwen3-30b-a3b steps at 4096 tokens every layer measured the device's time, LOG.md
    session 50). The layers take turns, one batch each, in an order reversed every rep
    (A B C, C B A, ...), so a drift of the host's speed over the run reaches every layer
    alike instead of whichever ran last."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in calls}
    order = list(calls)
    for _ in range(reps):
        for name in order:
            fn, args = calls[name]
            for _ in range(steps):
                start = time.perf_counter()
                out = fn(*args)  # earlier steps' outputs freed as they finish: the last one's wait covers all
                times[name].append((time.perf_counter() - start) * 1e3)
            jax.block_until_ready(out)
        order.reverse()
    return {name: float(np.median(ts)) for name, ts in times.items()}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--case", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--capacity-factors", type=float, nargs="*", default=[1.25, 0.25])
    parser.add_argument("--host-reps", type=positive_int, default=7)
    parser.add_argument("--graph-loops", action="store_true",
                        help="also compile every step with while loops and conditionals in XLA:GPU's command buffers")
    parser.add_argument("--name", default="ep_host_syncs")
    args = parser.parse_args()
    case = next(c for c in CASES["moe_layer"] if c["name"] == args.case)
    inputs, ct = moe_inputs(jax.random.key(0), args.tokens, case["H"], case["F"], case["E"])
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    opts = dict(routing_options(case), activation="swiglu")
    layers = {"moe()": dict(), "ep, no capacity_factor": dict(mesh=mesh, expert_axis="ep")}
    for cf in args.capacity_factors:
        layers[f"ep, capacity_factor {cf:g}"] = dict(mesh=mesh, expert_axis="ep", capacity_factor=cf)
    builds = {"default": {}}
    if args.graph_loops:
        builds["+while,conditional"] = {"xla_gpu_enable_command_buffer": GRAPH_LOOPS}
    rows, steps = [], {}
    for (name, extra), (build, options) in itertools.product(layers.items(), builds.items()):
        layer = lambda *a, extra=extra: moe_xla.moe(*a, **opts, **extra)  # noqa: E731
        step = jax.jit(fwd_bwd(layer, 4)).lower(*inputs, ct).compile(compiler_options=options)
        hlo = step.as_text()
        rows.append({"layer": name, "command_buffers": build, "case": case["name"], "tokens": args.tokens,
                     "while_loops": len(re.findall(r"\swhile\(", hlo)), "launches": launches(hlo),
                     **count_syncs(step, (*inputs, ct), args.steps),
                     "temp_mib": step.memory_analysis().temp_size_in_bytes / 2 ** 20})
        steps[name, build] = (step, (*inputs, ct))
    host = host_ms(steps, args.steps, args.host_reps)
    for row in rows:
        row["host_ms"] = host[row["layer"], row["command_buffers"]]
        row["host_vs_moe"] = row["host_ms"] / host["moe()", row["command_buffers"]]
        print(row, flush=True)
    env = environment()
    env["steps"] = args.steps
    write_results(args.out, args.name, env, rows,
                  ["layer", "command_buffers", "tokens", "while_loops", "launches", "d2h_copies", "d2d_copies", "kernels",
                   "host_ms", "host_vs_moe", "temp_mib"])


if __name__ == "__main__":
    main()
