"""Benchmark: the moe_xla.moe layer (route -> permute -> gmm -> swiglu -> gmm -> unpermute)
on the moe_layer cases of cases.json in bf16, forward and forward+backward, against three
baselines measured in the same run on the same device:

  ragged_dot  the same dropless layer in pure JAX: top-k routing (jax.lax.top_k; for the
              sigmoid / group-limited case moe_xla.reference.route, which is pure jnp),
              argsort dispatch, jax.lax.ragged_dot, swiglu, ragged_dot, segment-sum combine;
  capacity    a Switch/GShard capacity MoE: capacity C = ceil(1.25 * T * k / E) per expert,
              one-hot dispatch and combine tensors [T, E, C], dense einsums, assignments
              over capacity dropped (first choices take precedence over second choices,
              then token order). Skipped when the dispatch tensor would exceed
              --max-dispatch-gib;
  dense       the FLOP ceiling: a dense SwiGLU MLP on T*k rows ([T*k, H] @ [H, 2F], swiglu,
              @ [F, H]), the same FLOPs as the layer with no routing and no grouping.
And moe_xla.moe(..., quantization="fp8_blockwise") (fp8: both expert products in FP8
blockwise, quantisation of rows and weights included, bf16 wgrad), with its output's
relative error against the bf16 layer (fp8_rel_err) and fp8_*_speedup = bf16 / fp8 time;
fp8_wgrad: quantization="fp8_blockwise_fp8_wgrad" (the weight gradients in FP8 too, x and
dy quantised in group-column tiles inside), fp8_wgrad_*_speedup likewise;
fp8_wgrad_prequant: the same with the weights' FP8 layouts made outside the timed step
(moe's quantized_weights, as when they are quantised once per optimizer step for several
micro-batches; w_in and w_out still get their gradients): fp8_wgrad's time less the
weight quantisation, a kernel bound by its 4 bytes moved per weight.

    python benchmarks/moe_layer.py [--out benchmarks/results] [--cases NAME ...] [--t-scale 1.0]
                                   [--skip fp8 fp8_wgrad fp8_wgrad_prequant ragged_dot
                                          capacity dense] [--reps N]

Forward+backward is _timing.fwd_bwd: y and its vector-Jacobian product with a bf16
cotangent ct w.r.t. x, router_logits, w_in and w_out (y is an output, so every forward
stage stays in the program; no loss reduction is timed). TFLOP/s count 6*T*k*H*F forward and 3x that forward+backward for every
implementation (useful FLOPs, not what a baseline executes), so a TFLOP/s ratio is a time
ratio. Ratios: *_vs_<baseline> = baseline time / moe_xla time; fraction_of_dense_* =
moe_xla TFLOP/s / dense TFLOP/s. Memory (*_mem_gib) is XLA's compile-time estimate,
memory_analysis() temp + argument + output bytes, not a measured peak.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
from pathlib import Path

from _timing import (CASES, compiled_memory_bytes, environment, fwd_bwd, gib, is_oom, moe_inputs, normal,
                     routing_options, time_jax, write_results)

import jax
import jax.numpy as jnp

import moe_xla
from moe_xla import reference

BASELINES = ("fp8", "fp8_wgrad", "fp8_wgrad_prequant", "ragged_dot", "capacity", "dense")
F32 = jnp.float32
DTYPE = jnp.bfloat16
MEMORY_METRIC = "compiled memory_analysis(): temp + argument + output bytes (estimate, aliasing not subtracted)"


# ---------------------------------------------------------------------------- layers


def _swiglu(h):
    gate, up = jnp.split(h, 2, axis=-1)
    return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(h.dtype)


def _route(logits, case):
    """(weights [T, k] f32, expert_ids [T, k] int32) with moe_xla.route's semantics."""
    k = case["top_k"]
    if case["score"] == "softmax" and not case.get("n_groups"):
        w, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(F32), axis=-1), k)
        return w / jnp.sum(w, axis=-1, keepdims=True), ids.astype(jnp.int32)
    return reference.route(logits, top_k=k, score=case["score"], n_groups=case.get("n_groups") or 1,
                           topk_groups=case.get("topk_groups") or 1)


def moe_xla_layer(case):
    return functools.partial(moe_xla.moe, **routing_options(case), activation="swiglu")


