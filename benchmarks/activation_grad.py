"""Benchmark: the routing-weighted expert activation's backward (activate_weighted_grad:
d h, d omega and b = omega * a from h, g and omega, the bf16 layer's act bwd stage) in
GB/s, against its jnp formula under XLA and a plain device copy of the same bytes, taking
turns on the device in the same run (alternating_times).

    python benchmarks/activation_grad.py [--out benchmarks/results] [--name activation_grad] [--ops kernel xla copy]

Shapes (M routed rows = T k, F, bf16, swiglu): the benchmark layers' expert rows
(benchmarks/cases.json: SonicMoE's three 30B configurations, qwen3, deepseek-v3, mixtral).
Bytes = h read (2F per row) + g read (F) + d h written (2F) + b written (F), 6 M F x 2
bytes (omega and d omega, 8 M, left out), for every op; the copy reads and writes an array
of half that many bytes, so it moves the same bytes; fraction_of_copy = the copy's time /
the op's time. The kernel is called through its FFI target without the primitive's alias
of g and b: in a benchmark g is an input that stays live, so the alias would add XLA's copy
of g, which the layer's step does not make.
"""

from __future__ import annotations

from _timing import OP_COLUMNS, environment, normal, op_parser, op_rows, write_results

import jax
import jax.numpy as jnp

import numpy as np

from moe_xla import _lib
from moe_xla.activations import ACTIVATIONS
from moe_xla.primitives.activate_weighted_grad import formula

# (name, M, F)
SHAPES = [("sonicmoe_n256", 32768 * 16, 256), ("sonicmoe_n512", 32768 * 8, 512),
          ("sonicmoe_n1024", 32768 * 4, 1024), ("qwen3", 16384 * 8, 768), ("deepseek_v3", 8192 * 8, 2048),
          ("mixtral", 16384 * 2, 14336)]


def main():
    args = op_parser(__doc__, "activation_grad").parse_args()
    platform = "cuda" if jax.devices()[0].platform == "gpu" else "cpu"

    def kernel(h, g, omega):
        results = [jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(omega.shape, jnp.float32),
                   jax.ShapeDtypeStruct(g.shape, g.dtype)]
        return jax.ffi.ffi_call(_lib.require_kernel("activate_weighted_grad", platform), results)(
            h, g, omega, activation=np.int32(ACTIVATIONS.index("swiglu")))

    ops = {
        "kernel": lambda h, g, omega, c: kernel(h, g, omega),
        "xla": lambda h, g, omega, c: formula(h, g, omega, "swiglu"),
        "copy": lambda h, g, omega, c: c.copy(),
    }
    rows = []
    for name, m, f in SHAPES:
        keys = jax.random.split(jax.random.key(0), 3)
        h = normal(keys[0], (m, 2 * f), jnp.bfloat16)
        g = normal(keys[1], (m, f), jnp.bfloat16)
        omega = jax.random.uniform(keys[2], (m,), jnp.float32)
        nbytes = 6 * m * f * 2
        copied = jnp.zeros((nbytes // 8,), jnp.float32)  # nbytes / 2 read + nbytes / 2 written
        rows += op_rows(args, name, f"M{m} F{f} bf16 swiglu", ops, (h, g, omega, copied), nbytes)
        del h, g, omega, copied
    write_results(args.out, args.name, environment(), rows, OP_COLUMNS)


if __name__ == "__main__":
    main()
