"""moe_xla: dropless Mixture-of-Experts primitives for JAX, lowered to XLA FFI kernels."""

import importlib

from moe_xla.aux_losses import MoeAux
from moe_xla.fp8 import Fp8Weights, dequantize_fp8_rows, quantize_fp8_weights
from moe_xla.grouped import gmm
from moe_xla.moe import moe
from moe_xla.primitives.activate_quantize_fp8_group_cols import activate_quantize_fp8_group_cols
from moe_xla.primitives.gather_gmm import gather_gmm
from moe_xla.primitives.gather_gmm_activate import gather_gmm_activate
from moe_xla.primitives.gather_quantize_fp8_group_cols import gather_quantize_fp8_group_cols
from moe_xla.primitives.gather_tgmm import gather_tgmm
from moe_xla.primitives.gmm_fp8 import gmm_fp8
from moe_xla.primitives.permute import permute
from moe_xla.primitives.quantize_fp8_blocks import quantize_fp8_blocks
from moe_xla.primitives.quantize_fp8_group_cols import quantize_fp8_group_cols
from moe_xla.primitives.quantize_fp8_rows import quantize_fp8_rows
from moe_xla.primitives.quantize_fp8_rows_group_cols import quantize_fp8_rows_group_cols
from moe_xla.primitives.ragged_dot import ragged_dot
from moe_xla.primitives.route import route
from moe_xla.primitives.tgmm import tgmm
from moe_xla.primitives.tgmm_fp8 import tgmm_fp8
from moe_xla.primitives.unpermute import unpermute
from moe_xla.routing_bias import update_routing_bias

__all__ = ["Fp8Weights", "MoeAux", "activate_quantize_fp8_group_cols", "dequantize_fp8_rows", "gather_gmm",
           "gather_gmm_activate", "gather_quantize_fp8_group_cols", "gather_tgmm", "gmm", "gmm_fp8", "moe", "permute",
           "quantize_fp8_blocks", "quantize_fp8_group_cols", "quantize_fp8_rows", "quantize_fp8_rows_group_cols",
           "quantize_fp8_weights", "ragged_dot", "route", "tgmm", "tgmm_fp8", "unpermute", "update_routing_bias"]


def __getattr__(name):
    """moe_xla.nnx (the Flax NNX module, which needs flax) is imported on first use only."""
    if name == "nnx":
        return importlib.import_module("moe_xla.nnx")
    raise AttributeError(f"module 'moe_xla' has no attribute {name!r}")