def ragged_dot_layer(case):
    """Dropless MoE in pure JAX: sort the T*k assignments by expert, ragged_dot twice, combine."""

    def layer(x, logits, w_in, w_out):
        t, experts, k = x.shape[0], w_in.shape[0], case["top_k"]
        weights, ids = _route(logits, case)
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # sorted slot -> assignment t*k + j
        token = order // k
        group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
        h = jax.lax.ragged_dot(x[token], w_in, group_sizes)
        y_sorted = jax.lax.ragged_dot(_swiglu(h), w_out, group_sizes)
        weighted = y_sorted.astype(F32) * weights.reshape(-1)[order][:, None]
        return jax.ops.segment_sum(weighted, token, num_segments=t).astype(x.dtype)

    return layer


def capacity(t: int, k: int, experts: int, factor: float) -> int:
    return max(1, math.ceil(factor * t * k / experts))


def _capacity_slots(ids, experts: int):
    """Slot of each assignment in its expert's buffer, GShard priority: every first choice
    before any second choice, tokens in order within a choice. [T, k] int32."""
    t, k = ids.shape
    mask = jax.nn.one_hot(ids.T, experts, dtype=jnp.int32)  # [k, T, E]
    pos = jnp.cumsum(mask.reshape(k * t, experts), axis=0).reshape(k, t, experts) - 1
    return jnp.sum(pos * mask, axis=-1).T


def capacity_layer(case, c: int):
    """Switch/GShard MoE: one-hot dispatch [T, E, C] and combine [T, E, C] tensors, einsums."""

    def layer(x, logits, w_in, w_out):
        experts = w_in.shape[0]
        weights, ids = _route(logits, case)
        expert = jax.nn.one_hot(ids, experts, dtype=x.dtype)  # [T, k, E]
        slot = jax.nn.one_hot(_capacity_slots(ids, experts), c, dtype=x.dtype)  # [T, k, C]; 0 row = dropped
        dispatch = jnp.einsum("tje,tjc->tec", expert, slot)
        combine = jnp.einsum("tje,tjc->tec", expert * weights[..., None].astype(x.dtype), slot)
        x_e = jnp.einsum("tec,th->ech", dispatch, x)
        h = jnp.einsum("ech,ehf->ecf", x_e, w_in)
        y_e = jnp.einsum("ecf,efh->ech", _swiglu(h), w_out)
        return jnp.einsum("tec,ech->th", combine, y_e, preferred_element_type=F32).astype(x.dtype)

    return layer


def capacity_dropped(case, logits, experts: int, c: int) -> float:
    """Fraction of the T*k assignments the capacity layer drops."""
    return float(jax.jit(lambda lg: jnp.mean(_capacity_slots(_route(lg, case)[1], experts) >= c))(logits))


def dense_mlp(x, w1, w2):
    return _swiglu(x @ w1) @ w2


# ---------------------------------------------------------------------------- measuring


def _host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fits_host_memory(compiled) -> bool:
    """On the CPU backend running out of memory kills the process (the kernel's OOM killer)
    instead of raising RESOURCE_EXHAUSTED, so a program whose estimated new memory (temp +
    output; its arguments already exist) exceeds 85% of the free host memory is not run.
    Always True on accelerators, where XLA's allocator reports OOM itself."""
    if jax.devices()[0].platform != "cpu":
        return True
    stats, free = compiled.memory_analysis(), _host_memory_available()
    if stats is None or free is None:
        return True
    return stats.temp_size_in_bytes + stats.output_size_in_bytes <= 0.85 * free


def _measure(fn, args, reps: int, inner: int) -> dict:
    """ms per call and memory estimate of jit(fn)(*args); ms is "OOM" when compiling or
    running runs out of device memory (on CPU: when it would not fit the free host memory)."""
    mem = None
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        mem = compiled_memory_bytes(compiled)
        if not _fits_host_memory(compiled):
            return {"ms": "OOM (host estimate)", "mem_gib": gib(mem)}
        ms = time_jax(compiled, *args, reps=reps, inner=inner) * 1e3
    except Exception as err:  # noqa: BLE001 - OOM is a result, anything else is re-raised
        if not is_oom(err):
            raise
        ms = "OOM"
    finally:
        gc.collect()
    return {"ms": ms, "mem_gib": gib(mem)}


