"""Benchmark: the FP8 blockwise grouped GEMM against bf16 moe_xla.gmm, torch._grouped_mm
(bf16) and torch._scaled_grouped_mm (FP8 with row-wise scales, where torch has it), in one
run on the grouped_matmul cases of cases.json.

    python benchmarks/gmm_fp8.py [--out benchmarks/results] [--cases NAME ...] [--kinds uniform zipf1.2]
                                 [--m-scale 1.0] [--turn-seconds 0.4] [--rounds 3]
                                 [--paths cutlass_coop128x128_2x1 ...] [--wgrad-paths pingpong ...]
                                 [--skip-backward] [--only wgrad_ dgrad_ ...]

Forward contenders, taking turns on the device (_timing.alternating_times, so none runs
on a cooler GPU than the others):
  bf16         moe_xla.gmm(lhs, w)                                    bf16 operands
  fp8          moe_xla.gmm_fp8 on pre-quantised operands (lhs in 1 x 128 tiles, the
               weights' 128 x 128 blocks transposed): the GEMM alone
  fp8_quant    moe_xla.gmm(lhs, w, quantization="fp8_blockwise"): quantisation of lhs and
               of the weights included (what a training step's forward pays)
  torch_bf16   torch._grouped_mm
  torch_fp8    torch._scaled_grouped_mm, e4m3 operands with row-wise scales (pre-quantised)
  fp8@<path>   with --paths: gmm_fp8 forced onto each named kernel (gmm_fp8.PATHS), for
               ranking tile configurations in the same turns ("fp8" is the heuristic's)
Backward pair, also in turns: bf16 dgrad (gmm with the weights transposed) + bf16 wgrad
(tgmm) against the FP8 dgrad (dy quantised inside, pre-quantised weights) + the same bf16
wgrad (pair_fp8) or + the FP8 wgrad with x and dy quantised in group-column tiles inside
(pair_fp8_fp8, three quantisation passes), and the two FP8 GEMMs alone on pre-quantised
operands (pair_fp8_fp8_pre: dy's rows and x's and dy's column tiles made beforehand, as
the forward's fp8 is timed); the library's own training step, train_bf16 and
train_fp8_fp8 (forward and backward of gmm, with quantization="fp8_blockwise_fp8_wgrad"
and pre-quantised weights: x's row and column tiles from one read in the forward, the
column tiles kept; dy's likewise in the backward), its forward alone train_fwd_* (the
output: what a step's forward runs), and the backward as their difference, vjp_*
(vjp_fp8_fp8_vs_bf16 is the library's pair against bf16's); and the dgrads and wgrads
alone, each on pre-quantised operands (dgrad_fp8:
gmm_fp8 of dy's 1 x 128 tiles, as moe()'s backward gets them from the kernel that makes
dy; wgrad_fp8: tgmm_fp8) and with its quantisation included (dgrad_fp8_quant,
wgrad_fp8_quant). dy is random (normal, 0.01 scale): constant data would draw less power
at the cap and run at a higher clock than a step's. TFLOP/s count 2 M K N per product. Each forward
contender's output is checked against bf16 moe_xla's (<name>_rel_err), so a contender
that computes something else shows. On an NVIDIA GPU each contender's mean SM clock over
its turns is reported too (<name>_mhz, NVML samples every 10 ms): these products hold the
GPU at its power cap, so TFLOP/s per MHz tells a kernel's efficiency from the clock it ran at.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from pathlib import Path

# torch allocates beside JAX in this process: JAX's default preallocation (75% of the GPU)
# left an H100 too little for torch's FP8 operands of the mixtral case.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

from _gpu_samples import start_sampler
from _timing import alternating_times, environment, grouped_matmul_inputs, normal, torch_grouped_mm, torch_sync, write_results

import jax
import jax.numpy as jnp
import numpy as np

import moe_xla
from moe_xla.primitives import gmm_fp8 as gmm_fp8_module
from moe_xla.primitives import tgmm_fp8 as tgmm_fp8_module


def _torch_scaled_grouped_mm(lhs, rhs, gs):
    """A no-argument call of torch._scaled_grouped_mm with row-wise e4m3 operands, or None
    (with the reason printed) where torch, CUDA or the op is missing or refuses."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_grouped_mm"):
        return None
    a = torch.from_numpy(np.array(lhs, np.float32)).to("cuda")
    b = torch.from_numpy(np.array(rhs, np.float32)).to("cuda")  # [G, K, N]
    sa = a.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    sb = b.abs().amax(dim=1).clamp(min=1e-12) / 448.0  # [G, N]
    qa = (a / sa[:, None]).to(torch.float8_e4m3fn)
    qb = (b / sb[:, None, :]).to(torch.float8_e4m3fn).transpose(1, 2).contiguous().transpose(1, 2)
    offs = torch.from_numpy(np.cumsum(np.asarray(gs)).astype(np.int32)).to("cuda")

    def call():
        return torch._scaled_grouped_mm(qa, qb, sa, sb, offs=offs, out_dtype=torch.bfloat16)

    try:
        call()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - a torch build without the kernel is a result, not a crash
        print(f"torch._scaled_grouped_mm unavailable here: {err}", flush=True)
        return None
    return call


