"""Expert parallelism (EP) for moe(): experts split over a mesh axis, tokens sent to them.

Layout. On a mesh with an expert axis of size P (and data axes D), w_in / w_out [E, ...]
are split over the expert axis (rank p holds experts [p E_l, (p+1) E_l), E_l = E / P)
and replicated over D; tokens x [T, H] and router_logits [T, E] are split over
D x expert axis. The layer is one jax.shard_map in which every collective is an
all_to_all (or ragged_all_to_all) over the expert axis: no rank gathers weights or tokens.

Per rank, for each of `chunks` slices of its tokens (independent of each other, so XLA
may run the dispatch of one chunk while the grouped GEMMs of another run):

  route     weights, ids = route(logits)                [T, k]; slot = ids, dest = slot // E_l
            (slots numbered over all ranks, rank d's local slot lid is d E_l + lid; with
            redundant experts the slot of one of the expert's replicas, placement.py; the
            rank's weights then gain its S replica slots, replicas.py)
  rows      one row per (token, j) without dedup; with dedup one row per (token,
            destination), sent once however many of the token's experts live there:
              _, counts, row_map = permute(zeros [T, 0], row_dest, P)   their order, grouped by destination
            each row carries the local experts it asks for, lids [mult] (slot % E_l, taken
            as the send buffer is packed; E_l = none, mult = min(k, E_l) with dedup, else 1)
            and, with dedup, their routing weights
  dispatch  the rows of destination d go to rank d (a transport, in rounds), packed
            straight from the tokens into the send slabs (ep_expand: no [T*k, H] rows);
            with FP8 expert products the tokens' FP8 rows and scales travel instead,
            about half the bytes (fp8_dispatch.py)
  experts   on the receiving rank, the (row, local expert) pairs in expert order:
              _, group_sizes, slots = permute(zeros [N, 0], lids, E_l)   (the sort alone)
              x_exp[slots[q, j]] = rows[q];  y_exp = gmm(act(gmm(x_exp, w_in)), w_out)
            where moe() reads its tokens through gather_gmm (first_product.py: a Hopper
            GPU, bf16) the first product reads x_exp's rows where they arrived, no copy
              back[q] = sum_j w[q, j] y_exp[slots[q, j]]    (dedup: the rank's partial sum)
              back[q] = y_exp[slots[q, 0]]                  (no dedup: the expert output, w 1)
            the sum being unpermute over the pair rows, expert_mlp's combine: moe()'s
            backward rule (product_combine.py; fp8.mlp_combine_fp8), which keeps no y_exp
  return    back rows travel to their sender, into the places their rows left
  combine   y = unpermute(y_rows, row_map, c) of the rows in their grouped places,
            accumulated in float32 in j order: without dedup c = weights, so
            y[t] = sum_j weights[t, j] y_{e_j}(x[t]) is the single-device sum, bitwise;
            with dedup c = 1 on the first j of each destination, so y[t] adds the per-rank
            partial sums (equal to f32 rounding); with dedup in one round the same sum is
            taken straight from the returned slabs (unpermute with the slabs' slots, weights 1).
  shared    the shared expert on the local tokens (no communication), added last as in moe().

Buffers are static and the layer is dropless with no host synchronisation: sizing.py
sizes the exchange, rounds.py cuts the rows into rounds that fit it, transports.py moves
them, layer.py is the layer; config.py checks the options; placement.py and replicas.py
are the redundant experts (place_redundant_experts, public, computes a placement).

Autodiff is JAX's, through rules: all_to_all transposes to all_to_all, ragged_all_to_all to
ragged_all_to_all, permute / unpermute / gmm by theirs, and the expansion of rows to their
places (primitives/ep_expand.py, the gather_rows kernel) and the sum back (unpermute with
those places as its row map) to each other, so gradients are deterministic.
Forward mode (jax.jvp, jax.linearize) works too, through capacity rounds included (their
tangent is one linear primitive, primitives/ep_rounds_tangent.py). jax.vmap of the layer
folds the batch into rows.
"""

from moe_xla.ep.placement import place_redundant_experts

__all__ = ["place_redundant_experts"]
