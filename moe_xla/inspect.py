"""What XLA made of a moe layer: custom calls, collectives and their schedule.

    python3 -m moe_xla.inspect                     # 8 CPU devices, expert axis "ep" of size 8
    python3 -m moe_xla.inspect --grad --mesh 2x4 --axes data,ep --dump /tmp/moe.hlo

lowers and compiles one moe_xla.moe layer (forward, or forward + backward with --grad) on
a mesh, reads the optimised, scheduled HLO of `jax.jit(f).lower(...).compile().as_text()`
(one device's program after SPMD partitioning) and prints four sections:

  custom calls   every `moe_xla_*` custom call: its HLO name, target
                 (moe_xla_<op>_<platform>_v<N>), result shapes, and the stage from its
                 op_name metadata (moe_xla/route, dispatch, gmm_in, act, gmm_out, combine,
                 shared; backward stages carry the same names under transpose(...)).
  collectives    every all-to-all, ragged-all-to-all, all-reduce, all-gather,
                 collective-permute and reduce-scatter, synchronous or as an async
                 -start/-done pair (GPU): its result shapes, bytes (the per-device result,
                 i.e. what one device receives), replica groups and stage.
  schedule       per computation, in schedule order (the order of the instructions in a
                 scheduled module is the order they run in), the custom calls, collectives
                 and calls into other computations (while loops, calls, conditionals). The
                 entry computation comes first; each other computation is labelled by what
                 calls it ("body of %while.3 in %main", ...). Positions are instruction
                 indices inside their computation.
  overlap        per collective, the grouped GEMM custom calls (moe_xla_gmm / moe_xla_tgmm,
                 also inside computations called in between) that run while it is in flight:
                   async (GPU): those scheduled between its -start and its -done, which is
                     real overlap of communication with computation;
                   sync (CPU): none can overlap, so the nearest GEMM before and after it in
                     its computation are shown, i.e. where it sits in the chain.
                 A collective with nothing between start and done is exposed: the GEMMs
                 wait for it or it waits for them.

`inspect_moe(...)` returns the same as an InspectReport (custom_calls, collectives,
schedule; str(report) is the printed text); `inspect_hlo(text)` parses any scheduled HLO
module text (e.g. a `*after_optimizations.txt` from XLA_FLAGS=--xla_dump_to=DIR).
On CPU, --devices N (default 8) sets XLA_FLAGS=--xla_force_host_platform_device_count=N
before JAX starts its backends.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field

COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-reduce", "all-gather", "collective-permute", "reduce-scatter")
GEMM_TARGETS = ("moe_xla_gmm", "moe_xla_tgmm")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


# ----------------------------------------------------------------------------- parsing

@dataclass
class Instruction:
    name: str
    shape: str          # result type as printed, e.g. "f32[8,32]" or "(f32[4,32], s32[4])"
    opcode: str
    operands: list      # operand names (without %)
    attrs: str          # the text after the operand list (calls=, metadata=, ...)
    index: int          # position in its computation's schedule

    def attr(self, key):
        m = re.search(r"\b" + re.escape(key) + r"=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    @property
    def op_name(self):
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def stage(self):
        """The moe_xla/<stage> of the op_name metadata, with transpose(...)/jvp marks kept
        short: 'gmm_in', 'gmm_in (bwd)'; '' outside moe_xla's named scopes."""
        name = self.op_name
        stages = re.findall(r"moe_xla/(\w+)", name)
        if not stages:
            return ""
        return stages[-1] + (" (bwd)" if "transpose(" in name else "")


@dataclass
class Computation:
    name: str
    entry: bool
    instructions: list = field(default_factory=list)


