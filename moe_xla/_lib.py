"""Finds the compiled moe_xla library, loads it with ctypes and registers its FFI targets.

The library (`libmoe_xla.so`, built by Bazel as //moe_xla:libmoe_xla.so) holds one
C-ABI handler symbol per (op, platform). It is looked for at $MOE_XLA_LIBRARY, then at
moe_xla/_native/libmoe_xla.so (where `pip install .` and scripts/build.sh put it).

Before the first CUDA lowering it checks the local GPUs against what the CUDA kernels are
built for (cuda/device_support.h states the same rules): compute capability 9.0 runs every
kernel; 8.x and 10.0 or later run them all but the grouped GEMM only on its SIMT kernels
(the CUTLASS ones need 9.0), which is correct but slow, so it warns once; any other GPU has
no kernel image, so it raises, naming the capability.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path

import jax

_BUILD_HINT = (
    "moe_xla's compiled library was not found. Build it with `scripts/build.sh` "
    "(Bazel; it copies the library to moe_xla/_native/), install the package with "
    "`pip install .`, or point MOE_XLA_LIBRARY at a built libmoe_xla.so. "
    "To run the slow pure-JAX reference instead, set MOE_XLA_IMPL=reference."
)

# (op, platform) -> C symbol in the library.
_SYMBOLS = {
    (op, platform): f"MoeXla{op.capitalize()}{platform.capitalize()}"
    for op in ("gmm", "tgmm", "route", "permute", "unpermute")
    for platform in ("cpu", "cuda")
}
# FP8 ops (common/fp8_blockwise.h, fp8_grouped_gemm.h), gather_rows,
# activate_weighted_grad and the EP dispatch plan (common/ep_plan.h): symbols in
# CamelCase, MoeXlaQuantizeFp8RowsCpu, MoeXlaQuantizeFp8WeightsCuda,
# MoeXlaActivateQuantizeFp8Cpu, MoeXlaGmmFp8Cuda, MoeXlaTgmmFp8Cpu, MoeXlaGatherRowsCpu.
_SYMBOLS.update({
    (op, platform): f"MoeXla{op.title().replace('_', '')}{platform.capitalize()}"
    for op in ("quantize_fp8_rows", "quantize_fp8_blocks", "quantize_fp8_weights", "quantize_fp8_group_cols",
               "quantize_fp8_rows_group_cols", "gather_quantize_fp8_group_cols", "activate_quantize_fp8_group_cols",
               "activate_quantize_fp8", "activate_grad_quantize_fp8", "expand_quantize_fp8_rows", "gmm_fp8",
               "tgmm_fp8", "gather_rows", "activate_weighted_grad", "ep_dedup_rows", "ep_row_places", "route_grad")
    for platform in ("cpu", "cuda")
})

# gather_gmm and gather_tgmm have a CUDA kernel only (other platforms lower their
# decompositions).
# gather_gmm v2 takes the `transpose_rhs` attribute, gather_tgmm v2 `transpose_out`; their
# symbols carry the version, so that a library built before a version registers no target
# under its name.
_SYMBOLS[("gather_gmm", "cuda")] = "MoeXlaGatherGmmCudaV2"
_SYMBOLS[("gather_tgmm", "cuda")] = "MoeXlaGatherTgmmCudaV2"
# permute v2 returns row_pairs, a fourth result; unpermute v2 takes its weights as an
# optional last operand (none: every weight 1).
_SYMBOLS[("permute", "cpu")] = "MoeXlaPermuteCpuV2"
_SYMBOLS[("permute", "cuda")] = "MoeXlaPermuteCudaV2"
_SYMBOLS[("unpermute", "cpu")] = "MoeXlaUnpermuteCpuV2"
_SYMBOLS[("unpermute", "cuda")] = "MoeXlaUnpermuteCudaV2"
# route v2 takes its bias as an optional last operand (none: no selection bias) and no
# has_bias attribute.
_SYMBOLS[("route", "cpu")] = "MoeXlaRouteCpuV2"
_SYMBOLS[("route", "cuda")] = "MoeXlaRouteCudaV2"
# ep_dedup_rows v2 returns weight_sources, a fourth result.
_SYMBOLS[("ep_dedup_rows", "cpu")] = "MoeXlaEpDedupRowsCpuV2"
_SYMBOLS[("ep_dedup_rows", "cuda")] = "MoeXlaEpDedupRowsCudaV2"
# expand_quantize_fp8_rows v2 takes its factor as an optional last operand (none: every
# factor 1).
_SYMBOLS[("expand_quantize_fp8_rows", "cpu")] = "MoeXlaExpandQuantizeFp8RowsCpuV2"
_SYMBOLS[("expand_quantize_fp8_rows", "cuda")] = "MoeXlaExpandQuantizeFp8RowsCudaV2"
# gather_gmm_activate (gather_gmm with the expert activation in its epilogue) has a CUDA
# kernel only; its symbol carries its version from the start.
_SYMBOLS[("gather_gmm_activate", "cuda")] = "MoeXlaGatherGmmActivateCudaV1"
# activate_weighted_grad v2 returns weighted (b = omega * a), a third result.
_SYMBOLS[("activate_weighted_grad", "cpu")] = "MoeXlaActivateWeightedGradCpuV2"
_SYMBOLS[("activate_weighted_grad", "cuda")] = "MoeXlaActivateWeightedGradCudaV2"
# `after` (primitives/after.py): one handler for both platforms, launching nothing.
_SYMBOLS[("after", "cpu")] = _SYMBOLS[("after", "cuda")] = "MoeXlaAfter"

# An op's version rises with each change of its handler's operands or attributes, so that
# an HLO module written for the old signature fails by name, not by an attribute mismatch.
# gmm_fp8 v2 takes the `path` attribute, gather_gmm v2 `transpose_rhs`, gather_tgmm v2
# `transpose_out`, permute v2 returns row_pairs, unpermute v2 takes no weights for weights 1,
# route v2 no bias operand without a bias, ep_dedup_rows v2 returns weight_sources,
# expand_quantize_fp8_rows v2 takes no factor for factors 1, activate_weighted_grad v2 returns
# weighted.
_VERSIONS = {"gmm_fp8": 2, "gather_gmm": 2, "gather_tgmm": 2, "permute": 2, "unpermute": 2, "route": 2,
             "ep_dedup_rows": 2, "expand_quantize_fp8_rows": 2, "activate_weighted_grad": 2}


def target_name(op: str, platform: str) -> str:
    """The stable, versioned FFI target name users see in HLO dumps."""
    return f"moe_xla_{op}_{platform}_v{_VERSIONS.get(op, 1)}"


def library_path() -> Path:
    override = os.environ.get("MOE_XLA_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).parent / "_native" / "libmoe_xla.so"


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    path = library_path()
    if not path.exists():
        return None
    lib = ctypes.cdll.LoadLibrary(str(path))
    for (op, platform), symbol in _SYMBOLS.items():
        if hasattr(lib, symbol):
            jax.ffi.register_ffi_target(
                target_name(op, platform),
                jax.ffi.pycapsule(getattr(lib, symbol)),
                platform="CUDA" if platform == "cuda" else "cpu",
            )
    return lib


def has_kernel(op: str, platform: str) -> bool:
    lib = _load()
    return lib is not None and hasattr(lib, _SYMBOLS[(op, platform)])


def _gpu_support(compute_capability: str) -> str:
    """'full', 'simt' or 'none' for a GPU of compute capability "major.minor"."""
    major, minor = (int(part) for part in compute_capability.split(".")[:2])
    if major == 9:
        return "full" if minor == 0 else "none"
    return "simt" if major == 8 or major >= 10 else "none"


@functools.lru_cache(maxsize=None)
def _check_cuda_devices(grouped_gemm: bool) -> None:
    """Raises if a local CUDA device has no moe_xla kernel image; warns once when the grouped
    GEMM (`grouped_gemm`) would run its slow SIMT kernels. No local GPU: nothing to check."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return
    for device in devices:
        capability = getattr(device, "compute_capability", None)
        if capability is None:
            continue
        support = _gpu_support(capability)
        if support == "none":
            raise RuntimeError(
                f"moe_xla: {device.device_kind} ({device}) has compute capability {capability}; "
                "moe_xla's CUDA kernels need 8.x, 9.0 or 10.0 and later (built for sm_80, sm_90a, "
                "sm_100 and compute_100 PTX). Set MOE_XLA_IMPL=reference to run the pure-JAX "
                "reference implementation instead."
            )
        if support == "simt" and grouped_gemm:
            warnings.warn(
                f"moe_xla: {device.device_kind} ({device}) has compute capability {capability}: "
                "gmm and tgmm run their SIMT kernels there (the CUTLASS grouped GEMM needs 9.0, "
                "Hopper), which are correct but much slower. MOE_XLA_IMPL=reference lowers them "
                "to XLA's own ops instead.",
                stacklevel=3,
            )
            return


