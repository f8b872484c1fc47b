"""Pipeline stages in the sizing tools: the bubble the memory plan and the step-time estimate
report, the stage transfers read from the compiled program (over DCN across slices), the
pipeline's buffers in the memory plan, and the sweep's stage points. CPU seconds (2-core
host): the report and estimate tests under 1 s, the 8-fake-CPU compile about 3 s, the
two-slice TPU compile about 6 s (libtpu)."""

import re

import jax
import numpy as np
import pytest

from transformer.config import resolve
from transformer.parallel import pipeline, sharding
from transformer.sizing import hlo, memory, report, step_time, tpu

SCHEDULES = [(2, 2, 1), (2, 4, 1), (4, 4, 1), (4, 8, 2), (3, 5, 3), (8, 8, 4)]


def _plan(schedule, **extra) -> memory.MemoryPlan:
    """A memory plan with made-up figures and the given (S, M, R)."""
    analytic = {k: 1 for k in ("params", "optimizer_state", "gradients", "update",
                               "activations", "batch")}
    compiled = {k: 1 for k in ("arguments", "outputs", "aliased", "temporaries",
                               "generated_code")}
    return memory.MemoryPlan({"stage": schedule[0], "data": 1, "fsdp": 1, "context": 1,
                              "tensor": 1}, "cpu", {"targets": (1, 8, 16)}, 10,
                             analytic | extra, compiled, 0.0, 0.0, 1, {}, "xla",
                             pipeline=schedule)


def _formula(stages, microbatches, repeats):
    return (stages - 1) / (microbatches * repeats + stages - 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_reported_bubble_is_the_schedules_idle_share(schedule):
    """The fraction `--compile_only` prints and the estimate's equal (S - 1) / (M R + S - 1)
    and the idle share of the schedule's own table."""
    from transformer.model.config import TransformerConfig

    table = pipeline.schedule(*schedule)
    idle = (table[..., 0] == pipeline.IDLE).mean()
    text = report.format_report(TransformerConfig(vocab_size=16, architecture="decoder"),
                                _plan(schedule))
    printed = float(re.search(r"bubble \(S - 1\) / \(M R \+ S - 1\) = ([\d.]+)", text).group(1))
    assert printed == pytest.approx(_formula(*schedule), abs=1e-6)
    assert printed == pytest.approx(idle, abs=1e-6)
    estimate = step_time.StepEstimate(1.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 4, 1, pipeline=schedule)
    assert estimate.bubble_fraction == pytest.approx(_formula(*schedule))
    line = next(s for s in step_time.describe(estimate, 1.0, 1.0) if s.startswith("pipeline"))
    assert float(re.search(r"bubble ([\d.]+)", line).group(1)) == pytest.approx(
        _formula(*schedule), abs=1e-6)


def test_without_stages_nothing_is_added():
    assert not any(line.startswith("pipeline") for line in step_time.describe(
        step_time.StepEstimate(1.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 4, 1), 1.0, 1.0))
    assert _plan((1, 1, 1)).bubble == 0.0


@pytest.mark.parametrize("schedule", [(1, 1, 1), (2, 4, 1), (4, 4, 2)])
def test_estimate_stretches_the_layers_time_by_the_bubble(schedule):
    """By hand: 1- and 2-layer programs of 3 and 5 ms (a layer 2 ms, base 1 ms), 8 layers, 2
    accumulation microbatches, an optimizer update of 0.25 ms (0.1 ms of it in the base), 1e9
    unseen FLOPs at 1e12/s. Busy layers: 2 x 8 x 2 + 1 = 33 ms; idle (S - 1) / (M R) of that;
    the base less its update (0.9 ms) run on S - 1 more stages, twice."""
    stages, microbatches, repeats = schedule
    one = step_time.ProgramCost(3e-3, 0.0)
    two = step_time.ProgramCost(5e-3, 0.0)
    e = step_time.extrapolate(one, two, [], "TPU v5", layers=8, microbatches=2,
                              optimizer_seconds=0.25e-3, analytic_flops=1e9,
                              recomputed_flops=0.0, peak_flops=1e12, pipeline=schedule,
                              base_optimizer_seconds=0.1e-3)
    plain = 2 * (3e-3 + 7 * 2e-3) - 0.25e-3
    assert e.unseen == pytest.approx(1e-3)
    assert e.redundant == pytest.approx(2 * (stages - 1) * 0.9e-3)
    assert e.compute == pytest.approx(plain + e.redundant)
    assert e.bubble == pytest.approx(33e-3 * (stages - 1) / (microbatches * repeats))
    # the idle share of the layers' ticks is the bubble fraction
    assert e.bubble / (33e-3 + e.bubble) == pytest.approx(_formula(*schedule))
    assert e.seconds == pytest.approx(e.compute + e.unseen + e.bubble)


_ATTRS = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
          '"xla_megascale_runtime",_xla_host_transfer_rendezvous=')
