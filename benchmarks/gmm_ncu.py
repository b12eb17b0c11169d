"""The grouped GEMM kernels of moe_xla.gmm and torch._grouped_mm on one case, a few calls
each, for Nsight Compute to compare (benchmarks/gpu_check.sh, step ncu-gmm):

    ncu -k regex:device_kernel -c 4 python benchmarks/gmm_ncu.py --case qwen3-30b-a3b.down --groups uniform

Runs `--calls` jitted gmm calls, then `--calls` torch._grouped_mm calls on copies of the
same inputs (weights K-major for torch, see _timing.torch_grouped_mm), synchronising
after each side.
"""

from __future__ import annotations

import argparse

from _timing import grouped_matmul_inputs, torch_grouped_mm

import jax

import moe_xla


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="qwen3-30b-a3b.down")
    parser.add_argument("--groups", default="uniform")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    (case, kind, lhs, rhs, gs), = grouped_matmul_inputs([args.case], [args.groups])
    fwd = jax.jit(moe_xla.gmm).lower(lhs, rhs, gs).compile()
    for _ in range(args.calls):
        out = fwd(lhs, rhs, gs)
    out.block_until_ready()
    call = torch_grouped_mm(lhs, rhs, gs)
    if call is None:
        raise SystemExit("gmm_ncu: torch._grouped_mm is not available")
    import torch

    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"gmm_ncu: {case['name']} {kind}: {args.calls} calls each", flush=True)


if __name__ == "__main__":
    main()
