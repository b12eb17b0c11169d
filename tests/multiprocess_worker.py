"""One process of the multi-process EP run of tests/test_multiprocess.py.

    python tests/multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES DATA OUT_DIR

Started NUM_PROCESSES times with JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=N, each joins the coordinator at
127.0.0.1:PORT, builds the global (data x) ep mesh over every process's devices, builds the
test's inputs from the fixed seed (tests/test_multiprocess.py:inputs), places them on the
mesh as global arrays, runs the jitted EP moe() forward pass (dedup off and on) and its
gradients twice, gathers the results of both runs to every process and writes them to
OUT_DIR/process{PROCESS_ID}.npz, the first run under the names in NAMES, the second under
those names + "_again". The test compares them; the worker checks no results, so that a
wrong answer fails the test and is never taken for a failed launch and retried.
"""

from __future__ import annotations

import os
import sys

import jax

# Cross-process collectives on CPU go through gloo (the default of this JAX, said explicitly).
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_multiprocess import NAMES, TOP_K, inputs  # noqa: E402  (no jax state at import)


def main(port, process_id, num_processes, data, out_dir):
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=30)
    import moe_xla  # after initialize, as any JAX computation must be

    assert jax.process_count() == num_processes and jax.process_index() == process_id
    devices = jax.devices()  # global: every process's CPU devices
    assert len(devices) > len(jax.local_devices())
    peers = len(devices) // data
    if data == 1:  # jax.make_mesh: an Explicit axis over both processes' devices
        mesh = jax.make_mesh((peers,), ("ep",), devices=devices)
        tok = P("ep")
    else:  # Auto axes, laid out so that the expert axis, not only the data axis, crosses processes
        grid = np.array(devices, dtype=object).reshape(peers, data).T
        assert len({d.process_index for d in grid[0]}) == num_processes
        mesh = Mesh(grid, ("data", "ep"))
        tok = P(("data", "ep"))

    x, logits, w_in, w_out, ct = inputs()
    specs = (tok, tok, P("ep"), P("ep"), tok)

    def place(a, spec):
        # Every process holds the whole array (same seed); each keeps only its shards.
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

    x, logits, w_in, w_out, ct = (place(a, s) for a, s in zip((x, logits, w_in, w_out, ct), specs))
    assert not x.is_fully_addressable

    def ep(*a, dedup):
        return moe_xla.moe(*a, top_k=TOP_K, mesh=mesh, expert_axis="ep", dedup=dedup)

    @jax.jit
    def run(x, logits, w_in, w_out, ct):
        y = ep(x, logits, w_in, w_out, dedup=False)
        y_dedup = ep(x, logits, w_in, w_out, dedup=True)
        grads = jax.grad(lambda *a: jnp.sum(ep(*a, dedup=True) * ct), argnums=(0, 1, 2, 3))(x, logits, w_in, w_out)
        return (y, y_dedup) + grads

    first = run(x, logits, w_in, w_out, ct)
    again = run(x, logits, w_in, w_out, ct)
    # process_allgather(tiled=True) assembles each global array on every process.
    gathered = {}
    for suffix, results in (("", first), ("_again", again)):
        for n, r in zip(NAMES, results):
            gathered[n + suffix] = np.asarray(multihost_utils.process_allgather(r, tiled=True))
    path = os.path.join(out_dir, f"process{process_id}.npz")
    np.savez(path + ".tmp.npz", **gathered)
    os.replace(path + ".tmp.npz", path)
    multihost_utils.sync_global_devices("moe_xla multiprocess test done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    port, pid, nproc, data = (int(a) for a in sys.argv[1:5])
    main(port, pid, nproc, data, sys.argv[5])
