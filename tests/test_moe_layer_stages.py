"""benchmarks/moe_layer_stages.py on CPU: the attribution of trace kernels to stages on
synthetic HLO and trace events, the compulsory-byte and FLOP formulas against
tensor-by-tensor counts, the op names of a real compiled step, and a smoke run of main()
on shrunk cases (timings and TFLOP/s filled, stage columns empty: no GPU kernels)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_xla

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import moe_layer_stages as stages  # noqa: E402
from _timing import fwd_bwd, moe_inputs, trace_events  # noqa: E402

# A module in compiled.as_text()'s format: a gmm custom call (gmm_in forward), a fusion
# whose body mixes the activation's forward (recomputed) and backward, a fusion mixing the
# dispatch forward's row map into the combine backward, and an unscoped cast.
HLO = """HloModule jit_loss, entry_computation_layout={(bf16[8,4]{1,0})->bf16[8,4]{1,0}}

%fused_act (param_0: bf16[8,4], param_1: bf16[8,2]) -> bf16[8,4] {
  %param_0 = bf16[8,4]{1,0} parameter(0)
  %param_1 = bf16[8,2]{1,0} parameter(1)
  %neg = bf16[8,4]{1,0} negate(%param_0), metadata={op_name="jit(loss)/jvp(moe_xla/act)/jit(silu)/neg"}
  ROOT %mul = bf16[8,4]{1,0} multiply(%neg, %param_0), metadata={op_name="jit(loss)/transpose(jvp(moe_xla/act))/mul"}
}

%fused_stack (param_0.1: s32[8], param_1.1: bf16[8,4]) -> f32[8,1] {
  %param_0.1 = s32[8]{0} parameter(0)
  %param_1.1 = bf16[8,4]{1,0} parameter(1)
  %bitcast = s32[8,1]{1,0} bitcast(%param_0.1), metadata={op_name="jit(loss)/jvp(moe_xla/dispatch)/moe_xla_permute"}
  ROOT %convert.1 = f32[8,1]{1,0} convert(%bitcast), metadata={op_name="jit(loss)/transpose(jvp(moe_xla/combine))/stack"}
}

