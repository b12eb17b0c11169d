"""The EP layer's compiled step has nothing XLA:GPU would read back to the host: every
`while` in the optimised HLO of a forward + backward step has a known trip count (XLA
writes `known_trip_count` into its backend_config; a loop without one runs until a
predicate read back to the host says stop) and there is no `conditional` at all (a
stronger check than "no conditional's predicate depends on the routing"). Without
capacity_factor the step has no loop at all; with it the rounds' loops run exactly
R - 1 times (sizing.exchange_sizes), the bound every step pays whatever the routing.

Checked on 8 CPU devices with and without capacity_factor (whose overflow rounds are a
loop), for both transports, with dedup on and off and with redundant experts; the HLO of XLA:CPU stands in for
XLA:GPU's here, the loops being those of the traced program.

Also: the padded transport's step, like moe()'s, has no scatter (each one is a graph node
and a fill on XLA:GPU): every inverse map comes from a kernel (permute's row_pairs,
ep_row_places) and is read by gathers; with redundant experts the replicas' weight
gradients sum into their owners' by a gather and a fixed-order sum (primitives/select_rows.py),
where a scatter-add's atomics would add them in a different order from run to run.

And two arrays the step does without: the rows' plan reads route's expert ids as their
slots (no [T, k] array of local slots), and the send buffer's forward and backward
gathers share one index array (two launches fewer on XLA:CPU; XLA:GPU had fused both
into other kernels already: LOG.md, session 46).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_xla
from conftest import requires_8_devices
from moe_xla.ep.sizing import exchange_sizes

pytestmark = requires_8_devices

T, H, F, E, K = 64, 16, 8, 16, 3


def loops_and_conditionals(hlo: str):
    """([(name, known trip count or None)] of every while, [names of conditionals]) in HLO text."""
    loops, conditionals = [], []
    for line in hlo.splitlines():
        op = re.search(r"%(\S+) = .*? (while|conditional)\(", line)
        if op is None:
            continue
        if op.group(2) == "conditional":
            conditionals.append(op.group(1))
        else:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            loops.append((op.group(1), None if trips is None else int(trips.group(1))))
    return loops, conditionals


def test_loops_and_conditionals_are_read_from_hlo_text():
    hlo = "\n".join([
        '  %while.1 = (s32[]) while(%t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"5"}}',
        "  %while.2 = (s32[]) while(%t), condition=%c, body=%b, metadata={op_name=\"x\"}",
        "  %conditional.3 = f32[] conditional(%p, %a, %b), true_computation=%t, false_computation=%f",
        "  %add.4 = f32[] add(%a, %b)"])
    assert loops_and_conditionals(hlo) == ([("while.1", 5), ("while.2", None)], ["conditional.3"])


REPLICAS = ((8, 9),) + ((0, 1),) * 7  # experts 0 and 1 on every rank, 8 and 9 on rank 0 too
STEPS = [("padded", True, None, None), ("padded", False, 0.5, None), ("ragged", True, 0.5, None),
         ("padded", True, 0.5, REPLICAS)]  # (transport, dedup, capacity_factor, redundant_experts)


@functools.cache
def step_hlo(transport, dedup, capacity_factor, redundant_experts) -> str:
    """The optimised HLO of a forward + backward step of the EP layer on 8 devices (it
    depends on the shapes alone, so the arguments are abstract)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))

    def loss(x, logits, w_in, w_out):
        y = moe_xla.moe(x, logits, w_in, w_out, top_k=K, mesh=mesh, expert_axis="ep", transport=transport,
                        dedup=dedup, capacity_factor=capacity_factor, redundant_experts=redundant_experts)
        return jnp.sum(y * y)

    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((T, H), (T, E), (E, H, 2 * F), (E, F, H))]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile().as_text()


@pytest.mark.parametrize("transport,dedup,capacity_factor,redundant_experts", STEPS)
def test_step_has_known_trip_counts_and_no_conditionals(transport, dedup, capacity_factor, redundant_experts):
    loops, conditionals = loops_and_conditionals(step_hlo(transport, dedup, capacity_factor, redundant_experts))
    assert [name for name, trips in loops if trips is None] == [], loops
    assert conditionals == []
    if capacity_factor is None:
        # one round: no loop at all (XLA:GPU launches each iteration of even a bounded loop from the host,
        # though it reads nothing back)
        assert loops == []
    else:  # the overflow rounds are a loop: it is there, and bounded
        assert loops