SEND_HLO = "\n".join([
    "ENTRY %main (a: f32[8]) -> f32[8] {",
    "  %send.31 = (f32[1,1,16,32]{3,2,1,0:T(8,128)}, u32[]{:S(2)}, token[]) send(%x, %t), "
    + _ATTRS + '"collective-permute.12_0",_xla_megascale_target={{200000->100000},'
    '{200001->100001}},_xla_megascale_transfer_type="ONE_TO_ONE"}',
    "  %recv.31 = (f32[1,1,16,32]{3,2,1,0:T(8,128)}, u32[]{:S(2)}, token[]) recv(%t), "
    + _ATTRS + '"collective-permute.12_0",_xla_megascale_target={{200000->100000},'
    '{200001->100001}}}',
    "  %send.11 = (f32[1,1,128]{2,1,0:T(1,128)}, u32[]{:S(2)}, token[]) send(%y, %t), "
    + _ATTRS + '"all-reduce.111_0",_xla_megascale_reduce_operation="SUM",'
    '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}',
    "}", ""])


def test_sends_across_slices_are_dcn_collectives_at_the_dcn_bandwidth():
    """The TPU compiler sends a collective's part across slices through the DCN runtime: a
    `send` per collective (its `recv` not counted again), timed at the chip's DCN share."""
    found = sorted(hlo.collectives(SEND_HLO), key=lambda c: c.kind)
    assert [(c.kind, c.result_bytes, c.group, c.dcn) for c in found] == [
        ("all-reduce", 4 * 128, 2, True), ("collective-permute", 4 * 16 * 32, 2, True)]
    permute = found[1]
    assert permute.seconds("TPU v5") == pytest.approx(4 * 16 * 32 / (50e9 / 8))
    assert found[0].seconds("TPU v5") == pytest.approx(2 * 4 * 128 / 2 / (50e9 / 8))
    # no DCN figure for v4: timed at ICI as before
    assert permute.seconds("TPU v4") == pytest.approx(
        4 * 16 * 32 / (hlo.ICI_BYTES_PER_S["TPU v4"] / hlo.LINKS["TPU v4"]))


def _tiny(load_config, **mesh):
    return load_config("lm_default.py", **{
        "data.vocab_size": 64, "data.max_length": 16, "data.batch_size": 16,
        "model.d_model": 32, "model.d_ff": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.num_decoder_layers": 4, "model.max_len": 16, "model.scan_layers": True,
        "model.dtype": "float32", "mesh.data": 1, "mesh.fsdp": -1,
        "mesh.pipeline_microbatches": 4, **{f"mesh.{k}": v for k, v in mesh.items()}})


def test_pipelined_compile_on_8_cpus_shows_the_stage_transfers_and_buffers(load_config):
    """fsdp 4 x stage 2, 4 rows a device in 4 microbatches of 16 x 32 float32 positions:
    the roll along "stage" moves one microbatch's activations (2,048 bytes) once a tick
    (M R + S - 1 = 5 ticks), forward and backward; the buffers are 2 x (M slots + a stage's
    state)."""
    run = resolve(_tiny(load_config, stage=2), 8)
    plan = memory.plan(run, sharding.make_mesh(run.config.mesh, jax.devices()[:8]))
    assert plan.pipeline == (2, 4, 1)
    transfers = [c for c in plan.collectives if c.stage_transfer]
    assert len(transfers) >= 2
    assert {(c.result_bytes, c.count, c.dcn) for c in transfers} == {(1 * 16 * 32 * 4, 5, False)}
    row = 16 * 32 * 4
    assert plan.analytic["pipeline_buffers"] == 2 * (4 * row + 1 * row)
    text = report.format_report(run.model, plan)
    assert "pipeline buffers (in temporaries)" in text
    assert "analytic_pipeline_buffers=" in text.splitlines()[-1]