def _forward_contenders(lhs, rhs, gs, paths=(), keep=lambda name: True):
    """The forward contenders that `keep` names, and bf16 (every rel_err's reference)."""
    wq = moe_xla.quantize_fp8_weights(rhs)
    qx, sx = jax.jit(moe_xla.quantize_fp8_rows)(lhs)
    fp8_ops = (qx, sx, wq.data_t, wq.scales, gs)
    ops = {"bf16": (moe_xla.gmm, (lhs, rhs, gs)), "fp8": (moe_xla.gmm_fp8, fp8_ops),
           "fp8_quant": (lambda a, w, g: moe_xla.gmm(a, w, g, quantization="fp8_blockwise"), (lhs, rhs, gs))}
    ops.update({f"fp8@{path}": (functools.partial(moe_xla.gmm_fp8, path=path), fp8_ops) for path in paths})
    impls = {}
    for name, (fn, args) in ops.items():
        if name == "bf16" or keep(name):
            impls[name] = (functools.partial(jax.jit(fn).lower(*args).compile(), *args), jax.block_until_ready)
    for name, make in (("torch_bf16", torch_grouped_mm), ("torch_fp8", _torch_scaled_grouped_mm)):
        call = make(lhs, rhs, gs) if keep(name) else None
        if call is not None:
            impls[name] = (call, torch_sync)
    return impls


