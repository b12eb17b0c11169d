"""moe_xla.nnx.MoE against moe() with the same parameters: forward (bitwise), gradients,
quantization="fp8_blockwise" passed through, nnx.jit / nnx.scan / nnx.remat, the sown aux
losses, an 8-CPU-device expert-sharded mesh, and MaxText-style weights in and out."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax", minversion="0.12.6")  # nnx.capture

from flax import nnx  # noqa: E402

import moe_xla  # noqa: E402
from moe_xla.nnx import MoE, RouterBias  # noqa: E402
from conftest import assert_close, normal, rel_err, requires_8_devices  # noqa: E402

# Plain calls (outside nnx.capture) sow into the module, which flax >= 0.12.6 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")

B, S, H, F, E, K, FS = 2, 8, 16, 8, 8, 2, 12
CONFIGS = {
    "swiglu": dict(),
    "gelu-shared": dict(activation="gelu", shared_ffn_size=FS),
    "sigmoid-bias-grouped": dict(score="sigmoid", router_bias=True, n_groups=4, topk_groups=2, scale=2.5,
                                 shared_ffn_size=FS),
}


def _module(rng, config, **extra):
    """A MoE of CONFIGS[config]; a router bias, when present, is set to random values."""
    model = MoE(H, F, E, K, rngs=nnx.Rngs(int(rng.integers(1 << 30))), **CONFIGS[config], **extra)
    if model.router_bias is not None:
        model.router_bias[...] = normal(rng, (E,), jnp.float32) * 0.1
    return model


def _reference(model, x, params=None, **options):
    """moe() called by hand on the module's parameters, or on `params` (its nnx.Param state)."""
    w = {k: v.get_value() for k, v in (nnx.state(model, nnx.Param) if params is None else params).items()}
    shared = (w["shared_in"], w["shared_out"]) if "shared_in" in w else None
    bias = None if model.router_bias is None else model.router_bias[...]
    return moe_xla.moe(x, x @ w["router"], w["w_in"], w["w_out"], top_k=K, activation=model.activation,
                       bias=bias, shared_experts=shared, **dict(model.moe_options, **options))


def _captured(fn, *args):
    """fn(*args) under nnx.capture: (its result, the tuple of MoeAux its MoE calls sowed)."""
    out, sown = nnx.capture(fn, nnx.Intermediate)(*args)
    return out, sown["moe_aux"].get_value()


def test_import_moe_xla_does_not_import_flax():
    code = "import sys, moe_xla; assert 'flax' not in sys.modules; assert moe_xla.nnx.MoE and 'flax' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_parameters_shapes_and_logical_sharding(rng):
    model = _module(rng, "sigmoid-bias-grouped")
    params = nnx.state(model, nnx.Param)
    assert {k: v.shape for k, v in params.items()} == {
        "router": (H, E), "w_in": (E, H, 2 * F), "w_out": (E, F, H), "shared_in": (H, 2 * FS), "shared_out": (FS, H)}
    assert model.router.dtype == jnp.float32
    specs = nnx.get_partition_spec(nnx.state(model))
    assert {k: tuple(v.get_value()) for k, v in specs.items()} == {
        "router": ("embed", "expert"), "w_in": ("expert", "embed", "mlp"), "w_out": ("expert", "mlp", "embed"),
        "shared_in": ("embed", "mlp"), "shared_out": ("mlp", "embed"), "router_bias": ("expert",)}
    assert isinstance(model.router_bias, RouterBias) and "router_bias" not in params
    assert MoE(H, F, E, K, rngs=nnx.Rngs(0), activation="relu").w_in.shape == (E, H, F)


def test_own_options_and_bias_checks():
    with pytest.raises(TypeError, match="top_k"):
        MoE(H, F, E, K, rngs=nnx.Rngs(0), top_k=3)
    with pytest.raises(ValueError, match="sigmoid"):
        MoE(H, F, E, K, rngs=nnx.Rngs(0), router_bias=True)


@pytest.mark.parametrize("config", CONFIGS)
def test_forward_and_aux_equal_moe_bitwise(rng, config):
    model = _module(rng, config)
    x = normal(rng, (B, S, H), jnp.float32)
    y, (aux,) = _captured(model, x)
    y_ref, aux_ref = _reference(model, x, return_aux=True)
    np.testing.assert_array_equal(y, y_ref)
    for got, want in zip(aux, aux_ref):
        np.testing.assert_array_equal(got, want)
    assert aux.tokens_per_expert.sum() == B * S * K