def _bench(name, layer, inputs, ct, flops, reps, inner, row, keep_output=False, fixed=()):
    """Times layer forward and forward+backward (differentiated w.r.t. inputs, not the
    fixed arguments that follow them); fills row[name_*]; returns the forward output when
    keep_output (and it ran)."""
    fwd = _measure(layer, inputs + fixed, reps, inner)
    bwd = _measure(fwd_bwd(layer, len(inputs)), inputs + fixed + (ct,), reps, inner)
    for tag, res, fl in (("fwd", fwd, flops), ("fwd_bwd", bwd, 3 * flops)):
        row[f"{name}_{tag}_ms"] = res["ms"]
        row[f"{name}_{tag}_tflops"] = fl / res["ms"] / 1e9 if isinstance(res["ms"], float) else res["ms"]
        row[f"{name}_{tag}_mem_gib"] = res["mem_gib"]
    print(f"  {row['case']} {name}: fwd {_show(fwd['ms'])} ms, fwd+bwd {_show(bwd['ms'])} ms", flush=True)
    if keep_output and isinstance(fwd["ms"], float):
        return jax.jit(layer)(*inputs, *fixed)
    return None


def _show(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _ratio(num, den):
    """num / den for two timings; the non-number (OOM, skipped) when there is one."""
    for v in (num, den):
        if not isinstance(v, float):
            return v
    return num / den


# ---------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--t-scale", type=float, default=1.0, help="scale T (for quick runs)")
    parser.add_argument("--skip", nargs="*", default=[], choices=BASELINES, help="baselines to skip")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions (default 20 on GPU, 1 on CPU)")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--max-dispatch-gib", type=float, default=40.0,
                        help="skip the capacity baseline when its [T, E, C] dispatch tensor is larger")
    args = parser.parse_args()

    on_gpu = jax.devices()[0].platform == "gpu"
    reps = args.reps or (20 if on_gpu else 1)
    inner_fast, inner_slow = (5, 1) if on_gpu else (1, 1)  # back-to-back calls per timing

    env = environment()
    env.update(memory_metric=MEMORY_METRIC, t_scale=args.t_scale, capacity_factor=args.capacity_factor, reps=reps)
    key = jax.random.key(0)
    rows = []
    for case in CASES["moe_layer"]:
        if args.cases and case["name"] not in args.cases:
            continue
        t = max(1, int(case["T"] * args.t_scale))
        h, f, e, k = case["H"], case["F"], case["E"], case["top_k"]
        flops = 6.0 * t * k * h * f
        layer_key, dense_key = jax.random.split(jax.random.fold_in(key, len(rows)))
        inputs, ct = moe_inputs(layer_key, t, h, f, e)
        row = {"case": case["name"], "T": t, "H": h, "F": f, "E": e, "top_k": k, "score": case["score"],
               "gflop_fwd": flops / 1e9}

        y_ref = _bench("moe_xla", moe_xla_layer(case), inputs, ct, flops, reps, inner_fast, row, keep_output=True)

        if "fp8" in args.skip:
            _fill_skipped(row, "fp8", "skipped")
        else:
            fp8_layer = functools.partial(moe_xla_layer(case), quantization="fp8_blockwise")
            y_fp8 = _bench("fp8", fp8_layer, inputs, ct, flops, reps, inner_fast, row, keep_output=y_ref is not None)
            if y_ref is not None and y_fp8 is not None:
                diff = jnp.linalg.norm((y_fp8.astype(F32) - y_ref.astype(F32)).ravel())
                row["fp8_rel_err"] = float(diff / jnp.linalg.norm(y_ref.astype(F32).ravel()))
            del y_fp8
        if "fp8_wgrad" in args.skip:
            _fill_skipped(row, "fp8_wgrad", "skipped")
        else:
            _bench("fp8_wgrad", functools.partial(moe_xla_layer(case), quantization="fp8_blockwise_fp8_wgrad"), inputs,
                   ct, flops, reps, inner_fast, row)
        if "fp8_wgrad_prequant" in args.skip:
            _fill_skipped(row, "fp8_wgrad_prequant", "skipped")
        else:
            layer = moe_xla_layer(case)
            quantized = tuple(jax.jit(moe_xla.quantize_fp8_weights)(w) for w in inputs[2:])
            _bench("fp8_wgrad_prequant", lambda *a: layer(*a[:4], quantization="fp8_blockwise_fp8_wgrad",
                                                         quantized_weights=a[4:]),
                   inputs, ct, flops, reps, inner_fast, row, fixed=quantized)
            del quantized

        if "ragged_dot" in args.skip:
            _fill_skipped(row, "ragged_dot", "skipped")
        else:
            y_rd = _bench("ragged_dot", ragged_dot_layer(case), inputs, ct, flops, reps, inner_slow, row,
                          keep_output=y_ref is not None)
            if y_ref is not None and y_rd is not None:  # same layer: a check that both compute it
                diff = jnp.linalg.norm((y_ref.astype(F32) - y_rd.astype(F32)).ravel())
                row["check_rel_err_vs_ragged_dot"] = float(diff / jnp.linalg.norm(y_rd.astype(F32).ravel()))
            del y_rd

        c = capacity(t, k, e, args.capacity_factor)
        dispatch_gib = gib(t * e * c * jnp.dtype(DTYPE).itemsize)
        row.update(capacity_C=c, capacity_dispatch_gib=dispatch_gib)
        if "capacity" in args.skip:
            _fill_skipped(row, "capacity", "skipped")
        elif dispatch_gib > args.max_dispatch_gib:
            _fill_skipped(row, "capacity", f"skipped (dispatch tensor {dispatch_gib:.0f} GiB)")
        else:
            row["capacity_dropped_frac"] = capacity_dropped(case, inputs[1], e, c)
            _bench("capacity", capacity_layer(case, c), inputs, ct, flops, reps, inner_slow, row)

        del y_ref, inputs, ct
        gc.collect()

        if "dense" in args.skip:
            _fill_skipped(row, "dense", "skipped")
        else:  # the same FLOPs with no routing: [T*k, H] @ [H, 2F] -> swiglu -> @ [F, H]
            keys = jax.random.split(dense_key, 4)
            dense_inputs = (normal(keys[0], (t * k, h), DTYPE), normal(keys[1], (h, 2 * f), DTYPE, 1.0 / math.sqrt(h)),
                            normal(keys[2], (f, h), DTYPE, 1.0 / math.sqrt(f)))
            dense_ct = normal(keys[3], (t * k, h), F32)
            _bench("dense", dense_mlp, dense_inputs, dense_ct, flops, reps, inner_fast, row)
            del dense_inputs, dense_ct
            gc.collect()

        for tag in ("fwd", "fwd_bwd"):
            mine = row[f"moe_xla_{tag}_ms"]
            row[f"{tag}_vs_ragged_dot"] = _ratio(row["ragged_dot_" + tag + "_ms"], mine)
            row[f"{tag}_vs_capacity"] = _ratio(row["capacity_" + tag + "_ms"], mine)
            row[f"fraction_of_dense_{tag}"] = _ratio(row["dense_" + tag + "_ms"], mine)  # = TFLOP/s ratio
            row[f"fp8_{tag}_speedup"] = _ratio(mine, row["fp8_" + tag + "_ms"])
            row[f"fp8_wgrad_{tag}_speedup"] = _ratio(mine, row["fp8_wgrad_" + tag + "_ms"])
            row[f"fp8_wgrad_prequant_{tag}_speedup"] = _ratio(mine, row["fp8_wgrad_prequant_" + tag + "_ms"])
        rows.append(row)
        print(row, flush=True)

    columns = ["case", "T", "check_rel_err_vs_ragged_dot", "moe_xla_fwd_ms", "moe_xla_fwd_tflops", "moe_xla_fwd_bwd_ms", "moe_xla_fwd_bwd_tflops",
               "fp8_fwd_tflops", "fp8_fwd_bwd_tflops", "fp8_fwd_speedup", "fp8_fwd_bwd_speedup", "fp8_rel_err",
               "fp8_wgrad_fwd_bwd_tflops", "fp8_wgrad_fwd_bwd_speedup", "fp8_wgrad_prequant_fwd_bwd_tflops",
               "fp8_wgrad_prequant_fwd_bwd_speedup",
               "moe_xla_fwd_bwd_mem_gib", "ragged_dot_fwd_bwd_ms", "ragged_dot_fwd_bwd_mem_gib", "fwd_vs_ragged_dot",
               "fwd_bwd_vs_ragged_dot", "capacity_fwd_bwd_ms", "capacity_fwd_bwd_mem_gib", "capacity_dropped_frac",
               "fwd_vs_capacity", "fwd_bwd_vs_capacity", "dense_fwd_tflops", "dense_fwd_bwd_tflops",
               "fraction_of_dense_fwd", "fraction_of_dense_fwd_bwd"]
    write_results(args.out, "moe_layer", env, rows, columns)


def _fill_skipped(row, name, why):
    for tag in ("fwd", "fwd_bwd"):
        for what in ("ms", "tflops"):
            row[f"{name}_{tag}_{what}"] = why


if __name__ == "__main__":
    main()
