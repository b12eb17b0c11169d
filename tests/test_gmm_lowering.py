"""HLO of jitted gmm code shows the versioned custom calls; the reference lowering is opt-in;
gmm_fp8's and tgmm_fp8's path names match the CUDA sources (a source-tree check)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import moe_xla
from moe_xla import _lib
from moe_xla.primitives import gmm_fp8 as gmm_fp8_module
from moe_xla.primitives import tgmm_fp8 as tgmm_fp8_module

PLATFORM = "cuda" if jax.default_backend() == "gpu" else "cpu"


def _loss(lhs, rhs, gs):
    return jnp.sum(moe_xla.gmm(lhs, rhs, gs) ** 2)


def test_grad_hlo_has_gmm_and_tgmm_custom_calls():
    args = (jnp.ones((16, 8)), jnp.ones((2, 8, 4)), jnp.array([7, 9], jnp.int32))
    hlo = jax.jit(jax.grad(_loss, (0, 1))).lower(*args).compile().as_text()
    assert f'custom_call_target="moe_xla_gmm_{PLATFORM}_v1"' in hlo
    assert f'custom_call_target="moe_xla_tgmm_{PLATFORM}_v1"' in hlo
    assert "transpose_rhs=true" in hlo.replace(" ", "") or "transpose_rhs = true" in hlo


def test_reference_lowering_only_on_request(monkeypatch):
    args = (jnp.ones((16, 8)), jnp.ones((2, 8, 4)), jnp.array([7, 9], jnp.int32))
    # Lowerings are cached per function: each setting gets a fresh function.
    monkeypatch.setenv("MOE_XLA_IMPL", "reference")
    text = jax.jit(lambda *a: _loss(*a)).lower(*args).as_text()
    assert "moe_xla_gmm" not in text.replace("moe_xla_gmm[", "")
    assert "custom_call" not in text
    monkeypatch.setenv("MOE_XLA_IMPL", "fast")
    with pytest.raises(ValueError, match="MOE_XLA_IMPL: expected 'kernel' or 'reference', got 'fast'"):
        jax.jit(lambda *a: _loss(*a)).lower(*args)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_missing_library_is_a_clear_error(monkeypatch, tmp_path, platform):
    """For CUDA the lowering sizes the kernel's workspace with a function of the library
    before it names the kernel: that too must give the build hint."""
    monkeypatch.setenv("MOE_XLA_LIBRARY", str(tmp_path / "nope.so"))
    _lib._load.cache_clear()
    try:
        args = jnp.ones((4, 2)), jnp.ones((1, 2, 2)), jnp.array([4], jnp.int32)
        with pytest.raises(RuntimeError, match="scripts/build.sh"):
            jax.jit(lambda *a: _loss(*a)).trace(*args).lower(lowering_platforms=(platform,))
    finally:
        monkeypatch.undo()
        _lib._load.cache_clear()
        _lib._load()


def test_paths_name_the_cuda_kernels_in_attribute_order():
    """PATHS[i] is the kernel of attribute value i: kAuto, then kFp8GemmPaths' order
    (cuda/fp8_grouped_gemm.h), each by fp8_gemm_path_name's string (fp8_grouped_gemm.cu)."""
    cuda = Path(__file__).resolve().parents[1] / "cuda"
    header = (cuda / "fp8_grouped_gemm.h").read_text()
    listed = header[header.index("kFp8GemmPaths[] = {"):]
    order = re.findall(r"Fp8GemmPath::(k\w+),", listed[:listed.index("};")])
    names = dict(re.findall(r'case Fp8GemmPath::(k\w+): return "(\w+)";', (cuda / "fp8_grouped_gemm.cu").read_text()))
    assert gmm_fp8_module.PATHS == (names["kAuto"], *(names[k] for k in order))


def test_wgrad_paths_name_the_cuda_enum_in_value_order():
    """tgmm_fp8's PATHS[i] is cuda::Fp8WgradPath value i (cuda/fp8_wgrad.h), named by
    path_name's string (fp8_wgrad.cu, the name its errors give), and kFp8WgradPathCount
    (the handler's range) counts them all."""
    cuda = Path(__file__).resolve().parents[1] / "cuda"
    header = (cuda / "fp8_wgrad.h").read_text()
    body = header[header.index("enum class Fp8WgradPath"):]
    values = {int(v): name for name, v in re.findall(r"\b(k\w+) = (\d+)", body[:body.index("};")])}
    names = dict(re.findall(r'case Fp8WgradPath::(k\w+): return "(\w+)";', (cuda / "fp8_wgrad.cu").read_text()))
    assert tgmm_fp8_module.PATHS == tuple(names[values[i]] for i in range(len(values)))
    assert int(re.search(r"kFp8WgradPathCount = (\d+);", header).group(1)) == len(tgmm_fp8_module.PATHS)
