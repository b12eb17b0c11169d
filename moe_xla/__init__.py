"""moe_xla: dropless Mixture-of-Experts primitives for JAX, lowered to XLA FFI kernels."""

from moe_xla.primitives.gmm import gmm
from moe_xla.primitives.ragged_dot import ragged_dot
from moe_xla.primitives.tgmm import tgmm

__all__ = ["gmm", "ragged_dot", "tgmm"]
