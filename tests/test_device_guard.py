"""The Python half of the device guard: which GPUs moe_xla's CUDA kernels run on, checked at
the first CUDA lowering (moe_xla/_lib.py; the C++ half is tests/cc/device_support_test)."""

import types
import warnings

import jax
import pytest

from moe_xla import _lib


@pytest.mark.parametrize("capability, support", [
    ("9.0", "full"),                                   # Hopper: sm_90a SASS, the CUTLASS paths
    ("8.0", "simt"), ("8.6", "simt"), ("8.9", "simt"),  # sm_80 SASS runs on every 8.x
    ("10.0", "simt"), ("12.0", "simt"),                 # sm_100 SASS / compute_100 PTX
    ("7.5", "none"), ("7.0", "none"), ("9.1", "none"),  # no image (sm_90a runs on 9.0 only)
])
def test_gpu_support_table(capability, support):
    assert _lib._gpu_support(capability) == support


@pytest.fixture
def fake_gpus(monkeypatch):
    """Makes jax.devices("cuda") return fake devices of the given capabilities."""
    real = jax.devices

    def install(*capabilities):
        fakes = [types.SimpleNamespace(compute_capability=c, device_kind=f"GPU sm{c}") for c in capabilities]
        monkeypatch.setattr(jax, "devices", lambda backend=None: fakes if backend == "cuda" else real(backend))
        _lib._check_cuda_devices.cache_clear()

    yield install
    _lib._check_cuda_devices.cache_clear()


def test_unsupported_gpu_raises_naming_capability_and_hint(fake_gpus):
    fake_gpus("9.0", "7.5")
    with pytest.raises(RuntimeError, match=r"7\.5.*MOE_XLA_IMPL=reference"):
        _lib._check_cuda_devices(False)


def test_simt_gpu_warns_for_the_grouped_gemm_only(fake_gpus):
    fake_gpus("8.6")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lib._check_cuda_devices(False)  # route / permute / unpermute: full speed there, no warning
    with pytest.warns(UserWarning, match=r"8\.6.*SIMT"):
        _lib._check_cuda_devices(True)


def test_hopper_passes_silently(fake_gpus):
    fake_gpus("9.0", "9.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lib._check_cuda_devices(True)
