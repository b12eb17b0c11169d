"""Expert parallelism over a global mesh spanning several processes (jax.distributed).

Two CPU processes (tests/multiprocess_worker.py), each with its own host devices, join one
coordinator, build one global mesh over all their devices and run the same jitted
moe(..., mesh=mesh, expert_axis="ep") on global arrays; the gathered result must be the
single-process, single-device moe(): bitwise in the forward pass without dedup, to f32
rounding with dedup and in the gradients; and each process's second run bitwise equal to
its first.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np

T, H, F, E, TOP_K = 32, 16, 8, 8, 3
NAMES = ("y", "y_dedup", "dx", "dlogits", "dw_in", "dw_out")  # what a worker saves, per run
NUM_PROCESSES = 2
TIMEOUT_S = 90  # for both workers together
ATTEMPTS = 2  # a launch that fails (e.g. the coordinator port taken meanwhile) is retried once


def inputs():
    """The fixed-seed inputs, identical in every process: x, logits, w_in, w_out, ct (numpy, float32)."""
    rng = np.random.default_rng(20261129)
    x = rng.standard_normal((T, H), dtype=np.float32)
    logits = rng.standard_normal((T, E), dtype=np.float32)
    w_in = rng.standard_normal((E, H, 2 * F), dtype=np.float32) / np.float32(np.sqrt(H))
    w_out = rng.standard_normal((E, F, H), dtype=np.float32) / np.float32(np.sqrt(F))
    ct = rng.standard_normal((T, H), dtype=np.float32)
    return x, logits, w_in, w_out, ct


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path, devices_per_process, data):
    """Runs the workers (_launch), retrying a failed launch (a worker that crashed or hung)
    once on a fresh port; the workers check no results, the caller compares them, so a wrong
    answer is never retried away."""
    failures = []
    for attempt in range(ATTEMPTS):
        try:
            return _launch(tmp_path / f"attempt{attempt}", devices_per_process, data)
        except AssertionError as err:
            failures.append(str(err))
    raise AssertionError("\n\n".join(failures))


def _launch(tmp_path, devices_per_process, data):
    """Starts the workers, waits for them (killing all on a failure or timeout), returns their results."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    worker = os.path.join(root, "tests", "multiprocess_worker.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    port = _free_port()
    procs = []
    for i in range(NUM_PROCESSES):
        log = open(tmp_path / f"worker{i}.log", "w+b")
        cmd = [sys.executable, worker, str(port), str(i), str(NUM_PROCESSES), str(data), str(tmp_path)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root), log))
    deadline = time.monotonic() + TIMEOUT_S
    failure = None
    try:
        while failure is None and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                failure = "a worker failed"
            elif time.monotonic() > deadline:
                failure = f"workers still running after {TIMEOUT_S} s"
            else:
                time.sleep(0.1)
        if failure is None and any(p.returncode != 0 for p, _ in procs):
            failure = "a worker failed"
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if failure is not None:
        logs = []
        for i, (p, log) in enumerate(procs):
            log.seek(0)
            logs.append(f"--- worker {i} (exit {p.returncode}) ---\n{log.read().decode(errors='replace')[-6000:]}")
        for _, log in procs:
            log.close()
        raise AssertionError(failure + "\n" + "\n".join(logs))
    for _, log in procs:
        log.close()
    return [dict(np.load(tmp_path / f"process{i}.npz")) for i in range(NUM_PROCESSES)]


def _one_device():
    import jax
    import jax.numpy as jnp

    import moe_xla

    # On the CPU, as the workers run (the bitwise check compares CPU kernels), whatever the default backend.
    with jax.default_device(jax.devices("cpu")[0]):
        x, logits, w_in, w_out, ct = (jnp.asarray(a) for a in inputs())
        one = lambda *a: moe_xla.moe(*a, top_k=TOP_K)  # noqa: E731
        y = jax.jit(one)(x, logits, w_in, w_out)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(one(*a) * ct), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
    return {n: np.asarray(v) for n, v in zip(("y", "dx", "dlogits", "dw_in", "dw_out"), (y,) + grads)}


# (devices per process, data axis size): a 1-D ep mesh of 4 over 2 processes, and a
# 2 x 2 data x ep mesh whose expert axis itself spans both processes. (A 2 x 4 mesh with 4
# CPU devices per process hung now and then inside XLA:CPU's gloo collectives, in about
# one run of five here; two devices per process did not in 20 runs.)
MESHES = [(2, 1), (2, 2)]


def test_multiprocess_ep_matches_one_device(tmp_path):
    # Imported here, not at the top: conftest starts JAX's backends, and the workers import this
    # module before jax.distributed.initialize.
    from conftest import assert_close

    ref = _one_device()
    for devices_per_process, data in MESHES:
        run_dir = tmp_path / f"d{devices_per_process}x{data}"
        run_dir.mkdir()
        results = _run_workers(run_dir, devices_per_process, data)
        for i, res in enumerate(results):
            for n in NAMES:
                np.testing.assert_array_equal(res[n + "_again"], res[n], err_msg=f"process {i}: {n} run to run")
                # every process gathered the same global arrays
                np.testing.assert_array_equal(res[n], results[0][n], err_msg=f"process {i}: {n}")
        res = results[0]
        np.testing.assert_array_equal(res["y"], ref["y"])  # dedup off: the single-device sum, bitwise
        assert_close(res["y_dedup"], ref["y"], np.float32)  # 1e-5 relative
        for n in ("dx", "dlogits", "dw_in", "dw_out"):
            assert res[n].shape == ref[n].shape, n
            assert_close(res[n], ref[n], np.float32, scale=10)  # 1e-4 relative