def _backward_contenders(lhs, rhs, gs, wgrad_paths=(), keep=lambda name: True):
    wq = moe_xla.quantize_fp8_weights(rhs)
    dy = normal(jax.random.key(1), (lhs.shape[0], rhs.shape[2]), lhs.dtype, 0.01)
    m = lhs.shape[0]

    def dgrad_bf16(dy, w, g):
        return moe_xla.gmm(dy, w, g, transpose_rhs=True)

    def dgrad_fp8(q, s, wq, g):
        return moe_xla.gmm_fp8(q, s, wq.data, jnp.swapaxes(wq.scales, 1, 2), g)

    def dgrad_fp8_quant(dy, wq, g):
        return dgrad_fp8(*moe_xla.quantize_fp8_rows(dy), wq, g)

    def wgrad_bf16(x, dy, g):
        return moe_xla.tgmm(x, dy, g)

    def wgrad_fp8_quant(x, dy, g):
        qx, sx = moe_xla.quantize_fp8_group_cols(x, g)
        qdy, sdy = moe_xla.quantize_fp8_group_cols(dy, g)
        return moe_xla.tgmm_fp8(qx, sx, qdy, sdy, g, rows=m, preferred_element_type=jnp.bfloat16)

    def pair(dgrad, wgrad):
        return lambda x, dy, w, g: (dgrad(dy, w, g), wgrad(x, dy, g))

    def train(quantization, backward=True):
        # A training step's product through the library, weights pre-quantised: the forward
        # as a step runs it (for the FP8 wgrad with x's column tiles, which the backward
        # takes), and with backward the step's output and gradients. Both return what a step
        # returns, so that XLA drops nothing a step computes and copies no residual out.
        kw = {} if quantization is None else {"quantization": quantization, "quantized_rhs": wq}

        def step(x, w, dy, g):
            out, vjp_fn = jax.vjp(lambda x, w: moe_xla.gmm(x, w, g, **kw), x, w)
            return (out, vjp_fn(dy)) if backward else out
        return step

    fp8_fp8 = "fp8_blockwise_fp8_wgrad"
    ops = {"train_fwd_bf16": (train(None, False), (lhs, rhs, dy, gs)),
           "train_fwd_fp8_fp8": (train(fp8_fp8, False), (lhs, rhs, dy, gs)),
           "train_bf16": (train(None), (lhs, rhs, dy, gs)),
           "train_fp8_fp8": (train(fp8_fp8), (lhs, rhs, dy, gs)),
           "dgrad_bf16": (dgrad_bf16, (dy, rhs, gs)),
           "dgrad_fp8": (dgrad_fp8, (*moe_xla.quantize_fp8_rows(dy), wq, gs)),
           "dgrad_fp8_quant": (dgrad_fp8_quant, (dy, wq, gs)),
           "wgrad_bf16": (wgrad_bf16, (lhs, dy, gs)), "wgrad_fp8_quant": (wgrad_fp8_quant, (lhs, dy, gs)),
           "pair_bf16": (pair(dgrad_bf16, wgrad_bf16), (lhs, dy, rhs, gs)),
           "pair_fp8": (pair(dgrad_fp8_quant, wgrad_bf16), (lhs, dy, wq, gs)),
           "pair_fp8_fp8": (pair(dgrad_fp8_quant, wgrad_fp8_quant), (lhs, dy, wq, gs))}
    quantized = (*moe_xla.quantize_fp8_group_cols(lhs, gs), *moe_xla.quantize_fp8_group_cols(dy, gs))
    wgrad_fp8 = functools.partial(moe_xla.tgmm_fp8, rows=m, preferred_element_type=jnp.bfloat16)
    for name, path in [("wgrad_fp8", "auto")] + [(f"wgrad_fp8@{p}", p) for p in wgrad_paths]:
        ops[name] = (functools.partial(wgrad_fp8, path=path), (*quantized, gs))
    # The two FP8 GEMMs of the backward on pre-quantised operands (dy's rows for the dgrad,
    # x's and dy's column tiles for the wgrad), as the forward's fp8 contender is timed.
    ops["pair_fp8_fp8_pre"] = (lambda rows, cols, wq, g: (dgrad_fp8(*rows, wq, g), wgrad_fp8(*cols, g)),
                               (tuple(moe_xla.quantize_fp8_rows(dy)), quantized, wq, gs))
    block = jax.block_until_ready
    impls = {}
    for name, (fn, args) in ops.items():
        if not keep(name):
            continue
        compiled = jax.jit(fn).lower(*args).compile()
        impls[name] = (functools.partial(compiled, *args), block)
    return impls


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--kinds", nargs="*", help="group-size kinds (default: all)")
    parser.add_argument("--m-scale", type=float, default=1.0)
    parser.add_argument("--turn-seconds", type=float, default=0.4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-backward", action="store_true")
    parser.add_argument("--paths", nargs="*", default=[], choices=gmm_fp8_module.PATHS[1:],
                        help="also time gmm_fp8 forced onto these kernels")
    parser.add_argument("--wgrad-paths", nargs="*", default=[], choices=tgmm_fp8_module.PATHS[2:],
                        help="also time tgmm_fp8 forced onto these kernels")
    parser.add_argument("--only", nargs="*", metavar="PREFIX",
                        help="time only the contenders whose names start with one of these (ratios where "
                             "both sides ran); the forward's bf16 always runs, the reference of *_rel_err")
    args = parser.parse_args()
    keep = lambda name: args.only is None or name.startswith(tuple(args.only))
    rows = []
    sampler = start_sampler() if jax.devices()[0].platform == "gpu" else None
    for case, kind, lhs, rhs, gs in grouped_matmul_inputs(args.cases, args.kinds, m_scale=args.m_scale):
        (m, k), n = lhs.shape, rhs.shape[2]
        flops = 2.0 * m * k * n
        row = {"case": case["name"], "groups": kind, "M": m, "K": k, "N": n, "G": rhs.shape[0]}
        sections = [("fwd", _forward_contenders(lhs, rhs, gs, args.paths, keep))]
        if not args.skip_backward:
            sections.append(("bwd", _backward_contenders(lhs, rhs, gs, args.wgrad_paths, keep)))
        ref = np.asarray(sections[0][1]["bf16"][0](), np.float32)
        for name, (call, _) in sections[0][1].items():
            out = call()
            out = np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, np.float32)
            row[f"{name}_rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        for _, impls in sections:
            if not impls:  # --only kept none of this section's contenders
                continue
            times, spans = alternating_times(impls, args.turn_seconds, args.rounds)
            for name, ts in times.items():
                t = statistics.median(ts)
                products = 2 if name.startswith("pair") else 3 if name in ("train_bf16", "train_fp8_fp8") else 1
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_tflops"] = products * flops / t / 1e12
                if sampler is not None:
                    row[f"{name}_mhz"] = sampler.summary(spans[name])["sm_mhz"]
        for q in ("bf16", "fp8_fp8"):  # the backward alone: the step less its forward
            if f"train_{q}_ms" in row and f"train_fwd_{q}_ms" in row:
                row[f"vjp_{q}_ms"] = row[f"train_{q}_ms"] - row[f"train_fwd_{q}_ms"]
        # name: (baseline, contender), the ratio baseline time / contender time.
        ratios = {"fp8_vs_bf16": ("bf16", "fp8"), "fp8_quant_vs_bf16": ("bf16", "fp8_quant"),
                  "fp8_vs_torch_fp8": ("torch_fp8", "fp8"), "dgrad_fp8_vs_bf16": ("dgrad_bf16", "dgrad_fp8"),
                  "dgrad_fp8_quant_vs_bf16": ("dgrad_bf16", "dgrad_fp8_quant"),
                  "pair_fp8_vs_bf16": ("pair_bf16", "pair_fp8"), "pair_fp8_fp8_vs_bf16": ("pair_bf16", "pair_fp8_fp8"),
                  "pair_fp8_fp8_pre_vs_bf16": ("pair_bf16", "pair_fp8_fp8_pre"),
                  "vjp_fp8_fp8_vs_bf16": ("vjp_bf16", "vjp_fp8_fp8"),
                  "train_fp8_fp8_vs_bf16": ("train_bf16", "train_fp8_fp8"),
                  "wgrad_fp8_vs_bf16": ("wgrad_bf16", "wgrad_fp8"),
                  "wgrad_fp8_quant_vs_bf16": ("wgrad_bf16", "wgrad_fp8_quant")}
        for name, (base, contender) in ratios.items():
            if f"{base}_ms" in row and f"{contender}_ms" in row:
                row[name] = row[f"{base}_ms"] / row[f"{contender}_ms"]
        rows.append(row)
        print(row, flush=True)
        # This case's operands and executables go before the next case's are made (a large
        # case's torch buffers left torch's FP8 contender out of memory on the next one).
        del sections, impls, call, out, lhs, rhs
    if sampler is not None:
        sampler.stop()
    columns = ["case", "groups", "bf16_tflops", "fp8_tflops", "bf16_mhz", "fp8_mhz", "fp8_quant_tflops",
               "torch_bf16_tflops",
               "torch_fp8_tflops", "fp8_rel_err", "torch_bf16_rel_err", "torch_fp8_rel_err", "fp8_vs_bf16", "fp8_quant_vs_bf16", "fp8_vs_torch_fp8",
               "dgrad_bf16_tflops", "dgrad_fp8_tflops", "dgrad_fp8_vs_bf16", "dgrad_fp8_quant_vs_bf16", "pair_fp8_vs_bf16", "pair_fp8_fp8_vs_bf16", "pair_fp8_fp8_pre_vs_bf16", "vjp_fp8_fp8_vs_bf16",
               "train_fp8_fp8_vs_bf16", "wgrad_bf16_tflops", "wgrad_fp8_tflops",
               "wgrad_fp8_vs_bf16", "wgrad_fp8_quant_vs_bf16"] + \
        [f"fp8@{path}_{v}" for path in args.paths for v in ("tflops", "mhz")] + \
        [f"wgrad_fp8@{path}_tflops" for path in args.wgrad_paths]
    write_results(args.out, f"gmm_fp8_{jax.devices()[0].platform}", environment(), rows, columns)


if __name__ == "__main__":
    main()