def test_layer_variants_fold_the_stages_into_fsdp(load_config):
    """The 1- and 2-layer programs the estimate extrapolates run every layer on 1 / S of the
    rows: the stage axis folded into FSDP, within and across slices."""
    run = resolve(_tiny(load_config, stage=1, dcn_stage=2, dcn_data=1), 8, num_slices=2)
    variant = tpu.layer_variant(run, 1, 8, 2)
    assert variant.mesh_shape == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    assert not variant.model.scan_layers and variant.model.num_decoder_layers == 1


@pytest.fixture
def libtpu():
    if not tpu.libtpu_installed():
        pytest.skip(f"libtpu is not installed ({tpu.LIBTPU_MISSING})")


def test_stages_across_two_slices_send_over_dcn(libtpu, load_config):
    """v5e:2x2 x 2 slices, the stage axis across them: the TPU program's stage transfers go
    through the DCN runtime, one microbatch's activations once a tick, priced at DCN."""
    tpu.prepare_environment()
    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        topology = tpu.parse_topology("v5e:2x2", 2)
        devices = tpu.abstract_devices(topology)
        run = resolve(_tiny(load_config, stage=1, dcn_stage=2, dcn_data=1), 8, num_slices=2)
        plan = tpu._plan(run, sharding.make_mesh(run.config.mesh, devices), topology)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)
    transfers = [c for c in plan.collectives if c.stage_transfer]
    assert transfers and all(c.dcn for c in transfers)
    assert {(c.result_bytes, c.count) for c in transfers} == {(16 * 32 * 4, 5)}
    seconds = step_time.communication_seconds(transfers, "TPU v5 lite")
    assert seconds == pytest.approx(sum(c.count for c in transfers) * 16 * 32 * 4
                                    / hlo.DCN_BYTES_PER_S["TPU v5 lite"])
    assert np.isclose(plan.bubble, 1 / 5)


def test_sweep_adds_stage_splits_and_repeats_across_slices_first(load_config):
    """Over 2 slices of 4 devices, stages 2 go across the slices (data within them), stages 4
    2 across x 2 within; each with repeats 1 and 2, at the microbatch counts of a split of
    its size."""
    cfg = _tiny(load_config)
    cfg.data.max_rows_per_device = 1
    cfg.grad_accum_steps = 0  # sized from max_rows_per_device
    points = tpu.sweep_points(cfg, 8, num_slices=2, contexts=(1,), remats=("full",),
                              stages=(2, 4))
    fsdp = [p for p in points if "mesh.stage" not in p]
    assert [(p["mesh.fsdp"], p["grad_accum_steps"]) for p in fsdp] == [(4, 2)]
    staged = {(p["mesh.stage"], p["mesh.dcn_stage"], p["mesh.dcn_data"],
               p["mesh.pipeline_repeats"], p["mesh.fsdp"], p["grad_accum_steps"])
              for p in points if "mesh.stage" in p}
    assert staged == {(1, 2, 1, r, 4, a) for r in (1, 2) for a in (4, 2)} | {
        (2, 2, 1, r, 2, a) for r in (1, 2) for a in (8, 4, 2)}


@pytest.mark.parametrize("overrides, reason", [
    ({"mesh.stage": 4, "mesh.pipeline_repeats": 2},
     "num_decoder_layers=4 is not divisible by mesh.stage=4 x mesh.pipeline_repeats=2"),
    ({"mesh.stage": 4, "mesh.pipeline_microbatches": 2},
     "mesh.pipeline_microbatches=2 is fewer than mesh.stage=4"),
])
def test_sweep_refuses_a_stage_point_the_model_cannot_take_with_its_reason(
        load_config, overrides, reason):
    """Refused in resolve, before anything compiles (fake CPU devices stand in: a refused
    point never reaches the TPU compiler)."""
    cfg = _tiny(load_config)
    point = {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 1, "mesh.tensor": 1,
             "mesh.dcn_stage": 1, "mesh.pipeline_repeats": 1, "model.remat_policy": "full",
             "grad_accum_steps": 1, **overrides}
    line = tpu._sweep_point(cfg, tpu.parse_topology("v5e-8"), jax.devices()[:8], point, [])
    assert isinstance(line, str) and line.startswith("  stage 4 (1 across slices) x data 1")
    assert reason in line


