"""moe_xla.inspect: custom calls, collectives and schedule read from the compiled HLO."""

from __future__ import annotations

from moe_xla import inspect as moe_inspect
from conftest import requires_8_devices

pytestmark = requires_8_devices


def test_ep_layer_report():
    r = moe_inspect.inspect_moe(tokens=64, hidden=16, ffn=16, experts=8, top_k=2, chunks=2)
    assert r.count("all-to-all") >= 4  # dispatch and return of each of the two chunks
    assert r.count("all-gather") == 0
    gemms = [c for c in r.custom_calls if c.target.startswith("moe_xla_gmm")]
    assert len(gemms) == 4 and {c.stage for c in gemms} == {"gmm_in", "gmm_out"}
    assert all(c.bytes > 0 and c.replica_groups for c in r.collectives)
    entry = r.schedule[0]
    assert entry.label == "entry"
    # every collective of the entry is placed against the GEMMs: dispatch before, return after
    for c in r.collectives:
        if c.computation == entry.name:
            assert c.before or c.after
    assert any(c.stage == "combine" and c.before for c in r.collectives)


def test_cli_prints_schedule(capsys, tmp_path):
    dump = tmp_path / "moe.hlo"
    moe_inspect.main(["--mesh", "2x4", "--axes", "data,ep", "--tokens", "32", "--hidden", "16", "--ffn", "16",
                      "--experts", "8", "--no-dedup", "--dump", str(dump)])
    out = capsys.readouterr().out
    for section in ("== moe_xla custom calls", "== collectives", "== schedule", "== overlap"):
        assert section in out
    assert "moe_xla_gmm_cpu_v1" in out and "all-to-all" in out and "all-gather" not in out
    assert "custom_call_target=\"moe_xla_gmm" in dump.read_text()


_ASYNC_HLO = """\
HloModule m, is_scheduled=true

%body (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %g = f32[4]{0} custom-call(%p), custom_call_target="moe_xla_gmm_cuda_v1", metadata={op_name="jit(f)/moe_xla/gmm_out/x"}
  ROOT %r = f32[4]{0} copy(%g)
}

ENTRY %main (a: f32[8,4], w: f32[2,4,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %w = f32[2,4,4]{2,1,0} parameter(1)
  %all-to-all-start = ((f32[8,4]{1,0}), f32[8,4]{1,0}) all-to-all-start(%a), channel_id=1, replica_groups={{0,1}}, metadata={op_name="jit(f)/moe_xla/dispatch/all_to_all"}
  %gmm.1 = f32[8,4]{1,0} custom-call(%a, %w), custom_call_target="moe_xla_gmm_cuda_v1", metadata={op_name="jit(f)/moe_xla/gmm_in/moe_xla_gmm"}
  %call.2 = f32[4]{0} call(%a), to_apply=%body
  %all-to-all-done = f32[8,4]{1,0} all-to-all-done(%all-to-all-start)
  %all-reduce = f32[8,4]{1,0} all-reduce(%all-to-all-done), replica_groups={{0,1}}, to_apply=%body
  ROOT %gmm.3 = f32[8,4]{1,0} custom-call(%all-reduce, %w), custom_call_target="moe_xla_gmm_cuda_v1"
}
"""


def test_async_pairs_and_overlap():
    r = moe_inspect.inspect_hlo(_ASYNC_HLO)
    a2a, ar = r.collectives
    assert (a2a.kind, a2a.is_async, a2a.done, a2a.bytes, a2a.stage) == ("all-to-all", True, "all-to-all-done", 128,
                                                                         "dispatch")
    assert a2a.overlapped == ["gmm.1", "g"]  # also the GEMM inside the called computation
    assert (ar.is_async, ar.before, ar.after) == (False, "g", "gmm.3")
    assert [s.label for s in r.schedule] == ["entry", "called of %call.2 in %main"]
    assert "overlaps %gmm.1, %g" in str(r)


# The same all-to-all in XLA's long form: a generic async-start of a computation that wraps it.
_LONG_ASYNC_HLO = """\
HloModule m, is_scheduled=true

%wrapped_all_to_all (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %all-to-all.1 = f32[8,4]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[8,4], w: f32[2,4,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %w = f32[2,4,4]{2,1,0} parameter(1)
  %async-start = ((f32[8,4]{1,0}), f32[8,4]{1,0}, s32[]) async-start(%a), calls=%wrapped_all_to_all, metadata={op_name="jit(f)/moe_xla/dispatch/all_to_all"}
  %gmm.1 = f32[8,4]{1,0} custom-call(%a, %w), custom_call_target="moe_xla_gmm_cuda_v1"
  %async-update = ((f32[8,4]{1,0}), f32[8,4]{1,0}, s32[]) async-update(%async-start)
  %async-done = f32[8,4]{1,0} async-done(%async-update)
  ROOT %gmm.2 = f32[8,4]{1,0} custom-call(%async-done, %w), custom_call_target="moe_xla_gmm_cuda_v1"
}
"""


def test_long_form_async_pair_counts_once():
    r = moe_inspect.inspect_hlo(_LONG_ASYNC_HLO)
    assert r.count("all-to-all") == 1, r.collectives  # not again as a sync op inside %wrapped_all_to_all
    (a2a,) = r.collectives
    assert (a2a.name, a2a.is_async, a2a.done, a2a.bytes, a2a.replica_groups, a2a.stage) == (
        "async-start", True, "async-done", 128, "{{0,1}}", "dispatch")
    assert a2a.overlapped == ["gmm.1"]
    assert [s.label for s in r.schedule] == ["entry"]  # the wrapped computation is part of its async-start
