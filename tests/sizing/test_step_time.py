"""The step-time estimate's parts (`transformer.sizing.step_time`): collectives read from HLO
text (kinds, bytes, groups, loop trip counts), their ring-algorithm times, and the
extrapolation from 1- and 2-layer programs, against hand-computed figures."""

import pytest

from transformer.sizing import step_time

HLO = """\
HloModule jit_train_step

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(6), metadata={x}
  %p = (s32[], f32[8]) parameter(0)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%ag_fusion (x: bf16[16,4]) -> bf16[64,4] {
  %all-gather.1 = bf16[64,4] all-gather(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %cp = (bf16[8,128], bf16[8,128], u32[]) collective-permute-start(%a), source_target_pairs={{0,1}}
  %done = bf16[8,128]{1,0} collective-permute-done(%cp)
  %ag = (bf16[16,4], bf16[64,4]) custom-call(%y), custom_call_target="Async", calls=%ag_fusion
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ar = (f32[1024]{0}, f32[256]{0}) all-reduce(%g, %h), replica_groups={{0,1,2,3,4,5,6,7}}
  %rs = f32[128]{0} reduce-scatter(%g), replica_groups=[2,4]<=[8], dimensions={0}
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
}
"""


def test_collectives_read_from_hlo_with_loop_trip_counts():
    found = {(c.kind, c.result_bytes, c.group, c.count) for c in step_time.collectives(HLO)}
    assert found == {
        ("all-reduce", 4 * (1024 + 256), 8, 1),  # a tuple: both arrays
        ("reduce-scatter", 4 * 128, 4, 1),  # iota groups [2, 4]
        ("collective-permute", 2 * 8 * 128, 2, 6),  # the async start's result, 6 trips
        ("all-gather", 2 * 64 * 4, 4, 6),  # mesh groups over axis_1 (4), in the loop's fusion
    }


def test_ring_algorithm_bytes_and_times():
    gather = step_time.Collective("all-gather", 8000, 4)
    assert gather.bytes_per_device() == 6000  # (n - 1) / n of the gathered bytes
    assert step_time.Collective("reduce-scatter", 2000, 4).bytes_per_device() == 6000
    assert step_time.Collective("all-reduce", 8000, 4).bytes_per_device() == 12000
    assert step_time.Collective("all-reduce", 8000, 1).bytes_per_device() == 0
    # v5e: 1600 Gbit/s over 4 links = 50 GB/s a link; a ring along one axis uses two
    assert gather.seconds("TPU v5 lite") == pytest.approx(6000 / 100e9)
    permute = step_time.Collective("collective-permute", 5000, 2, count=3)
    assert permute.seconds("TPU v5 lite") == pytest.approx(3 * 5000 / 50e9)


def test_extrapolation_over_layers_and_microbatches():
    one = step_time.ProgramCost(optimal_seconds=3.0, flops=30.0, communication_seconds=1.0,
                                communication_bytes=100.0, num_collectives=5)
    two = step_time.ProgramCost(optimal_seconds=5.0, flops=50.0, communication_seconds=1.5,
                                communication_bytes=150.0, num_collectives=8)
    e = step_time.extrapolate(one, two, layers=12, microbatches=4, optimizer_seconds=0.5,
                              analytic_flops=1000.0, peak_flops=100.0)
    assert e.compute == pytest.approx(4 * (3 + 11 * 2) - 3 * 0.5)  # the update counted once
    assert e.compiler_flops == pytest.approx(4 * (30 + 11 * 20))
    assert e.unseen == pytest.approx((1000 - 4 * 250) / 100)  # none unseen
    assert e.communication == pytest.approx(4 * (1 + 11 * 0.5))
    assert e.num_collectives == 4 * (5 + 11 * 3)
    assert e.seconds == pytest.approx(e.compute + e.communication)
    assert e.overlapped_seconds == pytest.approx(max(e.compute, e.communication))
    assert step_time.extrapolate(one, two, layers=1, microbatches=1, optimizer_seconds=0.0,
                                 analytic_flops=130.0, peak_flops=10.0).unseen == 10.0
    assert step_time.optimizer_seconds(4_000, 1e9) == pytest.approx(7 * 4e-6)


def test_program_cost_falls_back_on_the_compilers_roofline():
    found = [step_time.Collective("all-gather", 8000, 4, count=2)]
    given = step_time.program_cost({"optimal_seconds": 0.5, "flops": 10.0}, found,
                                   "TPU v5 lite", 100.0, 1000.0)
    assert given.optimal_seconds == 0.5 and given.communication_bytes == 12000
    assert given.num_collectives == 2
    none = step_time.program_cost({"optimal_seconds": -1.0, "flops": 300.0,
                                   "bytes accessed": 2000.0}, [], "TPU v5 lite", 100.0, 1000.0)
    assert none.optimal_seconds == 3.0  # FLOPs / peak > bytes / bandwidth
