"""Accuracy of the FP8 layer: moe_xla.moe's output and every gradient against a float32
layer, for bf16 and each FP8 quantization, on the moe_layer cases of cases.json.

    python benchmarks/fp8_accuracy.py [--out benchmarks/results] [--cases NAME ...] [--t-scale 0.25]

Inputs as benchmarks/moe_layer.py makes them (x, weights and cotangent bf16; logits
f32). The truth is the same layer on those values in float32 (moe_xla's f32 kernels).
For each of "bf16" (quantization None), and the FP8 quantizations ("fp8_blockwise": bf16
wgrad; "fp8_blockwise_fp8_wgrad"), the relative Frobenius error
|a - truth| / |truth| of y, dx, d logits, d w_in and d w_out. The routing is computed
from the same logits in every variant, so the errors are those of the expert products.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _timing import environment, moe_inputs, routing_options, write_results

import jax
import jax.numpy as jnp

import moe_xla

CASES = json.loads((Path(__file__).parent / "cases.json").read_text())
VARIANTS = {"bf16": None, "fp8_blockwise": "fp8_blockwise", "fp8_blockwise_fp8_wgrad": "fp8_blockwise_fp8_wgrad"}
OUTPUTS = ("y", "dx", "dlogits", "dw_in", "dw_out")


def _value_and_grads(case, quantization, inputs, ct):
    def loss(x, logits, w_in, w_out):
        y = moe_xla.moe(x, logits, w_in, w_out, **routing_options(case), activation="swiglu",
                        quantization=quantization)
        return jnp.vdot(y.astype(jnp.float32), ct), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*inputs)
    return (y, *grads)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cases", nargs="*", help="case names (default: every moe_layer case)")
    parser.add_argument("--t-scale", type=float, default=0.25, help="scale T")
    args = parser.parse_args()
    rows = []
    for i, case in enumerate(CASES["moe_layer"]):
        if args.cases and case["name"] not in args.cases:
            continue
        t = max(1, int(case["T"] * args.t_scale))
        inputs, ct = moe_inputs(jax.random.key(i), t, case["H"], case["F"], case["E"])
        truth = _value_and_grads(case, None, [a.astype(jnp.float32) for a in inputs], ct)
        row = {"case": case["name"], "T": t}
        for name, quantization in VARIANTS.items():
            got = _value_and_grads(case, quantization, inputs, ct)
            for out, a, b in zip(OUTPUTS, got, truth):
                err = jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()) / jnp.linalg.norm(b.ravel())
                row[f"{name}_{out}"] = float(err)
            del got
        rows.append(row)
        print(row, flush=True)
    columns = ["case", "T"] + [f"{name}_{out}" for name in VARIANTS for out in OUTPUTS]
    write_results(args.out, f"fp8_accuracy_{jax.devices()[0].platform}", environment(), rows, columns)


if __name__ == "__main__":
    main()