def _matching(text, start):
    """Index just past the bracket that closes text[start] ('(' or '{')."""
    open_, close = text[start], {"(": ")", "{": "}", "[": "]"}[text[start]]
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def parse_hlo(text: str) -> dict:
    """{computation name: Computation} of an HLO module's text, in textual order."""
    comps, cur = {}, None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = Computation(m.group(2), bool(m.group(1)))
                comps[cur.name] = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        rest = line[m.end():]
        if rest.startswith("("):
            end = _matching(rest, 0)
        else:
            end = rest.find(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        # layouts {1,0} after the dims are part of the type; drop them for reading.
        shape = re.sub(r"\{[^{}]*\}", "", shape)
        om = re.match(r"([\w\-]+)\(", rest)
        if not om:
            continue
        close = _matching(rest, om.end() - 1)
        operands = re.findall(r"%([\w.\-]+)", rest[om.end():close - 1])
        cur.instructions.append(Instruction(m.group(1), shape, om.group(1), operands, rest[close:],
                                            len(cur.instructions)))
    return comps


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a (tuple) type string such as '(f32[4,32], s32[4])'."""
    total = 0.0
    for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return int(total)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _short_shape(shape: str, limit: int = 60) -> str:
    """'(f32[4,32], f32[4,32], ...)' -> '8 x f32[4,32]' when all equal; truncated otherwise."""
    arrays = re.findall(r"\w+\[[\d,]*\]", shape)
    if shape.startswith("(") and len(arrays) > 1 and len(set(arrays)) == 1:
        return f"{len(arrays)} x {arrays[0]}"
    return shape if len(shape) <= limit else shape[:limit - 3] + "..."


# ----------------------------------------------------------------------------- report

@dataclass
class CustomCall:
    name: str
    target: str
    shape: str
    operand_shapes: list
    stage: str
    computation: str
    index: int

    @property
    def is_gemm(self):
        return self.target.startswith(GEMM_TARGETS)


@dataclass
class Collective:
    name: str           # the sync op, or the -start of an async pair
    kind: str           # "all-to-all", "all-reduce", ...
    is_async: bool
    done: str | None    # the -done of an async pair
    shape: str          # the result (of the -done when async)
    bytes: int
    replica_groups: str
    stage: str
    computation: str
    start: int          # schedule positions in `computation`
    end: int
    overlapped: list = field(default_factory=list)  # async: GEMMs scheduled between start and done
    before: str | None = None                       # sync: the nearest GEMM before it
    after: str | None = None                        # sync: the nearest GEMM after it


@dataclass
class Event:
    index: int
    kind: str           # "custom-call", "collective-start", "collective-done", "collective", "call"
    name: str
    text: str


@dataclass
class ScheduledComputation:
    name: str
    label: str
    events: list


@dataclass
class InspectReport:
    config: dict
    platform: str
    custom_calls: list
    collectives: list
    schedule: list

    def count(self, kind: str) -> int:
        """Number of collectives of one kind ("all-to-all", ...)."""
        return sum(c.kind == kind for c in self.collectives)

    def __str__(self) -> str:
        return format_report(self)


# Roles of called computations whose instructions are part of the calling instruction: the
# body of a fusion, the wrapped op of a long-form async-start. They are searched for custom
# calls (GPU may wrap those), but not scheduled or searched for collectives of their own.
_PART_OF_CALLER = ("fused", "wrapped")


def _called(ins: Instruction):
    """(role, computation) pairs an instruction runs; the to_apply of a reduce, all-reduce,
    sort, ... (reducers and comparators) is not listed."""
    out = []
    if ins.opcode == "while":
        out += [("condition", ins.attr("condition")), ("body", ins.attr("body"))]
    elif ins.opcode == "call":
        out += [("called", ins.attr("to_apply"))]
    elif ins.opcode == "async-start":
        out += [("wrapped", ins.attr("calls"))]
    elif ins.opcode == "conditional":
        m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []
        names = names or [n for n in (ins.attr("true_computation"), ins.attr("false_computation")) if n]
        out += [(f"branch {i}", n) for i, n in enumerate(names)]
    elif ins.opcode == "fusion":
        out += [("fused", ins.attr("calls"))]
    return [(r, c) for r, c in out if c]


def _async_collectives(comps) -> dict:
    """{name: wrapped collective} of every async-start, -update and -done of a collective in
    the long form (`async-start(...), calls=%wrapped`, the -update/-done taking the previous
    op of the chain as operand). XLA prints its async collectives in the short form
    (all-to-all-start / all-to-all-done), which needs no such lookup."""
    wrapped = {}
    for comp in comps.values():
        for ins in comp.instructions:
            if ins.opcode == "async-start":
                callee = comps.get(ins.attr("calls") or "")
                inner = [i for i in callee.instructions if i.opcode in COLLECTIVES] if callee else []
                if inner:
                    wrapped[ins.name] = inner[0]
            elif ins.opcode in ("async-update", "async-done") and ins.operands and ins.operands[0] in wrapped:
                wrapped[ins.name] = wrapped[ins.operands[0]]
    return wrapped


def _collective_kind(ins: Instruction, async_collectives: dict):
    """(kind, phase, op) of a collective: phase 'sync', 'start', 'update' or 'done'; op the
    instruction whose attributes (replica_groups) describe it: the wrapped collective of a
    long-form async op (async_collectives, see _async_collectives), else ins itself. None if
    ins is no collective."""
    op = ins.opcode
    if op in COLLECTIVES:
        return op, "sync", ins
    for suffix in ("-start", "-done"):
        if op.endswith(suffix) and op[: -len(suffix)] in COLLECTIVES:
            return op[: -len(suffix)], suffix[1:], ins
    inner = async_collectives.get(ins.name)
    if inner is not None:
        return inner.opcode, op[len("async-"):], inner
    return None


def inspect_hlo(text: str, config: dict | None = None, platform: str = "") -> InspectReport:
    """An InspectReport of a scheduled HLO module's text (compiled.as_text(), or an XLA dump)."""
    comps = parse_hlo(text)
    shapes = {i.name: i.shape for c in comps.values() for i in c.instructions}
    entry = next((c for c in comps.values() if c.entry), None)
    asyncs = _async_collectives(comps)

    # computations reached from the entry through while / call / conditional (and fusions and
    # async-wrapped ops, searched for custom calls only), with labels
    labels, order, part_of_caller = {}, [], set()

    def visit(comp, label):
        if comp.name in labels:
            return
        labels[comp.name] = label
        order.append(comp)
        for ins in comp.instructions:
            for role, callee in _called(ins):
                if callee in comps:
                    if role in _PART_OF_CALLER:
                        part_of_caller.add(callee)
                    visit(comps[callee], f"{role} of %{ins.name} in %{comp.name}")

    if entry is not None:
        visit(entry, "entry")

    custom_calls, by_comp_calls = [], {}
    for comp in order:
        for ins in comp.instructions:
            if ins.opcode == "custom-call":
                m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                if m and m.group(1).startswith("moe_xla"):
                    cc = CustomCall(ins.name, m.group(1), ins.shape, [shapes.get(o, "?") for o in ins.operands],
                                    ins.stage, comp.name, ins.index)
                    custom_calls.append(cc)
                    by_comp_calls.setdefault(comp.name, []).append(cc)

    reach_memo = {}

    def reach(name, seen=()):
        """(GEMM custom calls, whether any moe_xla custom call or collective) of a computation
        and of everything it calls; one memoized walk of the call graph serves both."""
        if name in reach_memo:
            return reach_memo[name]
        calls = by_comp_calls.get(name, [])
        gemms, events = [c.name for c in calls if c.is_gemm], bool(calls)
        for ins in comps[name].instructions if name in comps else []:
            events = events or _collective_kind(ins, asyncs) is not None
            for _, callee in _called(ins):
                if callee in comps and callee not in seen:
                    callee_gemms, callee_events = reach(callee, seen + (name,))
                    gemms, events = gemms + callee_gemms, events or callee_events
        reach_memo[name] = (gemms, events)
        return reach_memo[name]

    def gemms_at(comp, ins):
        if ins.opcode == "custom-call":
            return [c.name for c in by_comp_calls.get(comp.name, []) if c.name == ins.name and c.is_gemm]
        return [g for _, callee in _called(ins) if callee in comps for g in reach(callee)[0]]

    collectives, schedule = [], []
    for comp in order:
        if comp.name in part_of_caller:
            continue
        events, starts = [], {}
        gemm_pos = [(ins.index, g) for ins in comp.instructions for g in gemms_at(comp, ins)]
        for ins in comp.instructions:
            kind = _collective_kind(ins, asyncs)
            if kind is not None:
                k, phase, op = kind
                groups = re.search(r"replica_groups=(\{[^=]*?\}\}|\{\}|\[[^\]]*\]<=\[[^\]]*\][^,]*)", op.attrs)
                groups = groups.group(1) if groups else ""
                stage = ins.stage or op.stage
                if phase == "sync":
                    col = Collective(ins.name, k, False, None, ins.shape, shape_bytes(ins.shape), groups, stage,
                                     comp.name, ins.index, ins.index)
                    before = [g for p, g in gemm_pos if p < ins.index]
                    after = [g for p, g in gemm_pos if p > ins.index]
                    col.before, col.after = (before[-1] if before else None), (after[0] if after else None)
                    collectives.append(col)
                    events.append(Event(ins.index, "collective", ins.name,
                                        f"{k} {_short_shape(ins.shape)} ({_fmt_bytes(col.bytes)})"))
                elif phase == "start":
                    col = Collective(ins.name, k, True, None, ins.shape, 0, groups, stage, comp.name,
                                     ins.index, ins.index)
                    starts[ins.name] = col
                    collectives.append(col)
                    events.append(Event(ins.index, "collective-start", ins.name, f"{k} start"))
                elif phase == "update" and ins.operands[0] in starts:  # the -done takes the last -update
                    starts[ins.name] = starts.pop(ins.operands[0])
                elif phase == "done":
                    col = next((starts.pop(o) for o in ins.operands if o in starts), None)
                    if col is None:
                        continue
                    col.done, col.end, col.shape, col.bytes = ins.name, ins.index, ins.shape, shape_bytes(ins.shape)
                    col.overlapped = [g for p, g in gemm_pos if col.start < p < col.end]
                    events.append(Event(ins.index, "collective-done", ins.name,
                                        f"{k} done {_short_shape(ins.shape)} ({_fmt_bytes(col.bytes)}) "
                                        f"[started at {col.start}]"))
                continue
            for cc in by_comp_calls.get(comp.name, []):
                if cc.name == ins.name:
                    events.append(Event(ins.index, "custom-call", ins.name,
                                        f"{cc.target} -> {_short_shape(cc.shape)}" + (f"  [{cc.stage}]" if cc.stage
                                                                                      else "")))
            for role, callee in _called(ins):
                if role not in _PART_OF_CALLER and callee in comps and reach(callee)[1]:
                    events.append(Event(ins.index, "call", ins.name, f"{ins.opcode} -> {role} %{callee}"))
        if events:
            schedule.append(ScheduledComputation(comp.name, labels[comp.name], events))
    return InspectReport(config or {}, platform, custom_calls, collectives, schedule)


def format_report(r: InspectReport) -> str:
    out = []
    if r.config:
        out.append("moe layer: " + ", ".join(f"{k}={v}" for k, v in r.config.items()))
    if r.platform:
        out.append(f"platform: {r.platform}")
    if r.platform == "cpu" and str(r.config.get("dtype", "")) in ("bfloat16", "float16"):
        out.append("note: XLA:CPU runs 16-bit collectives in float32, so their sizes below are twice what a GPU sends")
    out.append("")
    out.append(f"== moe_xla custom calls ({len(r.custom_calls)}) ==")
    for c in r.custom_calls:
        out.append(f"  %{c.name:<24} {c.target:<28} {_short_shape(c.shape, 48):<48} "
                   f"stage={c.stage or '-'}  [{c.computation}]")
    out.append("")
    kinds = {}
    for c in r.collectives:
        kinds.setdefault(c.kind, [0, 0])
        kinds[c.kind][0] += 1
        kinds[c.kind][1] += c.bytes
    summary = ", ".join(f"{n} {k} ({_fmt_bytes(b)})" for k, (n, b) in kinds.items()) or "none"
    out.append(f"== collectives ({len(r.collectives)}: {summary}) ==")
    for c in r.collectives:
        mode = "async" if c.is_async else "sync"
        out.append(f"  %{c.name:<24} {c.kind:<18} {mode:<5} {_short_shape(c.shape, 40):<40} "
                   f"{_fmt_bytes(c.bytes):>9}  stage={c.stage or '-'}  groups={c.replica_groups or '-'}")
    out.append("")
    out.append("== schedule (instruction position: event) ==")
    for s in r.schedule:
        out.append(f"-- %{s.name} ({s.label})")
        for e in s.events:
            mark = {"collective": "<>", "collective-start": ">>", "collective-done": "<<", "call": "->",
                    "custom-call": "  "}[e.kind]
            out.append(f"  {e.index:5d} {mark} %{e.name}: {e.text}")
    out.append("")
    out.append("== overlap (grouped GEMMs in flight with each collective) ==")
    for c in r.collectives:
        if c.is_async:
            what = ("overlaps " + ", ".join("%" + g for g in c.overlapped)) if c.overlapped else \
                "exposed: no grouped GEMM between start and done"
            out.append(f"  %{c.name} ({c.kind}, {c.computation} {c.start}..{c.end}): {what}")
        else:
            out.append(f"  %{c.name} ({c.kind}, sync at {c.computation}:{c.start}): after "
                       f"{'%' + c.before if c.before else '-'}, before {'%' + c.after if c.after else '-'}")
    out.append("  (sync collectives overlap nothing; on GPU they are async and list what runs under them)")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the moe layer

def inspect_moe(*, mesh=None, mesh_shape=None, axes=("ep",), expert_axis="ep", tokens=64, hidden=32, ffn=64,
                experts=16, top_k=2, dtype="float32", activation="swiglu", transport="auto", dedup=True,
                capacity_factor=None, chunks=1, grad=False, dump=None) -> InspectReport:
    """Compile one moe_xla.moe layer on a mesh and report its custom calls, collectives and
    schedule (module docstring). mesh: a jax.sharding.Mesh, or mesh_shape (default: every
    device on one axis) with axis names `axes`. x [tokens, hidden] is split over the mesh,
    w_in [experts, hidden, 2 ffn] (gated) and w_out [experts, ffn, hidden] over expert_axis.
    grad: compile jax.grad of sum(y^2) w.r.t. x, logits and both weights instead."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import moe_xla

    axes = tuple(axes)
    if mesh is None:
        shape = tuple(mesh_shape) if mesh_shape is not None else (len(jax.devices()),)
        if len(shape) != len(axes):
            raise ValueError(f"inspect: the mesh shape {shape} (--mesh / mesh_shape; default: all devices on one "
                             f"axis) and the axis names {axes} (--axes / axes) differ in length; "
                             f"e.g. --mesh 2x4 --axes data,ep")
        need = int(np.prod(shape))
        if need > len(jax.devices()):
            raise ValueError(f"inspect: a {shape} mesh needs {need} devices, JAX has {len(jax.devices())} "
                             f"(on CPU pass --devices {need} or set XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={need} before JAX starts)")
        mesh = Mesh(np.array(jax.devices()[:need]).reshape(shape), axes)
    names = tuple(mesh.axis_names)
    dt = jnp.dtype(dtype)
    gated = activation in ("swiglu", "geglu")
    token_axes = tuple(a for a in names if a != expert_axis) + (expert_axis,)
    spec_tok, spec_exp = P(token_axes), P(expert_axis)

    def arg(shape, d, spec):
        return jax.ShapeDtypeStruct(shape, d, sharding=NamedSharding(mesh, spec))

    args = (arg((tokens, hidden), dt, spec_tok), arg((tokens, experts), jnp.float32, spec_tok),
            arg((experts, hidden, (2 if gated else 1) * ffn), dt, spec_exp), arg((experts, ffn, hidden), dt, spec_exp))

    def layer(x, logits, w_in, w_out):
        return moe_xla.moe(x, logits, w_in, w_out, top_k=top_k, activation=activation, mesh=mesh,
                           expert_axis=expert_axis, transport=transport, dedup=dedup,
                           capacity_factor=capacity_factor, chunks=chunks)

    if grad:
        f = jax.grad(lambda *a: jnp.sum(jnp.square(layer(*a).astype(jnp.float32))), argnums=(0, 1, 2, 3))
    else:
        f = layer
    text = jax.jit(f).lower(*args).compile().as_text()
    if dump:
        with open(dump, "w") as fh:
            fh.write(text)
    config = {"mesh": "x".join(str(mesh.shape[a]) for a in names), "axes": ",".join(names),
              "expert_axis": expert_axis, "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts,
              "top_k": top_k, "dtype": dt.name, "activation": activation, "transport": transport, "dedup": dedup,
              "capacity_factor": capacity_factor, "chunks": chunks,
              "pass": "forward+backward" if grad else "forward"}
    platform = mesh.devices.flat[0].platform
    return inspect_hlo(text, config, platform)


def _parser():
    p = argparse.ArgumentParser(prog="python3 -m moe_xla.inspect", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="CPU devices to force (XLA_FLAGS); default 8")
    p.add_argument("--mesh", default=None, help="mesh shape, e.g. 8 or 2x4 (default: all devices on one axis)")
    p.add_argument("--axes", default="ep", help="comma-separated axis names, e.g. data,ep")
    p.add_argument("--expert-axis", default="ep")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--activation", default="swiglu")
    p.add_argument("--transport", default="auto", choices=("auto", "padded", "ragged"))
    p.add_argument("--dedup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--grad", action="store_true", help="forward + backward (jax.grad) instead of forward")
    p.add_argument("--dump", default=None, metavar="FILE", help="write the full optimised HLO text to FILE")
    return p


def main(argv=None) -> InspectReport:
    parser = _parser()
    args = parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # read when JAX starts its CPU backend
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={args.devices}").strip()
    axes = tuple(a for a in args.axes.split(",") if a)
    mesh_shape = tuple(int(n) for n in args.mesh.lower().split("x")) if args.mesh else None
    try:
        report = inspect_moe(mesh_shape=mesh_shape, axes=axes, expert_axis=args.expert_axis, tokens=args.tokens,
                             hidden=args.hidden, ffn=args.ffn, experts=args.experts, top_k=args.top_k,
                             dtype=args.dtype, activation=args.activation, transport=args.transport,
                             dedup=args.dedup, capacity_factor=args.capacity_factor, chunks=args.chunks,
                             grad=args.grad, dump=args.dump)
    except ValueError as err:  # bad sizes or mesh: a usage error, not a traceback
        parser.error(str(err))
    print(report)
    if args.dump:
        print(f"\nfull HLO written to {args.dump}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