def test_bfloat16_computation_dtype(rng):
    model = MoE(H, F, E, K, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    x = normal(rng, (B, S, H), jnp.float32)
    y = model(x)
    assert y.dtype == jnp.bfloat16
    y_ref = moe_xla.moe(x.astype(jnp.bfloat16), x @ model.router[...], model.w_in[...].astype(jnp.bfloat16),
                        model.w_out[...].astype(jnp.bfloat16), top_k=K)
    np.testing.assert_array_equal(y, y_ref)


@pytest.mark.parametrize("config", CONFIGS)
def test_grad_and_jit_match_moe(rng, config):
    model = _module(rng, config)
    x = normal(rng, (B, S, H), jnp.float32)
    cot = normal(rng, (B, S, H), jnp.float32)

    def loss(m):
        return jnp.sum(m(x) * cot)

    grads = nnx.jit(nnx.grad(loss))(model)
    params = nnx.state(model, nnx.Param)

    ref = jax.grad(lambda p: jnp.sum(_reference(model, x, p) * cot))(params)
    assert set(grads.keys()) == set(ref.keys()) == set(params.keys())
    for name in params:
        assert_close(grads[name].get_value(), ref[name].get_value(), jnp.float32)
    assert_close(nnx.jit(lambda m: m(x))(model), _reference(model, x), jnp.float32)


@pytest.mark.parametrize("config", ["swiglu", "gelu-shared"])
def test_fp8_blockwise_quantization_passes_through_to_moe(rng, config):
    """quantization="fp8_blockwise" reaches moe(): the forward equals moe(..., quantization=
    "fp8_blockwise") on the same parameters bitwise (and differs from the unquantised layer),
    and the gradients reach w_in, w_out and the router (and the shared expert), equal to
    moe()'s."""
    model = _module(rng, config, quantization="fp8_blockwise")
    assert model.moe_options["quantization"] == "fp8_blockwise"
    x = normal(rng, (B, S, H), jnp.float32)
    cot = normal(rng, (B, S, H), jnp.float32)
    y, (aux,) = _captured(model, x)
    y_ref, aux_ref = _reference(model, x, return_aux=True)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    assert rel_err(y, _reference(model, x, quantization=None)) > 1e-4  # quantised

    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) * cot)))(model)
    params = nnx.state(model, nnx.Param)
    ref = jax.jit(jax.grad(lambda p: jnp.sum(_reference(model, x, p) * cot)))(params)
    assert set(grads.keys()) == set(ref.keys()) == set(params.keys())
    for name in params:
        got = grads[name].get_value()
        assert np.all(np.isfinite(got)) and np.any(got != 0), name
        assert_close(got, ref[name].get_value(), jnp.float32)

    bf16 = MoE(H, F, E, K, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, quantization="fp8_blockwise")
    y16 = bf16(x)
    assert y16.dtype == jnp.bfloat16
    y16_ref = moe_xla.moe(x.astype(jnp.bfloat16), x @ bf16.router[...], bf16.w_in[...].astype(jnp.bfloat16),
                          bf16.w_out[...].astype(jnp.bfloat16), top_k=K, quantization="fp8_blockwise")
    np.testing.assert_array_equal(np.asarray(y16, np.float32), np.asarray(y16_ref, np.float32))


def _stack(rng, layers, **options):
    """`layers` MoE layers stacked on a leading axis (nnx.vmap over split rngs)."""

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return MoE(H, F, E, K, rngs=rngs, **options)

    return create(nnx.Rngs(int(rng.integers(1 << 30))))


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-remat"])
def test_scan_over_stacked_layers_matches_unrolled(rng, remat):
    layers = 3
    stack = _stack(rng, layers, shared_ffn_size=FS)
    x = normal(rng, (B, S, H), jnp.float32)

    def block(layer, h):
        y, sown = nnx.capture(layer, nnx.Intermediate)(h)
        return h + y, sown["moe_aux"].get_value()[0]

    body = nnx.remat(block) if remat else block

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def forward(h, layer):
        return body(layer, h)

    def loss(model):
        h, aux = forward(x, model)
        return jnp.sum(h ** 2), aux

    (value, aux), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(stack)
    params = nnx.state(stack, nnx.Param)

    def unrolled(p):
        h, auxes = x, []
        for i in range(layers):
            w = {k: v.get_value()[i] for k, v in p.items()}
            y, a = moe_xla.moe(h, h @ w["router"], w["w_in"], w["w_out"], top_k=K,
                               shared_experts=(w["shared_in"], w["shared_out"]), return_aux=True)
            h = h + y
            auxes.append(a)
        return jnp.sum(h ** 2), jax.tree.map(lambda *v: jnp.stack(v), *auxes)

    (value_ref, aux_ref), grads_ref = jax.value_and_grad(unrolled, has_aux=True)(params)
    assert_close(value, value_ref, jnp.float32)
    for name in params:
        assert_close(grads[name].get_value(), grads_ref[name].get_value(), jnp.float32)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    assert aux.tokens_per_expert.shape == (layers, E)
    assert_close(aux.load_balance_loss, aux_ref.load_balance_loss, jnp.float32)
    assert_close(aux.z_loss, aux_ref.z_loss, jnp.float32)