@pytest.mark.parametrize("transport,dedup,capacity_factor,redundant_experts",
                         [s for s in STEPS if s[0] == "padded"] + [("padded", False, None, None)])
def test_padded_step_has_no_scatter(transport, dedup, capacity_factor, redundant_experts):
    hlo = step_hlo(transport, dedup, capacity_factor, redundant_experts)
    assert not re.search(r"\sscatter\(", hlo), [line for line in hlo.splitlines() if " scatter(" in line]


def test_moe_step_has_no_scatter():
    def loss(x, logits, w_in, w_out):
        return jnp.sum(moe_xla.moe(x, logits, w_in, w_out, top_k=K) ** 2)

    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((T, H), (T, E), (E, H, 2 * F), (E, F, H))]
    for mode in ("copy", "gather"):  # both of the backward's reads of the cotangent
        with moe_xla.product_combine.forced(mode):
            hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile().as_text()
        assert not re.search(r"\sscatter\(", hlo), (mode, [line for line in hlo.splitlines() if " scatter(" in line])


@pytest.mark.parametrize("transport,dedup,capacity_factor,redundant_experts",
                         [s for s in STEPS if s[2] is not None])
def test_rounds_loops_run_rounds_minus_one_times(transport, dedup, capacity_factor, redundant_experts):
    # The bound is what every step pays (moe_xla/ep/rounds.py), so it is pinned: the
    # rounds 1 .. R-1 loop (forward) and its transpose (backward) run R - 1 times, and the
    # only other loop is round_starts' scan over the R rounds.
    sizes = exchange_sizes(T // 8, K, E, 8, dedup=dedup, capacity_factor=capacity_factor,
                           extra_slots=0 if redundant_experts is None else len(redundant_experts[0]))
    assert sizes.rounds > 2  # the overflow rounds are a loop of more than one iteration
    loops, _ = loops_and_conditionals(step_hlo(transport, dedup, capacity_factor, redundant_experts))
    assert sorted(trips for _, trips in loops) == [sizes.rounds - 1, sizes.rounds - 1, sizes.rounds], loops


def _defining_line(hlo: str, name: str) -> str:
    """The line of HLO text that defines instruction `name`."""
    return next(line for line in hlo.splitlines() if re.match(rf"\s*(ROOT )?%?{re.escape(name)} = ", line))


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "no_dedup"])
def test_rows_take_the_routed_ids_as_their_slots(dedup):
    # The pairs' slots are numbered over all ranks (placement.expert_slots): without
    # replicas they are route's expert ids as they are, so the kernel that plans the rows
    # (ep_dedup_rows, or ep_row_places without dedup) reads route's ids and no [T, k]
    # array of local slots ids % E_l is computed for it.
    hlo = step_hlo("padded", dedup, None, None)
    target = "moe_xla_ep_dedup_rows" if dedup else "moe_xla_ep_row_places"
    plan = next(line for line in hlo.splitlines() if f'custom_call_target="{target}_' in line)
    operands = re.search(r"custom-call\(([^)]*)\)", plan).group(1).split(", ")
    slots = operands[1] if dedup else operands[2]  # (dest, lid) / (row_dest, row_map, lids)
    line = _defining_line(hlo, slots.lstrip("%"))
    if not dedup:  # lids [T*k, 1] is the ids reshaped: a bitcast of them
        line = _defining_line(hlo, re.search(r"bitcast\(%?([\w.-]+)\)", line).group(1))
    route = re.search(r"get-tuple-element\(%?([\w.-]+)\), index=1", line)
    assert route, line
    assert 'custom_call_target="moe_xla_route_' in _defining_line(hlo, route.group(1)), line


def test_send_buffer_gathers_share_one_index_array():
    # The tokens' rows are packed into the send buffer (forward) and the combine's cotangent
    # is gathered into its layout (backward) through the same places' tokens, computed one
    # way (_rows.pair_sources of the places' sources), so XLA computes the index array once.
    sizes = exchange_sizes(T // 8, K, E, 8)
    shape = f"[{sizes.peers * sizes.rows},{H}]"
    gathers = [line for line in step_hlo("padded", True, None, None).splitlines()
               if 'custom_call_target="moe_xla_gather_rows_' in line and f" f32{shape}" in line]
    indices = {re.search(r"custom-call\(%?[\w.-]+, %?([\w.-]+)\)", line).group(1) for line in gathers}
    assert len(gathers) == 2 and len(indices) == 1, gathers
