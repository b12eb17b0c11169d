"""moe_xla.nnx.MoE: the moe() layer as a Flax NNX module (pip install "moe_xla[flax]"; flax >= 0.12.6).

    logits = x.astype(float32) @ router                        # [..., E], float32
    y = moe(x', logits, w_in', w_out', top_k=..., bias=router_bias, shared_experts=(shared_in', shared_out'),
            **moe_options)
    (x', w_in', ... cast to the computation dtype: `dtype`, or x's dtype when it is None)

Parameters (nnx.Param, the names a checkpoint holds), with logical sharding names in
their `out_sharding` metadata (nnx.get_partition_spec; map the names onto mesh axes with
nnx.logical_axis_rules). Built under jax.set_mesh (and those rules) the parameters are
created sharded (flax's eager sharding); elsewhere the names are metadata only:
    router      [H, E]             float32      ("embed", "expert")
    w_in        [E, H, 2F] or [E, H, F]         ("expert", "embed", "mlp")    gated: gate | up
    w_out       [E, F, H]                       ("expert", "mlp", "embed")
    shared_in   [H, 2Fs] or [H, Fs]             ("embed", "mlp")              with shared_ffn_size
    shared_out  [Fs, H]                         ("mlp", "embed")
    router_bias [E]                float32      ("expert",)    a RouterBias, not a Param, with router_bias=True

Every call sows moe()'s MoeAux as nnx.Intermediate "moe_aux" (a tuple, one MoeAux per call):
under nnx.capture(fn, nnx.Intermediate) it comes back with fn's result; outside one (which
flax >= 0.12.6 deprecates) it is stored on the module until nnx.pop(model, nnx.Intermediate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_xla.activations import GATED
from moe_xla.moe import moe

# Options the module sets itself; every other moe() keyword passes through **moe_options.
_OWN_OPTIONS = {"top_k", "activation", "bias", "shared_experts", "return_aux"}


def fan_in_init(key, shape, dtype=jnp.float32):
    """Truncated normal of variance 1 / shape[-2] (the fan-in of x @ w); leading axes index kernels."""
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                             batch_axis=tuple(range(len(shape) - 2)))(key, shape, dtype)


def _eager_sharding() -> bool:
    """Flax's eager sharding (variables created sharded by their annotations), applied only
    under a mesh context (jax.set_mesh): without one the annotations are metadata only."""
    return nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty


def _param_factory():
    """param(init, names, rngs, shape, dtype): an nnx.Param from init, annotated with the logical names."""
    eager = _eager_sharding()

    def param(init, names, rngs, shape, dtype):
        return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype), eager_sharding=eager)
    return param


class RouterBias(nnx.Variable):
    """The selection bias of sigmoid routing (route()'s `bias`): moves which experts are picked,
    not their weights, and gets no gradient. Not an nnx.Param, so nnx.grad and optax leave it
    alone; the training loop updates it from the sown tokens_per_expert (auxiliary-loss-free
    balancing)."""


class MoE(nnx.Module):
    """Dropless Mixture-of-Experts layer: y = sum_j weights_j * expert_{e_j}(x) (+ shared expert).

    x [..., H] -> y [..., H]: the router scores logits = x @ router (float32), moe_xla.moe
    routes every token to its top_k experts, each expert computes
    act(x @ w_in[e]) @ w_out[e], and the outputs are summed with the routing weights; see
    moe_xla.moe for the routing, parallelism and quantisation options (score, n_groups,
    topk_groups, renormalize, scale, mesh, expert_axis, data_axes, transport, dedup,
    capacity_factor, chunks, quantization), all accepted here as **moe_options and passed
    to every call: quantization="fp8_blockwise" runs both expert products in FP8 blockwise
    on the parameters cast to `dtype` (quantised afresh each call, so w_in and w_out get
    their gradients as usual; the router and the shared expert stay unquantised).

    Args:
        hidden_size: H. ffn_size: F, each expert's hidden width. num_experts: E. top_k: k.
        rngs: nnx.Rngs; the parameters draw from rngs.params().
        activation: "swiglu" or "geglu" (w_in [E, H, 2F], gate | up) or "gelu", "silu", "relu".
        router_bias: add a RouterBias [E] (zeros), passed as moe()'s `bias`; needs score="sigmoid".
        shared_ffn_size: Fs; adds a dense shared expert every token passes through.
        dtype: the computation dtype x and the expert weights are cast to; None keeps x's dtype.
        param_dtype: the dtype of the expert and shared weights (the router is always float32).
        router_init, kernel_init: initialisers (key, shape, dtype) of the router and of the
            expert and shared kernels.
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *, rngs: nnx.Rngs,
                 activation: str = "swiglu", router_bias: bool = False, shared_ffn_size: int | None = None,
                 dtype=None, param_dtype=jnp.float32, router_init=fan_in_init, kernel_init=fan_in_init,
                 **moe_options):
        clash = _OWN_OPTIONS & set(moe_options)
        if clash:
            raise TypeError(f"MoE: {sorted(clash)} are the module's own settings, not moe() options to pass")
        if router_bias and moe_options.get("score", "softmax") != "sigmoid":
            raise ValueError("MoE: router_bias (a selection bias) needs score='sigmoid'")
        h, f, e = hidden_size, ffn_size, num_experts
        width = 2 if activation in GATED else 1
        self.top_k = top_k
        self.activation = activation
        self.dtype = dtype
        self.moe_options = moe_options
        param = _param_factory()
        self.router = param(router_init, ("embed", "expert"), rngs, (h, e), jnp.float32)
        self.w_in = param(kernel_init, ("expert", "embed", "mlp"), rngs, (e, h, width * f), param_dtype)
        self.w_out = param(kernel_init, ("expert", "mlp", "embed"), rngs, (e, f, h), param_dtype)
        self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), out_sharding=("expert",),
                                      eager_sharding=_eager_sharding()) if router_bias else None
        shared = shared_ffn_size is not None
        self.shared_in = param(kernel_init, ("embed", "mlp"), rngs, (h, width * shared_ffn_size),
                               param_dtype) if shared else None
        self.shared_out = param(kernel_init, ("mlp", "embed"), rngs, (shared_ffn_size, h),
                                param_dtype) if shared else None

    def __call__(self, x):
        """y [..., H] for x [..., H]; sows the call's MoeAux as nnx.Intermediate "moe_aux"."""
        dtype = x.dtype if self.dtype is None else self.dtype
        logits = x.astype(jnp.float32) @ self.router[...]
        shared = None
        if self.shared_in is not None:
            shared = (self.shared_in[...].astype(dtype), self.shared_out[...].astype(dtype))
        bias = None if self.router_bias is None else self.router_bias[...]
        y, aux = moe(x.astype(dtype), logits, self.w_in[...].astype(dtype), self.w_out[...].astype(dtype),
                     top_k=self.top_k, activation=self.activation, bias=bias, shared_experts=shared,
                     return_aux=True, **self.moe_options)
        self.sow(nnx.Intermediate, "moe_aux", aux)
        return y

    @classmethod
    def from_maxtext(cls, params, top_k: int, **kwargs) -> MoE:
        """A MoE holding MaxText RoutedMoE-style weights (see load_maxtext); kwargs are the
        constructor's (activation defaults to "swiglu", which uses both wi_0 and wi_1;
        param_dtype defaults to the weights' dtype, router_bias to whether gate has a bias)."""
        wi_0, wo = params["wi_0"], params["wo"]
        kwargs.setdefault("param_dtype", wi_0.dtype)
        kwargs.setdefault("router_bias", "bias" in params["gate"])
        experts, hidden, ffn = wi_0.shape
        module = nnx.eval_shape(lambda: cls(hidden, ffn, experts, top_k, rngs=nnx.Rngs(0), **kwargs))
        module.load_maxtext(params)
        return module

    def load_maxtext(self, params) -> None:
        """Set the weights from MaxText RoutedMoE-style parameters, in place:
            gate: {"kernel": [H, E], "bias": [E] (optional, the sigmoid selection bias)} -> router, router_bias
            wi_0 [E, H, F] (gate projection), wi_1 [E, H, F] (up; gated activations only) -> w_in = wi_0 | wi_1
            wo [E, F, H] -> w_out
        Each array must match the shape of the parameter it replaces; dtypes are kept."""
        gate = params["gate"]
        w_in = jnp.concatenate([params["wi_0"], params["wi_1"]], axis=-1) if self.activation in GATED \
            else params["wi_0"]
        pairs = [(self.router, gate["kernel"]), (self.w_in, w_in), (self.w_out, params["wo"])]
        if ("bias" in gate) != (self.router_bias is not None):
            raise ValueError("MoE.load_maxtext: gate has a bias exactly when the module has router_bias")
        if self.router_bias is not None:
            pairs.append((self.router_bias, gate["bias"]))
        for var, value in pairs:
            if tuple(value.shape) != tuple(var.shape):
                raise ValueError(f"MoE.load_maxtext: expected shape {tuple(var.shape)}, got {tuple(value.shape)}")
        for var, value in pairs:
            var.set_value(jnp.asarray(value, var.dtype))

    def to_maxtext(self) -> dict:
        """The weights as MaxText RoutedMoE-style parameters (load_maxtext's layout); the
        shared expert, which RoutedMoE does not hold, is left out."""
        gate = {"kernel": self.router[...]}
        if self.router_bias is not None:
            gate["bias"] = self.router_bias[...]
        w_in = self.w_in[...]
        if self.activation in GATED:
            wi_0, wi_1 = jnp.split(w_in, 2, axis=-1)
            return {"gate": gate, "wi_0": wi_0, "wi_1": wi_1, "wo": self.w_out[...]}
        return {"gate": gate, "wi_0": w_in, "wo": self.w_out[...]}