@requires_8_devices
def test_expert_sharded_mesh_matches_one_device(rng):
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    one = _module(rng, "sigmoid-bias-grouped")
    sharded = _module(rng, "sigmoid-bias-grouped", mesh=mesh, expert_axis="ep")
    with nnx.logical_axis_rules((("expert", "ep"), ("embed", None), ("mlp", None))):
        specs = nnx.get_partition_spec(nnx.state(one))
    state = jax.tree.map(lambda a, p: jax.device_put(a, NamedSharding(mesh, p)), nnx.state(one), specs)
    nnx.update(sharded, state)
    assert sharded.w_in[...].sharding.spec == P("ep", None, None)
    x = normal(rng, (B * 4, S, H), jnp.float32)  # 64 tokens, 8 per device

    def loss(model):
        y, sown = nnx.capture(model, nnx.Intermediate)(x)
        return jnp.sum(y ** 2), (y, sown["moe_aux"].get_value()[0])

    step = nnx.grad(loss, has_aux=True)
    grads, (y, aux) = nnx.jit(step)(sharded)
    grads_one, (y_one, aux_one) = step(one)
    assert_close(y, y_one, jnp.float32)
    for name in grads_one:
        assert_close(grads[name].get_value(), grads_one[name].get_value(), jnp.float32)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_one.tokens_per_expert)
    assert_close(aux.load_balance_loss, aux_one.load_balance_loss, jnp.float32)
    assert aux.dispatched_rows is not None and aux_one.dispatched_rows is None


@requires_8_devices
def test_built_under_a_mesh_the_parameters_are_sharded():
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh), nnx.logical_axis_rules((("expert", "ep"), ("embed", None), ("mlp", None))):
        model = MoE(H, F, E, K, rngs=nnx.Rngs(0), score="sigmoid", router_bias=True)
    assert model.w_in[...].sharding.spec == P("ep", None, None)
    assert model.router[...].sharding.spec == P(None, "ep")
    assert model.router_bias[...].sharding.spec == P("ep")


@pytest.mark.parametrize("config", CONFIGS)
def test_maxtext_round_trip(rng, config):
    model = _module(rng, config)
    weights = model.to_maxtext()
    gated = model.activation in ("swiglu", "geglu")
    assert weights["wi_0"].shape == (E, H, F) and weights["wo"].shape == (E, F, H)
    assert weights["gate"]["kernel"].shape == (H, E)
    assert ("wi_1" in weights) == gated and ("bias" in weights["gate"]) == (model.router_bias is not None)
    options = {k: v for k, v in CONFIGS[config].items() if k not in ("shared_ffn_size", "router_bias")}
    loaded = MoE.from_maxtext(weights, K, **options)
    jax.tree.map(np.testing.assert_array_equal, loaded.to_maxtext(), weights)
    for name in ("router", "w_in", "w_out"):
        np.testing.assert_array_equal(getattr(loaded, name)[...], getattr(model, name)[...])
    if gated:
        np.testing.assert_array_equal(loaded.w_in[...][..., :F], weights["wi_0"])
        np.testing.assert_array_equal(loaded.w_in[...][..., F:], weights["wi_1"])
    if model.shared_in is None:
        x = normal(rng, (B, S, H), jnp.float32)
        np.testing.assert_array_equal(loaded(x), model(x))


def test_maxtext_shape_mismatch_raises(rng):
    weights = _module(rng, "swiglu").to_maxtext()
    target = MoE(H, 2 * F, E, K, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expected shape"):
        target.load_maxtext(weights)
    with pytest.raises(ValueError, match="bias"):
        MoE(H, F, E, K, rngs=nnx.Rngs(0), score="sigmoid", router_bias=True).load_maxtext(weights)