ENTRY %main.1 (p0: bf16[8,4], p1: bf16[2,4,4], p2: bf16[8,2], p3: f32[8,4], p4: s32[8]) -> bf16[8,4] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[2,4,4]{2,1,0} parameter(1)
  %p2 = bf16[8,2]{1,0} parameter(2)
  %p3 = f32[8,4]{1,0} parameter(3)
  %p4 = s32[8]{0} parameter(4)
  %custom-call.3 = bf16[8,4]{1,0} custom-call(%p0, %p1), custom_call_target="moe_xla_gmm_cuda_v1", metadata={op_name="jit(loss)/jvp(moe_xla/gmm_in)/moe_xla_gmm"}
  %loop_fusion = bf16[8,4]{1,0} fusion(%custom-call.3, %p2), kind=kLoop, calls=%fused_act, metadata={op_name="jit(loss)/transpose(jvp(moe_xla/act))/mul"}
  %stack_fusion = f32[8,1]{1,0} fusion(%p4, %loop_fusion), kind=kLoop, calls=%fused_stack, metadata={op_name="jit(loss)/transpose(jvp(moe_xla/combine))/stack"}
  ROOT %convert = bf16[8,4]{1,0} convert(%p3), metadata={op_name="jit(loss)/transpose(jvp())/convert_element_type"}
}
"""


def _kernel(hlo_op, dur_us, kernel="kernel", **args):
    return {"ph": "X", "name": kernel, "dur": dur_us, "args": ({"hlo_op": hlo_op} if hlo_op else {}) | args}


@pytest.mark.parametrize("op_name, scope", [
    ("jit(loss)/jvp(moe_xla/dispatch)/moe_xla_permute", ("dispatch", "fwd")),
    ("jit(loss)/transpose(jvp(moe_xla/gmm_in))/moe_xla_tgmm", ("gmm_in", "bwd")),
    ("jit(loss)/transpose(jvp(moe_xla/route))/jvp(moe_xla/route)/mul", ("route", "bwd")),
    ("jit(moe)/moe_xla/combine/moe_xla_unpermute", ("combine", "fwd")),
    ("transpose(jvp(moe_xla/act))/mul", ("act", "bwd")),  # a thunk annotation's name, module prefix removed
    ("jit(loss)/transpose(jvp())/convert_element_type", None),
    ("jit(loss)/moe_xla/aux/reduce_sum", None),
    ("", None),
])
def test_op_scope(op_name, scope):
    assert stages.op_scope(op_name) == scope


def test_instruction_scopes_read_fusion_bodies():
    scopes = stages.instruction_scopes(HLO)
    assert scopes["custom-call.3"] == {("gmm_in", "fwd")}
    assert scopes["loop_fusion"] == {("act", "fwd"), ("act", "bwd")}
    assert scopes["stack_fusion"] == {("dispatch", "fwd"), ("combine", "bwd")}
    assert scopes["convert"] == frozenset()


@pytest.mark.parametrize("found, stage", [
    ({("act", "fwd"), ("act", "bwd")}, ("act", "bwd")),
    ({("dispatch", "fwd"), ("combine", "bwd")}, ("combine", "bwd")),
    ({("route", "bwd"), ("dispatch", "bwd")}, ("route", "bwd")),
    ({("act", "fwd"), ("gmm_out", "fwd")}, ("gmm_out", "fwd")),
    ({("gmm_in", "bwd")}, ("gmm_in", "bwd")),
])
def test_kernel_stage_is_the_latest_in_program_order(found, stage):
    assert stages.kernel_stage(frozenset(found)) == stage


def test_stage_ms_attributes_kernels():
    scopes = stages.instruction_scopes(HLO)
    kernels = [
        _kernel("custom-call.3", 300.0, "device_kernel"),  # gmm_in fwd
        _kernel("custom-call.3", 20.0, "gmm_prep"),  # the same custom call's second kernel
        _kernel("loop_fusion", 100.0),  # act fwd + bwd -> act bwd, listed as mixed
        _kernel("stack_fusion", 8.0),  # dispatch fwd + combine bwd -> combine bwd, mixed
        _kernel("convert", 10.0),  # no stage -> other
        # an hlo_op of another module: the annotation's own op names decide
        _kernel("fusion.99", 40.0, name="transpose(jvp(moe_xla/combine))/gather"),
        _kernel(None, 6.0, "memset"),  # no annotation -> other
    ]
    ms, mixed, other, every = stages.stage_ms(kernels, scopes, steps=2)
    assert dict(ms) == pytest.approx({("gmm_in", "fwd"): 0.16, ("act", "bwd"): 0.05, ("combine", "bwd"): 0.024})
    assert sorted(mixed.values()) == pytest.approx([0.004, 0.05])
    assert any("loop_fusion" in k and "act fwd + act bwd" in k for k in mixed)
    assert sorted(other.values()) == pytest.approx([0.003, 0.005])
    assert all("no stage" in k for k in other)
    assert sum(every.values()) == pytest.approx(0.242)
    assert every[next(k for k in every if "gmm_prep" in k)] == pytest.approx(0.01)


def test_compulsory_bytes_and_flops():
    t, k, d, n, e, b = 4, 2, 8, 3, 5, 2
    tk = t * k
    logits, topk_f32, topk_i32 = 4 * t * e, 4 * tk, 4 * tk  # f32 [T, E]; f32 / int32 [T, K] or [TK]
    x, rows, h, a = b * t * d, b * tk * d, b * tk * 2 * n, b * tk * n
    expected = {
        ("route", "fwd"): logits + topk_f32 + topk_i32,
        ("route", "bwd"): logits + topk_f32 + topk_i32 + logits,
        ("dispatch", "fwd"): x + topk_i32 + rows + topk_i32 + 4 * e,
        ("dispatch", "bwd"): rows + topk_i32 + x,
        ("act", "fwd"): h + a,
        ("act", "bwd"): h + a + h + a,  # h, d a in; d h, omega * a out
        ("combine", "fwd"): rows + topk_i32 + topk_f32 + x,
        ("combine", "bwd"): x + topk_i32 + topk_f32 + rows + a + a + topk_f32,  # ct, map, w; c; g, a; d w
    }
    for (stage, direction), nbytes in expected.items():
        assert stages.compulsory_bytes(stage, direction, t, k, d, n, e, b) == nbytes, (stage, direction)
    assert stages.gemm_flops("gmm_in", "fwd", t, k, d, n) == 2 * tk * d * 2 * n
    assert stages.gemm_flops("gmm_out", "fwd", t, k, d, n) == 2 * tk * n * d
    for direction, per_rows in (("fwd", 6), ("bwd", 12)):  # the layer's 6 / 12 T K d n
        assert sum(stages.gemm_flops(g, direction, t, k, d, n) for g in stages.GEMMS) == per_rows * tk * d * n


def test_stage_columns():
    dims = dict(t=4, k=2, d=8, n=3, e=5, b=2)
    kernels = [_kernel("custom-call.3", 2000.0), _kernel("loop_fusion", 500.0), _kernel("convert", 100.0)]
    row = stages.stage_columns(kernels, stages.instruction_scopes(HLO), 1, 10.0, dims)
    assert row["gmm_in_fwd_ms"] == pytest.approx(2.0) and row["gmm_in_fwd_share"] == pytest.approx(0.2)
    assert row["gmm_in_fwd_tflops"] == pytest.approx(stages.gemm_flops("gmm_in", "fwd", 4, 2, 8, 3) / 2e-3 / 1e12)
    assert row["act_bwd_gbps"] == pytest.approx(stages.compulsory_bytes("act", "bwd", **dims) / 0.5e-3 / 1e9)
    assert row["route_fwd_ms"] == 0.0 and row["route_fwd_gbps"] is None
    assert row["kernels_ms"] == pytest.approx(2.6) and row["other_ms"] == pytest.approx(0.1)
    assert row["mixed_ms"] == pytest.approx(0.5)
    empty = stages.stage_columns([], {}, 1, 10.0, dims)
    assert all(empty[key] is None for key in stages.COLUMNS if key.startswith(stages.STAGES))
    assert empty["kernels_ms"] is None and empty["other_ms"] is None


def test_scopes_of_a_compiled_step():
    """The op names JAX and XLA give a real step (y is one of its outputs) carry every stage,
    the forward's every forward stage, and every op a trace names is in the module (the CPU
    trace's thunks carry hlo_op as GPU kernels do)."""
    layer = stages.moe_xla_layer({"top_k": 2, "score": "softmax"})
    inputs, ct = moe_inputs(jax.random.key(0), 32, 16, 8, 4)
    step = jax.jit(fwd_bwd(layer, len(inputs))).lower(*inputs, ct).compile()
    scopes = stages.instruction_scopes(step.as_text())
    every = set(stages.PROGRAM_ORDER)
    assert frozenset().union(*scopes.values()) == every
    fwd_scopes = stages.instruction_scopes(jax.jit(layer).lower(*inputs).compile().as_text())
    assert frozenset().union(*fwd_scopes.values()) == {p for p in every if p[1] == "fwd"}
    thunks = [e for e in trace_events(step, inputs + (ct,), 1) if "hlo_op" in e.get("args", {})]
    assert thunks and all(e["args"]["hlo_op"] in scopes for e in thunks)


