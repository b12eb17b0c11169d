"""Where one forward+backward step of moe_xla.moe goes, stage by stage (issue 19, item 1).

    python benchmarks/moe_layer_stages.py [--out benchmarks/results] [--cases NAME ...] [--t-scale 1.0]
                                          [--reps N] [--trace-steps N]
                                          [--quantization none fp8_blockwise fp8_blockwise_fp8_wgrad
                                                          fp8_blockwise_prequantized]
                                          [--first-product auto gather copy]
                                          [--combine-backward auto gather copy]
                                          [--fused-activation auto fused unfused]
                                          [--layer moe ep1]

Cases: every "moe_layer" and "sonicmoe" case of cases.json (bf16, swiglu experts w_in
[E, d, 2n], w_out [E, n, d], the case's routing). Notation: T tokens, d hidden (H), n
expert FFN width (F), E experts, K = top_k, TK = T*K routed rows, b = 2 bytes (bf16).

Timing (benchmarks/_timing.time_jax, wall ms per call of back-to-back jitted calls):
  t_f   the forward, y = moe(x, logits, w_in, w_out);
  t_fb  one forward+backward step, _timing.fwd_bwd: y and the vector-Jacobian product of
        y with a bf16 cotangent ct w.r.t. x, router logits, w_in and w_out (y is an output,
        as a model's next layer reads it; no loss reduction is timed).
  fwd TFLOP/s = 6 T K d n / t_f  (gmm_in 2 TK d 2n + gmm_out 2 TK n d),
  bwd TFLOP/s = 12 T K d n / (t_fb - t_f)  (each product's dgrad and wgrad),
  fwd+bwd TFLOP/s = 18 T K d n / t_fb (moe_layer.py times the same step).

Stages: one profiler trace of --trace-steps steps (_timing.trace_events / gpu_kernels);
every GPU kernel (and memcpy / memset on a stream) is put in one stage and direction:
  stage      the named scope moe_xla/<stage> the layer puts its ops under: route,
             dispatch (permute), gmm_in, act, gmm_out, combine (unpermute);
  direction  "bwd" when JAX's transpose(...) wraps the scope in the op_name
             ("transpose(jvp(moe_xla/act))/mul"), else "fwd" ("jvp(moe_xla/act)/mul").
How a kernel finds its op names: XLA:GPU runs each thunk under a profiler annotation
that names its HLO instruction, and the trace gives that name as the kernel's "hlo_op"
arg. Inside a command buffer every kernel is named after the buffer ("command_buffer_1"
on the H200 with jax 0.11.2, profiling or not), so the traced step is a second
compilation of the timed one with command buffers off (xla_gpu_enable_command_buffer
empty: its kernels are the same, launched one by one); a custom call's kernels all carry
the custom call's name. The instruction is looked up in that executable's own HLO text:
its op_name metadata and those of every op fused into it (a fusion's body, through
calls=). The stage times are thus those of the traced executable, the step times
(fwd_ms, fwd_bwd_ms, shares) those of the timed one. Where the hlo_op is not in that
module, the op names of the annotation itself are read instead (args "name" / "op_name" / "long_name" / "tf_op", which newer
XLA fills with the instruction's op_name). A kernel whose ops name several (stage,
direction) pairs (a fusion: XLA fuses cheap ops of earlier stages, such as bitcasts,
broadcasts or the forward activation the backward recomputes, into a later stage's
kernel) goes to the latest of them in program order (forward route ... combine, then
backward combine ... route), the only place it can run; these are listed with the pairs
they name in the JSON (mixed_kernels, total mixed_ms). A kernel whose ops name no stage
goes to "other" (other_kernels, other_ms): ops outside the scopes, such as a cast XLA
adds between them, and any kernel without an hlo_op or op names.
On CPU the trace has no GPU kernels: the stage columns stay empty (None) and a note is
printed.

Per stage and direction, per step: <stage>_<dir>_ms (kernel time in the traced steps),
_share (that over the untraced t_fb), and
  gmm_in / gmm_out: _tflops from the products' FLOPs, fwd 4 TK d n / 2 TK n d, bwd twice;
  the memory-bound stages: _gbps = compulsory bytes / kernel time, where the compulsory
  bytes read each input and write each output once (f32 logits / weights, int32 ids /
  row map; the operands a stage needs, not what the implementation moves):
    route fwd     logits in, weights + ids out                   4TE + 8TK
    route bwd     logits, d_weights, ids in; d_logits out        8TE + 8TK
    dispatch fwd  x, ids in; x_sorted, row_map, group_sizes out  b(Td + TKd) + 8TK + 4E
    dispatch bwd  d_x_sorted, row_map in; d_x out                b(TKd + Td) + 4TK
    act fwd       h [TK, 2n] in; a [TK, n] out                   b(2TKn + TKn) = 3bTKn
    act bwd       h, d_a in; d_h, omega * a out                  b(2TKn + TKn + 2TKn + TKn) = 6bTKn
    combine fwd   y_sorted, row_map, weights in; y out           b(TKd + Td) + 8TK
    combine bwd   ct (bf16), row_map, weights in; ct gathered    b(Td + TKd + 2TKn) + 12TK
                  into expert order out; g = its product with
                  w_out^T and a in, d_weights out (F wide:
                  moe_xla/product_combine.py)
Also: kernels_ms (all kernels of a step), kernels (every kernel's ms per step, keyed as
mixed_kernels),
other_ms / other_share, mixed_ms, fwd_bwd_mem_gib (XLA's compile-time estimate, as
moe_layer.py), and for the sonicmoe cases fwd/bwd_vs_sonicmoe = our TFLOP/s / SonicMoE's
published H100 figure (cases.json, read off its paper's Fig. 14). With
--quantization fp8_blockwise_prequantized the step takes the weights' Fp8Weights as two
more inputs (not differentiated; the bf16 weights still get their gradients), and
weights_quant_ms is the time of quantising both weights once, what an optimizer step
pays for all its micro-batches. --first-product measures each case once per mode of
moe_xla.first_product (how moe() feeds its first product: "gather" reads the rows from the
tokens through the row map, "copy" from permute's copy, "auto" lets moe() choose; FP8
quantizations copy in every mode), column first_product; with "gather" the forward's
dispatch stage holds the sort alone and gmm_in the gather (a step that differentiates the
layer copies: first_product's custom_jvp). --combine-backward likewise measures each mode
of moe_xla.product_combine (how the second product's backward reads the cotangent:
"gather" through the row map inside gather_gmm / gather_tgmm, under gmm_out bwd; "copy"
gathered once into expert order, under combine bwd), column cotangent_rows.
--fused-activation likewise measures each mode of moe_xla.experts.fused_activation (whether
a gathered forward runs the activation in the first product's epilogue, gather_gmm_activate:
act fwd then falls under gmm_in fwd), column fused_activation.
--layer likewise measures moe() itself ("moe") and the EP layer on a one-device mesh
("ep1": moe(..., mesh=Mesh([device], ("ep",)), expert_axis="ep"), its default padded
transport and dedup; the exchange machinery with no link, which issue 16 holds to 5% over
moe()), column layer; the EP layer runs its dispatch and combine under the same scopes.
Output: moe_layer_stages_<platform>.json / .md under --out (_timing.write_results).
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import re
from pathlib import Path

from _timing import (CASES, compiled_memory_bytes, environment, fwd_bwd, gib, gpu_kernels, moe_inputs, time_jax,
                     trace_events, write_results)
from moe_layer import moe_xla_layer

import jax
import numpy as np
from jax.sharding import Mesh

import moe_xla
from moe_xla import experts, first_product, product_combine

from moe_xla.inspect import parse_hlo

STAGES = ("route", "dispatch", "gmm_in", "act", "gmm_out", "combine")
GEMMS = ("gmm_in", "gmm_out")
DIRECTIONS = ("fwd", "bwd")
# The order the (stage, direction) pairs run in: the forward, then its transpose backwards.
PROGRAM_ORDER = [(s, "fwd") for s in STAGES] + [(s, "bwd") for s in reversed(STAGES)]
CASE_LISTS = ("moe_layer", "sonicmoe")
# FP8 with the weights quantised outside the step (moe's quantized_weights).
PREQUANTIZED = "fp8_blockwise_prequantized"
LAYERS = ("moe", "ep1")
# Trace args that may carry an annotation's op names (newer XLA: "name", "op_name").
OP_NAME_ARGS = ("name", "op_name", "long_name", "tf_op")
_SCOPE = re.compile(r"moe_xla/(\w+)")


# ---------------------------------------------------------------------------- attribution


def op_scope(op_name: str):
    """(stage, direction) of an op_name: the one moe_xla/<stage> of STAGES in it, "bwd"
    when transpose( wraps it, else "fwd"; None when it names no stage or two."""
    stages = set(_SCOPE.findall(op_name)) & set(STAGES)
    if len(stages) != 1:
        return None
    return stages.pop(), "bwd" if "transpose(" in op_name else "fwd"


def instruction_scopes(hlo_text: str) -> dict:
    """{HLO instruction name: frozenset of the (stage, direction) pairs of its op_name and of
    the op_names in the computations it calls (calls=: a fusion's body, recursively)} for
    every instruction of a module's text (compiled.as_text())."""
    comps = parse_hlo(hlo_text)
    memo = {}

    def computation(name):
        if name not in memo:
            memo[name] = frozenset().union(*map(instruction, comps[name].instructions)) if name in comps \
                else frozenset()
        return memo[name]

    def instruction(ins):
        own = op_scope(ins.op_name)
        called = computation(ins.attr("calls")) if ins.attr("calls") else frozenset()
        return (called | {own}) if own else called

    return {ins.name: instruction(ins) for comp in comps.values() for ins in comp.instructions}


def kernel_scopes(event: dict, scopes: dict) -> frozenset:
    """The (stage, direction) pairs of a trace kernel event: those of its "hlo_op" arg in
    `scopes` (instruction_scopes of the traced program), else those of the op names in its
    OP_NAME_ARGS."""
    args = event.get("args", {})
    if args.get("hlo_op") in scopes:
        return scopes[args["hlo_op"]]
    return frozenset(filter(None, (op_scope(str(args.get(key, ""))) for key in OP_NAME_ARGS)))


def kernel_stage(found: frozenset):
    """The (stage, direction) a kernel with the pairs `found` is put in: the one pair; for a
    kernel whose ops name several, the latest in program order (PROGRAM_ORDER), since it
    runs after all of them and XLA fuses earlier stages' cheap ops (bitcasts, broadcasts,
    recomputed elementwise forward ops) into a later stage's kernel. found is not empty."""
    return max(found, key=PROGRAM_ORDER.index)


def stage_ms(kernels, scopes: dict, steps: int):
    """({(stage, direction): kernel ms per step}, mixed, other, every) of trace kernel
    events (durations in us), each kernel put in kernel_stage(kernel_scopes(...)). mixed:
    Counter {kernel: ms per step} of the kernels whose ops name several pairs (counted in
    the stage kernel_stage picks); other: the same of those that name none; every: the
    same of all kernels. Kernels are keyed by hlo_op, kernel name and the pairs they name."""
    ms, mixed, other, every = (collections.Counter() for _ in range(4))
    for e in kernels:
        found = kernel_scopes(e, scopes)
        per_step = e["dur"] / steps / 1e3
        label = (f"{e.get('args', {}).get('hlo_op', '?')} {e['name'][:80]} "
                 f"[{' + '.join(f'{s} {d}' for s, d in sorted(found, key=PROGRAM_ORDER.index)) or 'no stage'}]")
        every[label] += per_step
        if found:
            ms[kernel_stage(found)] += per_step
        if len(found) != 1:
            (mixed if found else other)[label] += per_step
    return ms, mixed, other, every


# ---------------------------------------------------------------------------- stage work


def compulsory_bytes(stage: str, direction: str, t: int, k: int, d: int, n: int, e: int, b: int) -> int:
    """Bytes a memory-bound stage must read and write once (module docstring): b bytes per
    x / h / y element, 4 per f32 logit / weight and int32 id / row-map entry."""
    tk = t * k
    return {
        ("route", "fwd"): 4 * t * e + 8 * tk,
        ("route", "bwd"): 8 * t * e + 8 * tk,
        ("dispatch", "fwd"): b * (t * d + tk * d) + 8 * tk + 4 * e,
        ("dispatch", "bwd"): b * (tk * d + t * d) + 4 * tk,
        ("act", "fwd"): 3 * b * tk * n,
        ("act", "bwd"): 6 * b * tk * n,
        ("combine", "fwd"): b * (tk * d + t * d) + 8 * tk,
        ("combine", "bwd"): b * (t * d + tk * d + 2 * tk * n) + 12 * tk,
    }[(stage, direction)]


def gemm_flops(stage: str, direction: str, t: int, k: int, d: int, n: int) -> float:
    """FLOPs of a grouped-GEMM stage: gmm_in 2 TK d 2n, gmm_out 2 TK n d forward; the
    backward twice that (dgrad and wgrad)."""
    fwd = {"gmm_in": 4.0, "gmm_out": 2.0}[stage] * t * k * d * n
    return fwd if direction == "fwd" else 2 * fwd


def stage_columns(kernels, scopes: dict, steps: int, step_ms: float, dims: dict) -> dict:
    """The per-stage row entries (module docstring) of one case's trace kernels; None
    everywhere when the trace has no kernels (CPU). dims: t, k, d, n, e and b (bytes of an
    element of x)."""
    ms, mixed, other, every = stage_ms(kernels, scopes, steps)
    traced = bool(kernels)
    row = {}
    for stage in STAGES:
        for direction in DIRECTIONS:
            key, v = f"{stage}_{direction}", ms[(stage, direction)] if traced else None
            row[f"{key}_ms"] = v
            row[f"{key}_share"] = v / step_ms if traced else None
            if stage in GEMMS:
                work = gemm_flops(stage, direction, dims["t"], dims["k"], dims["d"], dims["n"])
                row[f"{key}_tflops"] = work / v / 1e9 if v else None
            else:
                row[f"{key}_gbps"] = compulsory_bytes(stage, direction, **dims) / v / 1e6 if v else None
    other_ms = sum(other.values())
    row.update(kernels_ms=sum(ms.values()) + other_ms if traced else None, other_ms=other_ms if traced else None,
               other_share=other_ms / step_ms if traced else None, other_kernels=dict(other.most_common()),
               mixed_ms=sum(mixed.values()) if traced else None, mixed_kernels=dict(mixed.most_common()),
               kernels=dict(every.most_common()))
    return row


def format_stages(row: dict) -> str:
    """The stage entries of a row as lines: stage, direction, ms, % of the step, GB/s or TFLOP/s."""
    lines = []
    for stage in STAGES:
        for direction in DIRECTIONS:
            key = f"{stage}_{direction}"
            rate, unit = (row[key + "_tflops"], "TFLOP/s") if stage in GEMMS else (row[key + "_gbps"], "GB/s")
            rate = f"{rate:.0f} {unit}" if rate else ""
            lines.append(f"    {stage:<9}{direction}  {row[key + '_ms']:8.3f} ms  "
                         f"{100 * row[key + '_share']:5.1f}%  {rate}")
    lines.append(f"    {'other':<12} {row['other_ms']:8.3f} ms  {100 * row['other_share']:5.1f}%  "
                 f"(kernels {row['kernels_ms']:.3f} ms of {row['fwd_bwd_ms']:.3f} ms)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- measuring


def default_cases() -> list:
    """Every case of the CASE_LISTS of cases.json."""
    return [case for name in CASE_LISTS for case in CASES[name]]


def prequantized_layer(case: dict, layer: str = "moe"):
    """The case's FP8 layer (case_layer) with its weights' Fp8Weights as two more inputs
    (after x, logits, w_in and w_out): moe(..., quantized_weights=(q_in, q_out))."""
    base = case_layer(case, layer)

    def layer(x, logits, w_in, w_out, q_in, q_out):
        return base(x, logits, w_in, w_out, quantization="fp8_blockwise", quantized_weights=(q_in, q_out))

    return layer


def case_layer(case: dict, layer: str):
    """The case's moe() (layer "moe") or its EP layer on a one-device mesh ("ep1")."""
    base = moe_xla_layer(case)
    if layer == "moe":
        return base
    return functools.partial(base, mesh=Mesh(np.array(jax.devices()[:1]), ("ep",)), expert_axis="ep")


def measure_case(case: dict, t_scale: float, reps: int, inner: int, trace_steps: int, key,
                 quantization=None, first_product_mode="auto", combine_backward_mode="auto",
                 fused_activation_mode="auto", layer="moe") -> dict:
    """One row: the case's timings, TFLOP/s and stage columns (module docstring), moe()'s
    first product traced as first_product_mode, its combine's backward as
    combine_backward_mode, its activation's fusion as fused_activation_mode, the layer
    as `layer` (LAYERS)."""
    with (first_product.forced(first_product_mode), product_combine.forced(combine_backward_mode),
          experts.fused_activation(fused_activation_mode)):
        row = _measure_case(case, t_scale, reps, inner, trace_steps, key, quantization, layer)
    return {"case": row.pop("case"), "layer": layer, "quantization": row.pop("quantization"),
            "first_product": first_product_mode, "cotangent_rows": combine_backward_mode,
            "fused_activation": fused_activation_mode, **row}


def _measure_case(case: dict, t_scale: float, reps: int, inner: int, trace_steps: int, key, quantization,
                  layer_kind: str) -> dict:
    t = max(1, int(case["T"] * t_scale))
    d, n, e, k = case["H"], case["F"], case["E"], case["top_k"]
    inputs, ct = moe_inputs(key, t, d, n, e)
    weights_quant_ms = None
    if quantization == PREQUANTIZED:
        # The weights' FP8 blocks as two more (not differentiated) inputs: quantised once per
        # optimizer step and shared by its micro-batches; that quantisation is timed apart.
        quantize = jax.jit(lambda w_in, w_out: (moe_xla.quantize_fp8_weights(w_in),
                                                moe_xla.quantize_fp8_weights(w_out))).lower(*inputs[2:]).compile()
        weights_quant_ms = time_jax(quantize, *inputs[2:], reps=reps, inner=inner) * 1e3
        layer = prequantized_layer(case, layer_kind)
        n_diff, inputs = len(inputs), inputs + quantize(*inputs[2:])
    else:
        layer = functools.partial(case_layer(case, layer_kind), quantization=quantization)
        n_diff = len(inputs)
    fwd = jax.jit(layer).lower(*inputs).compile()
    step = jax.jit(fwd_bwd(layer, n_diff)).lower(*inputs, ct).compile()
    t_f = time_jax(fwd, *inputs, reps=reps, inner=inner)
    t_fb = time_jax(step, *inputs, ct, reps=reps, inner=inner)
    # The traced step is compiled without command buffers: inside one, every kernel carries
    # the command buffer's name ("command_buffer_1") instead of its HLO instruction's.
    # trace_steps = 0: no trace (an A/B of step times alone), the stage columns left empty.
    kernels, scopes = [], {}
    if trace_steps > 0:
        traced = jax.jit(fwd_bwd(layer, n_diff)).lower(*inputs, ct).compile(
            compiler_options={"xla_gpu_enable_command_buffer": ""})
        kernels = [ev for ks in gpu_kernels(trace_events(traced, inputs + (ct,), trace_steps)).values() for ev in ks]
        scopes = instruction_scopes(traced.as_text())
    flops = 6.0 * t * k * d * n
    row = {"case": case["name"], "quantization": quantization or "none", "T": t, "H": d, "F": n, "E": e, "top_k": k,
           "score": case["score"],
           "fwd_ms": t_f * 1e3, "fwd_bwd_ms": t_fb * 1e3, "bwd_ms": (t_fb - t_f) * 1e3,
           "fwd_tflops": flops / t_f / 1e12, "bwd_tflops": 2 * flops / (t_fb - t_f) / 1e12 if t_fb > t_f else None,
           "fwd_bwd_tflops": 3 * flops / t_fb / 1e12, "fwd_bwd_mem_gib": gib(compiled_memory_bytes(step)),
           "weights_quant_ms": weights_quant_ms}
    for tag in ("fwd", "bwd"):
        ref = case.get(f"sonicmoe_h100_{tag}_tflops")
        row[f"{tag}_vs_sonicmoe"] = row[f"{tag}_tflops"] / ref if ref and row[f"{tag}_tflops"] else None
    row.update(stage_columns(kernels, scopes, trace_steps, t_fb * 1e3,
                             dict(t=t, k=k, d=d, n=n, e=e, b=inputs[0].dtype.itemsize)))
    return row


COLUMNS = (["case", "layer", "quantization", "first_product", "cotangent_rows", "fused_activation", "T", "fwd_ms",
            "fwd_bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_vs_sonicmoe",
            "bwd_vs_sonicmoe", "weights_quant_ms",
            "fwd_bwd_mem_gib", "kernels_ms", "other_ms"]
           + [f"{s}_{d}_ms" for s in STAGES for d in DIRECTIONS]
           + [f"{s}_{d}_{'tflops' if s in GEMMS else 'gbps'}" for s in STAGES for d in DIRECTIONS])


def run(cases, out: Path, t_scale: float, reps: int, inner: int, trace_steps: int, quantizations=(None,),
        first_products=("auto",), combine_backwards=("auto",), fused_activations=("auto",), layers=("moe",)) -> list:
    """Measures `cases` (once per entry of quantizations, moe()'s option, of
    first_products, first_product's modes, of combine_backwards, product_combine's, of
    fused_activations, experts.fused_activation's, and of layers, LAYERS)
    and writes moe_layer_stages_<platform>.json / .md under out."""
    platform = jax.devices()[0].platform
    env = environment()
    env.update(t_scale=t_scale, reps=reps, inner=inner, trace_steps=trace_steps)
    rows = []
    for i, case in enumerate(cases):
        for layer, quantization, mode, combine, fusion in itertools.product(layers, quantizations, first_products,
                                                                            combine_backwards, fused_activations):
            row = measure_case(case, t_scale, reps, inner, trace_steps, jax.random.fold_in(jax.random.key(0), i),
                               quantization, mode, combine, fusion, layer)
            rows.append(row)
            print(f"{row['case']} ({layer}, {row['quantization']}, first product {mode}, combine backward {combine}, "
                  f"activation {fusion}): "
                  f"fwd {row['fwd_ms']:.3f} ms "
                  f"({row['fwd_tflops']:.3g} TFLOP/s), fwd+bwd {row['fwd_bwd_ms']:.3f} ms "
                  f"(bwd {row['bwd_tflops'] or float('nan'):.3g} TFLOP/s)", flush=True)
            if row["kernels_ms"] is None:
                print(f"  note: no GPU kernels traced on {platform} (or --trace-steps 0); stage columns left empty",
                      flush=True)
            else:
                print(format_stages(row), flush=True)
    write_results(out, f"moe_layer_stages_{platform}", env, rows, COLUMNS)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: every moe_layer and sonicmoe case)")
    parser.add_argument("--t-scale", type=float, default=1.0, help="scale T (for quick runs)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20 on GPU, 1 on CPU)")
    parser.add_argument("--trace-steps", type=int, default=None,
                        help="steps traced (default 3 on GPU, 1 on CPU; 0: no trace, step times alone)")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", "fp8_blockwise", "fp8_blockwise_fp8_wgrad", PREQUANTIZED],
                        help="moe()'s quantization, each measured in turn; " + PREQUANTIZED + ": FP8 with the "
                             "weights quantised outside the step (quantized_weights), that quantisation timed apart "
                             "as weights_quant_ms (FP8: quantisation kernels fall in the "
                             "stage of the product they feed; the GB/s columns still count bf16 bytes)")
    parser.add_argument("--first-product", nargs="+", default=["auto"], choices=list(first_product.MODES),
                        help="how moe() feeds its first product (moe_xla.first_product), each measured in turn: "
                             "gather (rows read through the row map), copy (permute's copy of x), auto")
    parser.add_argument("--combine-backward", nargs="+", default=["auto"], choices=list(product_combine.MODES),
                        help="how the combine's backward reads the cotangent (moe_xla.product_combine), each "
                             "measured in turn: gather (through the row map), copy (gathered into c), auto")
    parser.add_argument("--fused-activation", nargs="+", default=["auto"], choices=list(experts.FUSION_MODES),
                        help="whether a gathered forward runs the activation in the first product's epilogue "
                             "(moe_xla.experts.fused_activation), each measured in turn")
    parser.add_argument("--layer", nargs="+", default=["moe"], choices=list(LAYERS),
                        help="moe() itself, or the EP layer on a one-device mesh (ep1), each measured in turn")
    args = parser.parse_args(argv)
    cases = default_cases()
    unknown = set(args.cases or ()) - {c["name"] for c in cases}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {[c['name'] for c in cases]}")
    on_gpu = jax.devices()[0].platform == "gpu"
    return run([c for c in cases if not args.cases or c["name"] in args.cases], args.out, args.t_scale,
               args.reps or (20 if on_gpu else 1), 5 if on_gpu else 1, (3 if on_gpu else 1) if args.trace_steps is None else args.trace_steps,
               [None if q == "none" else q for q in args.quantization], args.first_product, args.combine_backward,
               args.fused_activation, args.layer)


if __name__ == "__main__":
    main()