@functools.lru_cache(maxsize=None)
def local_gpus_hopper() -> bool:
    """Whether every local CUDA device has compute capability 9.0, which the Hopper-only
    kernels (gather_gmm's, gather_tgmm's) need; True with no local CUDA device (a program lowered for CUDA
    there is meant for the kernels' target, where the handler checks the device again)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return True
    capabilities = (getattr(d, "compute_capability", None) for d in devices)
    return all(c is None or _gpu_support(c) == "full" for c in capabilities)


def _loaded() -> ctypes.CDLL:
    """The library, or a RuntimeError with build instructions when there is none."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"{_BUILD_HINT} (looked at {library_path()})")
    return lib


def require_kernel(op: str, platform: str) -> str:
    """Returns the FFI target name of `op` on `platform`, or raises with build instructions
    (or, for CUDA, when a local GPU has no kernel image for it)."""
    if platform == "cuda":
        _check_cuda_devices(op in ("gmm", "tgmm", "gmm_fp8", "tgmm_fp8"))
    _loaded()
    if not has_kernel(op, platform):
        raise RuntimeError(
            f"moe_xla: the library at {library_path()} has no {platform} kernel for {op}; "
            f"it was built without {'CUDA (nvcc and nvidia-cutlass)' if platform == 'cuda' else platform}. "
            f"Rebuild on a machine with the toolkit, or set MOE_XLA_IMPL=reference."
        )
    return target_name(op, platform)


def cuda_workspace_bytes(symbol: str, *sizes: int) -> int:
    """Calls the library's `int64_t symbol(int64_t...)` sizing function of a CUDA handler's
    workspace result (see ffi/workspace.h)."""
    fn = getattr(_loaded(), symbol)
    fn.argtypes = [ctypes.c_int64] * len(sizes)
    fn.restype = ctypes.c_int64
    return int(fn(*sizes))


def use_reference() -> bool:
    """True when the pure-JAX reference lowering was asked for (MOE_XLA_IMPL=reference)."""
    impl = os.environ.get("MOE_XLA_IMPL", "kernel")
    if impl not in ("kernel", "reference"):
        raise ValueError(f"MOE_XLA_IMPL: expected 'kernel' or 'reference', got {impl!r}")
    return impl == "reference"
