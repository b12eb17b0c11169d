"""Finds the compiled moe_xla library, loads it with ctypes and registers its FFI targets.

The library (`libmoe_xla.so`, built by Bazel as //moe_xla:libmoe_xla.so) holds one
C-ABI handler symbol per (op, platform). It is looked for at $MOE_XLA_LIBRARY, then at
moe_xla/_native/libmoe_xla.so (where `pip install .` and scripts/build.sh put it).
"""

from __future__ import annotations

import ctypes
import functools
import os
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


def target_name(op: str, platform: str) -> str:
    """The stable, versioned FFI target name users see in HLO dumps."""
    return f"moe_xla_{op}_{platform}_v1"


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


def require_kernel(op: str, platform: str) -> str:
    """Returns the FFI target name of `op` on `platform`, or raises with build instructions."""
    if _load() is None:
        raise RuntimeError(f"{_BUILD_HINT} (looked at {library_path()})")
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
    lib = _load()
    fn = getattr(lib, symbol)
    fn.argtypes = [ctypes.c_int64] * len(sizes)
    fn.restype = ctypes.c_int64
    return int(fn(*sizes))


def use_reference() -> bool:
    """True when the pure-JAX reference lowering was asked for (MOE_XLA_IMPL=reference)."""
    impl = os.environ.get("MOE_XLA_IMPL", "kernel")
    if impl not in ("kernel", "reference"):
        raise ValueError(f"MOE_XLA_IMPL: expected 'kernel' or 'reference', got {impl!r}")
    return impl == "reference"