def test_sweep_flags_are_one_line_errors():
    assert tpu.sweep_values("sweep_stages", "2, 4", ()) == (2, 4)
    assert tpu.sweep_values("sweep_remat", None, tpu.SWEEP_REMAT, str) == tpu.SWEEP_REMAT
    with pytest.raises(ValueError, match=r"--sweep_stages='two': use a comma-separated list"):
        tpu.sweep_values("sweep_stages", "two", (2,))
    with pytest.raises(ValueError, match=r"--sweep_remat names 'fast'"):
        tpu.sweep_values("sweep_remat", "full,fast", tpu.SWEEP_REMAT, str)


STACKS = {  # architecture: (its pipelined stack, the lengths activation_bytes reads, fields)
    "decoder": ("num_decoder_layers", dict(source_length=0, target_length=16), {}),
    "vision": ("num_encoder_layers", dict(source_length=17, target_length=0),
               dict(positional="learned", image_size=16, patch_size=4, num_classes=10)),
}


@pytest.mark.parametrize("architecture", sorted(STACKS))
@pytest.mark.parametrize("schedule", [(2, 4, 1), (4, 4, 2)])
def test_a_stage_keeps_its_layers_activations_and_the_bubbles(schedule, architecture):
    """A device keeps L / S layers' activations for all its rows, plus (S - 1) / (M R) of
    them for the chunks it runs idle; what lies outside the layers (embeddings, logits) once.
    By hand from the unpipelined figures of 8 and 16 layers (a layer's bytes: their
    difference / 8). The ViT's stack is its encoder's."""
    import dataclasses

    from transformer.model.config import TransformerConfig
    from transformer.sizing.activations import activation_bytes

    stages, microbatches, repeats = schedule
    stack, lengths, fields = STACKS[architecture]
    layers = {"num_encoder_layers": 0, "num_decoder_layers": 0, stack: 16}
    model = TransformerConfig(vocab_size=64, architecture=architecture, d_model=32, d_ff=64,
                              num_heads=4, num_kv_heads=2, **layers, **fields)
    kw = dict(rows=4, **lengths)
    whole = activation_bytes(model, **kw)
    half = activation_bytes(dataclasses.replace(model, **{stack: 8}), **kw)
    layer = (whole - half) / 8
    outside = whole - 16 * layer
    per_stage = 16 // stages
    want = outside + per_stage * layer * (1 + (stages - 1) / (microbatches * repeats))
    assert memory._activations(model, schedule, **kw) == pytest.approx(want, abs=1)
    assert memory._activations(model, (1, 1, 1), **kw) == whole


def test_a_ranked_stage_point_names_its_bubble_and_transfers(load_config, monkeypatch):
    """The compiler stood in for (no compile, under 1 s): a stage point's ranked line gives
    the estimate's bubble and the time of its stage transfers."""
    import types

    from transformer.sizing import step_flops

    transfer = hlo.Collective("collective-permute", 2 * 10**6, 2, 5, ("stage",), True)
    estimate = step_time.StepEstimate(
        1.0, 0.0, 0.0, 0.5, 0.0, 5, 0.0, 4, 1, pipeline=(2, 4, 1), bubble=0.25,
        stage_transfers=(transfer,), along_stage=0.3)
    monkeypatch.setattr(tpu, "_plan", lambda *_: types.SimpleNamespace(peak_bytes=0))
    monkeypatch.setattr(tpu, "step_estimate", lambda *_: estimate)
    monkeypatch.setattr(step_flops, "step_flops_per_device", lambda *_: 1.0)
    point = {"mesh.data": 1, "mesh.fsdp": 4, "mesh.context": 1, "mesh.tensor": 1,
             "mesh.stage": 2, "mesh.dcn_stage": 1, "mesh.pipeline_repeats": 1,
             "model.remat_policy": "full", "grad_accum_steps": 1}
    seconds, line = tpu._sweep_point(_tiny(load_config), tpu.parse_topology("v5e-8"),
                                     jax.devices()[:8], point, [])
    assert seconds == pytest.approx(1.75)
    dcn = 5 * 2e6 / hlo.DCN_BYTES_PER_S["TPU v5 lite"] * 1e3
    assert line.endswith(f"bubble 0.200 = 250.0 ms, stage transfers {dcn:.1f} ms, along stage "
                         f"300.0 ms")