def test_fwd_bwd_is_y_and_its_vjp():
    """_timing.fwd_bwd(layer, n): y and the gradients of <y, ct> w.r.t. the first n inputs
    (here against jax.grad of the f32 inner product), the others held fixed, ct cast to
    y's dtype; no loss value."""
    def layer(a, b, c):
        return (jnp.tanh(a @ b) * c).astype(jnp.bfloat16)

    keys = jax.random.split(jax.random.key(3), 4)
    a, b, c = (jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, [(4, 3), (3, 5), (4, 5)]))
    ct = jax.random.normal(keys[3], (4, 5), jnp.float32)
    y, grads = jax.jit(fwd_bwd(layer, 2))(a, b, c, ct)
    assert y.dtype == jnp.bfloat16 and len(grads) == 2
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(layer(a, b, c), np.float32))
    ct_used = ct.astype(jnp.bfloat16).astype(jnp.float32)
    inner = lambda a, b: jnp.vdot(jnp.tanh(a @ b) * c, ct_used)  # noqa: E731
    for got, want in zip(grads, jax.grad(inner, argnums=(0, 1))(a, b)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_main_on_shrunk_cases(tmp_path, monkeypatch, capsys):
    shrunk = {name: [dict(c, H=32, F=16, E=8, top_k=min(c["top_k"], 4)) for c in stages.CASES[name]]
              for name in stages.CASE_LISTS}
    monkeypatch.setattr(stages, "CASES", shrunk)
    picked = ["qwen3-30b-a3b", "sonicmoe-30b-n256-e256-k16"]
    stages.main(["--out", str(tmp_path), "--t-scale", str(1 / 512), "--cases", *picked])
    results = json.loads((tmp_path / "moe_layer_stages_cpu.json").read_text())["results"]
    assert [r["case"] for r in results] == picked
    for r in results:
        assert set(stages.COLUMNS) <= set(r)
        assert r["fwd_tflops"] > 0 and r["fwd_bwd_tflops"] > 0
        assert all(r[key] is None for key in stages.COLUMNS if key.startswith(stages.STAGES))
    assert results[1]["fwd_vs_sonicmoe"] == pytest.approx(results[1]["fwd_tflops"] / 430)
    assert results[0]["fwd_vs_sonicmoe"] is None
    assert (tmp_path / "moe_layer_stages_cpu.md").exists()
    assert "no GPU kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        stages.main(["--out", str(tmp_path), "--cases", "no-such-case"])


def test_prequantized_weights_are_inputs_of_the_step(tmp_path, monkeypatch):
    shrunk = {name: [dict(c, H=32, F=16, E=8, top_k=min(c["top_k"], 4)) for c in stages.CASES[name]]
              for name in stages.CASE_LISTS}
    monkeypatch.setattr(stages, "CASES", shrunk)
    stages.main(["--out", str(tmp_path), "--t-scale", str(1 / 512), "--cases", "qwen3-30b-a3b",
                 "--quantization", "none", stages.PREQUANTIZED])
    results = json.loads((tmp_path / "moe_layer_stages_cpu.json").read_text())["results"]
    assert [r["quantization"] for r in results] == ["none", stages.PREQUANTIZED]
    assert results[0]["weights_quant_ms"] is None and results[1]["weights_quant_ms"] > 0
    assert results[1]["fwd_bwd_ms"] > 0
    # The timed step quantises no weights: their Fp8Weights come in as inputs.
    case = shrunk["moe_layer"][0]
    inputs, ct = moe_inputs(jax.random.key(0), 16, case["H"], case["F"], case["E"])
    q = (moe_xla.quantize_fp8_weights(inputs[2]), moe_xla.quantize_fp8_weights(inputs[3]))
    step = jax.jit(fwd_bwd(stages.prequantized_layer(case), 4)).lower(*inputs, *q, ct).as_text()
    assert "moe_xla_gmm_fp8" in step
    assert "moe_xla_quantize_fp8_weights" not in step and "moe_xla_quantize_fp8_blocks" not in step


@pytest.mark.parametrize("flag,column", [("--first-product", "first_product"),
                                         ("--combine-backward", "cotangent_rows")])
def test_modes_in_one_run(tmp_path, monkeypatch, flag, column):
    shrunk = {name: [dict(c, H=32, F=16, E=8, top_k=min(c["top_k"], 4)) for c in stages.CASES[name]]
              for name in stages.CASE_LISTS}
    monkeypatch.setattr(stages, "CASES", shrunk)
    stages.main(["--out", str(tmp_path), "--t-scale", str(1 / 512), "--cases", "sonicmoe-30b-n256-e256-k16",
                 flag, "gather", "copy"])
    results = json.loads((tmp_path / "moe_layer_stages_cpu.json").read_text())["results"]
    assert [r[column] for r in results] == ["gather", "copy"]
    assert all(r["fwd_bwd_ms"] > 0 for r in results)


def test_no_trace_leaves_the_stage_columns_empty(tmp_path, monkeypatch):
    shrunk = {name: [dict(c, H=32, F=16, E=8, top_k=min(c["top_k"], 4)) for c in stages.CASES[name]]
              for name in stages.CASE_LISTS}
    monkeypatch.setattr(stages, "CASES", shrunk)
    monkeypatch.setattr(stages, "trace_events", lambda *a: pytest.fail("traced with --trace-steps 0"))
    stages.main(["--out", str(tmp_path), "--t-scale", str(1 / 512), "--cases", "sonicmoe-30b-n256-e256-k16",
                 "--trace-steps", "0"])
    (row,) = json.loads((tmp_path / "moe_layer_stages_cpu.json").read_text())["results"]
    assert row["fwd_bwd_ms"] > 0 and row["kernels_ms"] is None and row["gmm_in_bwd_ms"] is None


def test_ep1_layer_is_the_ep_layer_in_every_scope(tmp_path, monkeypatch):
    """--layer moe ep1 gives a row of each; ep1's step is the EP layer (its dispatch
    expansion, which moe() has not), its ops under the same stage scopes as moe()'s, and its
    output moe()'s."""
    shrunk = {name: [dict(c, H=32, F=16, E=8, top_k=min(c["top_k"], 4)) for c in stages.CASES[name]]
              for name in stages.CASE_LISTS}
    monkeypatch.setattr(stages, "CASES", shrunk)
    stages.main(["--out", str(tmp_path), "--t-scale", str(1 / 512), "--cases", "qwen3-30b-a3b",
                 "--layer", "moe", "ep1"])
    results = json.loads((tmp_path / "moe_layer_stages_cpu.json").read_text())["results"]
    assert [r["layer"] for r in results] == ["moe", "ep1"]
    assert all(r["fwd_bwd_ms"] > 0 for r in results)
    case = shrunk["moe_layer"][0]
    inputs, ct = moe_inputs(jax.random.key(0), 32, case["H"], case["F"], case["E"])
    ep, plain = stages.case_layer(case, "ep1"), stages.case_layer(case, "moe")
    assert "moe_xla_ep_expand" in str(jax.make_jaxpr(fwd_bwd(ep, len(inputs)))(*inputs, ct))
    assert "moe_xla_ep_expand" not in str(jax.make_jaxpr(fwd_bwd(plain, len(inputs)))(*inputs, ct))
    step = jax.jit(fwd_bwd(ep, len(inputs))).lower(*inputs, ct).compile().as_text()
    assert frozenset().union(*stages.instruction_scopes(step).values()) == set(stages.PROGRAM_ORDER)
    np.testing.assert_allclose(np.asarray(ep(*inputs), np.float32), np.asarray(plain(*inputs), np.float32),
                               rtol=2e-2, atol=2e-2)
