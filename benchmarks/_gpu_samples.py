"""NVML samples of the GPU's SM clock, power, temperature and clock-throttle reasons, taken by
a thread while benchmarks run, summarised over the spans of each contender's turns."""

from __future__ import annotations

import ctypes
import statistics
import threading
import time


class Sampler(threading.Thread):
    """(time, SM MHz, W, degrees C, throttle-reason bits) of NVML's device 0 (CUDA_VISIBLE_DEVICES
    does not apply: run on a one-GPU machine) every `period` s, read through libnvidia-ml with
    ctypes (no Python NVML package needed), until stop()."""

    POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap
    THERMAL = 0x20 | 0x40  # software / hardware thermal slowdown

    def __init__(self, period=0.01):
        super().__init__(daemon=True)
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        self.handle = ctypes.c_void_p()
        for status in (nvml.nvmlInit_v2(), nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle))):
            if status:
                raise RuntimeError(f"NVML error {status}")
        self.nvml, self.period = nvml, period
        # Renamed "clocks event reasons" in newer drivers; the old name is kept as an alias.
        self.reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.samples, self.done = [], threading.Event()

    def _read(self):
        """SM MHz, W, degrees C, reason bits; None for any reading NVML refuses."""
        clock, milliwatts, celsius, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        ok = [self.nvml.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(clock)) == 0,  # NVML_CLOCK_SM
              self.nvml.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(milliwatts)) == 0,
              self.nvml.nvmlDeviceGetTemperature(self.handle, 0, ctypes.byref(celsius)) == 0,  # NVML_TEMPERATURE_GPU
              self.reasons(self.handle, ctypes.byref(reasons)) == 0]
        values = (clock.value, milliwatts.value / 1e3, celsius.value, reasons.value)
        return tuple(v if good else None for v, good in zip(values, ok))

    def run(self):
        while not self.done.is_set():
            self.samples.append((time.perf_counter(), *self._read()))
            time.sleep(self.period)

    def stop(self):
        self.done.set()
        self.join()

    def summary(self, spans):
        """Mean SM MHz, W and degrees C, and the fractions of samples throttled by the power
        cap and by temperature, over the samples inside any of the (start, end) spans."""
        inside = [s[1:] for s in self.samples if any(t0 <= s[0] < t1 for t0, t1 in spans)]

        def mean(i):
            got = [s[i] for s in inside if s[i] is not None]
            return statistics.fmean(got) if got else None

        def share(bits):
            got = [s[3] for s in inside if s[3] is not None]
            return sum(1 for r in got if r & bits) / len(got) if got else None

        return dict(sm_mhz=mean(0), watts=mean(1), temp_c=mean(2), power_capped=share(self.POWER_CAP),
                    thermal=share(self.THERMAL))


def start_sampler(period=0.01):
    """A started Sampler, or None where NVML cannot be loaded (no NVIDIA driver)."""
    try:
        sampler = Sampler(period)
    except (OSError, RuntimeError):
        return None
    sampler.start()
    return sampler
