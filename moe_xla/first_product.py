"""How moe() feeds its first expert product, h = x_sorted @ w_in[e] for the rows of e:

    "copy"    permute writes x_sorted [T*k, H], the tokens' rows in expert order, and gmm
              reads it;
    "gather"  permute only sorts (a zero-width permute: group_sizes and row_map, no rows),
              and gather_gmm reads each row x[src[r]] straight from the tokens, src[r] the
              token of sorted row r (the inverse of row_map, divided by k).
The EP layer's receiving rank feeds its first product the same two ways, from the rows it
received instead of the tokens (ep/layer.py).

The gather path saves the write and the read of x_sorted (2 T k H elements) in the forward;
its kernel pays for the gather in its own throughput, so it is chosen only where the saved
copy is worth more (benchmarks/results/LOG.md): `choose` gathers on Hopper GPUs, in bf16
without FP8 quantization (whose sorted rows are written with their FP8 rows in one pass,
moe._sorted_rows_fp8), for w_in of at most GATHER_MAX_N columns (N = 2F for gated experts).
GatheredRows.gmm is a custom_jvp whose primal is gather_gmm. Its derivative rule is either
gather_gmm's own (`derivative_gathers`): the weight gradient gather_tgmm reads the rows
through src as well, and d x is d x_sorted summed back to the tokens through permute's
row_map (one gather-sum), so a training step keeps no x_sorted; or the copy path's
(GatheredRows.copy, then gmm), where the sorted copy of the rows costs less than the
gathering weight gradient (for moe()'s rows its sort then runs twice, once with
zero-width rows).

gather_gmm_activate is the gathered first product with the expert activation fused into
the kernel's epilogue (the product stays float32 until the activation, one rounding);
`activation_fuses` says where its kernel applies, and there moe()'s forward runs it
(experts._fused_forward_mlp).

`forced` overrides the choice for tests and benchmarks. The choice is made while tracing:
a function jitted under one mode keeps it in its compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import moe_xla._choice as _choice
import moe_xla._lib as _lib
import moe_xla.primitives.gather_gmm_activate as _gather_gmm_activate
from moe_xla.primitives.ep_expand import expand
from moe_xla.primitives.gather_gmm import gather_gmm, kernel_supports
from moe_xla.primitives.gmm import gmm
from moe_xla.primitives.permute import permute

MODES = _choice.MODES
GATHER_MAX_N = 1024
# Largest w_in width whose derivative gathers under "auto": where the layer's step gains on
# the H200 (the step then keeps no x_sorted). Past it the gathered derivative ties the copy
# path (N = 1024, 1536) or loses (N = 2048) (benchmarks/results/LOG.md, sessions 17 and 33).
GATHER_DERIVATIVE_MAX_N = 512

_override = _choice.Override("first_product")


def forced(mode: str):
    """Within the block moe() traces its first product as `mode`: "gather" (forward and
    derivative), "copy", or "auto" (`choose`, `derivative_gathers`). "gather" applies to the
    bf16 / f16 / f32 products; FP8 quantization keeps its own path."""
    return _override.forced(mode)


def choose(x, w_in, top_k: int) -> str:
    """"gather" or "copy" for moe()'s unquantised first product of x [T, H] and w_in
    [E, H, N] (module docstring), unless `forced`."""
    if _override.mode != "auto":
        return _override.mode
    gathers = (jax.default_backend() == "gpu" and _lib.local_gpus_hopper() and jnp.dtype(x.dtype) == jnp.bfloat16
               and w_in.shape[2] <= GATHER_MAX_N
               and kernel_supports(x.shape, w_in.shape, x.shape[0] * top_k, x.dtype, x.dtype))
    return "gather" if gathers else "copy"


def activation_fuses(x, w_in, top_k: int, activation: str) -> bool:
    """Whether gather_gmm_activate of the rows of x [T, H] (top_k each) and w_in [E, H, N]
    runs the fused CUDA kernel here (a Hopper GPU, bf16, the shapes of its kernel_supports:
    for gated activations F = N / 2 a multiple of 128); elsewhere it computes the same
    values through its decomposition."""
    return (jax.default_backend() == "gpu" and _lib.local_gpus_hopper()
            and _gather_gmm_activate.kernel_supports(x.shape, w_in.shape, x.shape[0] * top_k, x.dtype, activation))


def derivative_gathers(w_in) -> bool:
    """Whether a gathered first product of w_in [E, H, N] takes gather_gmm's own derivative
    (module docstring), unless `forced`."""
    if _override.mode != "auto":
        return _override.mode == "gather"
    return w_in.shape[2] <= GATHER_DERIVATIVE_MAX_N


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _gathered_product(rows, w, group_sizes, gathered_derivative):
    """gmm(rows.copy(), w, group_sizes): gather_gmm, differentiated as gather_gmm
    (gathered_derivative) or as the copy path."""
    return gather_gmm(rows.x, rows.src, w, group_sizes)


@_gathered_product.defjvp
def _gathered_product_jvp(gathered_derivative, primals, tangents):
    rows, w, group_sizes = primals
    if gathered_derivative:
        product = lambda x, w: gather_gmm(x, rows.src, w, group_sizes, token_slots=rows.token_slots)  # noqa: E731
    else:
        product = lambda x, w: gmm(dataclasses.replace(rows, x=x).copy(), w, group_sizes)  # noqa: E731
    return jax.jvp(product, (rows.x, w), (tangents[0].x, tangents[1]))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "src", "token_slots", "expert_ids"],
                   meta_fields=["num_experts"])
@dataclasses.dataclass(frozen=True)
class GatheredRows:
    """The rows x_sorted[r] = x[src[r]] of x [T, H], left in x: src [M] int32 (outside
    [0, T): a zero row), token_slots [T, k] int32 its inverse, token_slots[t, j] the j-th
    row r with src[r] = t, outside [0, M) for none (every row with src[r] in [0, T) named
    once: permute's row_map reshaped, or the EP layer's slots of its received rows).
    expert_ids [T, k] and num_experts: where the rows are permute(x, expert_ids,
    num_experts)'s, its arguments, for `copy`; else None. A pytree (num_experts static)."""
    x: jax.Array
    src: jax.Array
    token_slots: jax.Array
    expert_ids: jax.Array | None = None
    num_experts: int | None = None

    def gmm(self, w, group_sizes):
        """gmm(x_sorted, w, group_sizes) without x_sorted."""
        return _gathered_product(self, w, group_sizes, derivative_gathers(w))

    def copy(self):
        """x_sorted [M, H] in memory: permute's copy where the rows are permute's (each token
        read once for its k rows), else ep_expand (a row read per place, through src); either
        transposes to a gather-sum, unpermute through the rows' slots."""
        if self.expert_ids is not None:
            return permute(self.x, self.expert_ids, self.num_experts)[0]
        return expand(self.x, self.token_slots, num_pairs=self.src.shape[0], sources=self.src)


def sorted_rows(x, expert_ids, num_experts: int):
    """permute(x, expert_ids, num_experts, return_row_pairs=True) with x_sorted as
    GatheredRows: (rows, group_sizes, row_map, row_pairs), the sort alone (permute of
    zero-width rows); the rows' tokens are row_pairs // k."""
    t, k = expert_ids.shape
    _, group_sizes, row_map, row_pairs = permute(jnp.zeros((t, 0), x.dtype), expert_ids, num_experts,
                                                 return_row_pairs=True)
    # row_map is a permutation of the T*k rows: every row has a token.
    rows = GatheredRows(x, row_pairs // k, row_map.reshape(t, k), expert_ids, num_experts)
    return rows, group_sizes, row_map, row_pairs
