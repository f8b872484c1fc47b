"""The step-time estimate's parts (`transformer.sizing.step_time`): collectives read from HLO
text (kinds, bytes, groups, loop trip counts), their ring-algorithm times, and the
extrapolation from 1- and 2-layer programs, against hand-computed figures."""

import jax
import jax.numpy as jnp
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


# A TPU program's shapes (as `compiled.as_text()` prints them): an outer loop of 3 trips (its
# condition `3 > i`) around an inner one of 4 (`i <= 3`, the compare in a fusion the condition
# calls); a loop of 5 trips the compiler states (`known_trip_count`); a fusion called from the
# entry and from the inner loop; an async pair naming one wrapped computation; an all-gather
# chain (channel 7, chain 2: start and done in the outer body, a continuation in the inner);
# an all-reduce in an AllReduceScatterFusion; the splash kernel's attribute of several
# lines ahead of a collective; and a windowed collective matmul's loop, `i < 4` with the body
# passing on a copy of i + 2 (and computing i + 1 beside it): 2 trips.
NESTED = """\
HloModule jit_train_step, is_scheduled=true

%outer_cond (p: (s32[])) -> pred[] {
  %n = s32[]{:T(128)} constant(3)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %gt = pred[]{:T(512)} compare(%n, %i), direction=GT
}

%le_fusion (x: s32[]) -> pred[] {
  %x = s32[] parameter(0)
  %three = s32[] constant(3)
  ROOT %le = pred[] compare(%x, %three), direction=LE
}

%inner_cond (p: (s32[])) -> pred[] {
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %f = pred[]{:T(512)} fusion(%i), kind=kLoop, calls=%le_fusion
}

%shared (x: f32[16]) -> f32[64] {
  %ag = f32[64]{0} all-gather(%x), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
}

%chain_start (x: bf16[8]) -> bf16[32] {
  %c1 = bf16[32] all-gather(%x), channel_id=7, replica_groups=[1,4]<=[4], CHAIN
}

%chain_more (x: bf16[8]) -> bf16[32] {
  %c2 = bf16[32] all-gather(%x), channel_id=7, replica_groups=[1,4]<=[4], CHAIN
}

%chain_done (x: bf16[8]) -> bf16[32] {
  %c3 = bf16[32] all-gather(%x), channel_id=7, replica_groups=[1,4]<=[4], CHAIN
}

%inner_body (p: (s32[])) -> (s32[]) {
  %k = bf16[4,8] custom-call(%q), custom_call_target="tpu", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128}"
}}, metadata={op_name="splash"}
  %cp = bf16[4,8]{1,0} collective-permute(%k), channel_id=9, source_target_pairs={{0,1},{1,0}}
  %s = f32[64]{0} fusion(%y), kind=kCustom, calls=%shared
  %more = bf16[32]{0} fusion(%z), kind=kCustom, calls=%chain_more
}

%outer_body (p: (s32[])) -> (s32[]) {
  %start = bf16[32]{0} fusion(%z), kind=kCustom, calls=%chain_start
  %w = (s32[]) while(%t), condition=%inner_cond, body=%inner_body
  %done = bf16[32]{0} fusion(%start), kind=kCustom, calls=%chain_done
}

%kcond (p: (s32[])) -> pred[] {
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %m = s32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %lt = pred[]{:T(512)} compare(%i, %m), direction=LT
}

%kbody (p: (s32[])) -> (s32[]) {
  %ar = f32[256]{0} all-reduce(%g), channel_id=11, replica_groups={{0,1,2,3}}, to_apply=%add
}

%wcond (p: (bf16[8], u32[])) -> pred[] {
  %four = u32[]{:T(128)} constant(4)
  %wi = u32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %wlt = pred[]{:T(512)} compare(%wi, %four), direction=LT
}

%wbody (p: (bf16[8], u32[])) -> (bf16[8], u32[]) {
  %two..sunk = u32[]{:T(128)} constant(2)
  %wj = u32[]{:T(128)} get-tuple-element(%p), index=1
  %wx = bf16[8]{0} get-tuple-element(%p), index=0
  %wcp = bf16[8]{0} collective-permute(%wx), channel_id=13, source_target_pairs={{0,1},{1,0}}
  %one = u32[]{:T(128)} constant(1)
  %woffset = u32[]{:T(128)} add(%wj, %one)
  %wcopy = u32[]{:T(128)} copy(%wj)
  %wnext = u32[]{:T(128)} add(%wcopy, %two..sunk)
  ROOT %wt = (bf16[8], u32[]) tuple(%wcp, %wnext)
}

%wrapped (x: f32[32]) -> f32[32] {
  %a2a = f32[32]{0} all-to-all(%x), channel_id=12, replica_groups={{0,1}}, dimensions={0}
}

%scatter (a: f32[128]) -> f32[32] {
  %sum = f32[128]{0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %slice = f32[32]{0} dynamic-slice(%sum, %o), dynamic_slice_sizes={32}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %s0 = f32[64]{0} fusion(%y), kind=kCustom, calls=%shared
  %w0 = (s32[]) while(%t), condition=%outer_cond, body=%outer_body
  %k = s32[] while(%t), condition=%kcond, body=%kbody, backend_config={"known_trip_count":{"n":"5"}}
  %ww = (bf16[8], u32[]) while(%wt0), condition=%wcond, body=%wbody
  %as = ((f32[32]), f32[32]) async-start(%v), calls=%wrapped
  %ad = f32[32]{0} async-done(%as), calls=%wrapped
  %rs = f32[32] fusion(%g), calls=%scatter, backend_config={"emitter":"AllReduceScatterFusion"}
}
""".replace("CHAIN", 'frontend_attributes={chain_id="2"}')


def test_collectives_counted_by_hand_through_nested_and_shared_computations():
    """Each collective of NESTED as many times as a step runs it, by hand: the inner body
    3 x 4 = 12 times; the shared fusion once from the entry and 12 times from the inner body;
    the chain once per outer trip (3), not per piece or per inner trip; the async pair's
    all-to-all once; the all-reduce-scatter as a reduce-scatter of a quarter of its bytes; the
    windowed loop's permute twice."""
    found = sorted((c.kind, c.result_bytes, c.group, c.count)
                   for c in step_time.collectives(NESTED))
    assert found == sorted([
        ("collective-permute", 2 * 4 * 8, 2, 12),
        ("all-gather", 4 * 64, 4, 13),  # the shared fusion: 1 + 12
        ("all-gather", 2 * 32, 4, 3),  # the chain
        ("all-reduce", 4 * 256, 4, 5),  # known_trip_count
        ("collective-permute", 2 * 8, 2, 2),  # the windowed loop: 0, 2 (not 4 trips)
        ("all-to-all", 4 * 32, 2, 1),
        ("reduce-scatter", 4 * 32, 4, 1),
    ])


def test_extrapolation_over_layers_and_microbatches():
    one = step_time.ProgramCost(optimal_seconds=3.0, flops=30.0)
    two = step_time.ProgramCost(optimal_seconds=5.0, flops=50.0)
    found = [step_time.Collective("all-gather", 8000, 4, count=24),
             step_time.Collective("collective-permute", 5000, 2, count=3)]
    e = step_time.extrapolate(one, two, found, "TPU v5 lite", layers=12, microbatches=4,
                              optimizer_seconds=0.5, analytic_flops=1000.0,
                              recomputed_flops=0.0, peak_flops=100.0)
    assert e.compute == pytest.approx(4 * (3 + 11 * 2) - 3 * 0.5)  # the update counted once
    assert e.compiler_flops == pytest.approx(4 * (30 + 11 * 20))
    assert e.unseen == pytest.approx((1000 - 4 * 250) / 100)  # none unseen
    # the communication is the step program's own collectives, as counted there
    assert e.communication == pytest.approx(24 * 6000 / 100e9 + 3 * 5000 / 50e9)
    assert e.communication_bytes == 24 * 6000 + 3 * 5000
    assert e.num_collectives == 27
    assert e.seconds == pytest.approx(e.compute + e.communication)
    assert e.overlapped_seconds == pytest.approx(max(e.compute, e.communication))
    assert step_time.extrapolate(one, two, [], "TPU v5 lite", layers=1, microbatches=1,
                                 optimizer_seconds=0.0, analytic_flops=130.0,
                                 recomputed_flops=0.0, peak_flops=10.0).unseen == 10.0
    assert step_time.optimizer_seconds(4_000, 1e9) == pytest.approx(7 * 4e-6)


def test_remats_recomputation_is_run_not_taken_off_the_unseen_flops():
    """A layer of 300 flops.py FLOPs (3 x a forward of 100) of which the compiler sees 200
    (a kernel's 100 unseen); remat full recomputes the forward (100), of which the compiler
    sees its 50, so it counts 250. The base (embeddings, loss) is 40, all seen. 4 layers, 2
    microbatches. Unseen: 100 + 50 a layer. Before, flops.py's less the compiler's: 50."""
    kwargs = dict(layers=4, microbatches=2, optimizer_seconds=0.0, peak_flops=10.0,
                  analytic_flops=2 * (40 + 4 * 300))
    plain = (step_time.ProgramCost(1.0, 40 + 200), step_time.ProgramCost(2.0, 40 + 2 * 200))
    remat = (step_time.ProgramCost(1.5, 40 + 250), step_time.ProgramCost(3.0, 40 + 2 * 250))
    none = step_time.extrapolate(*plain, [], "TPU v5 lite", recomputed_flops=0.0, **kwargs)
    assert none.unseen == pytest.approx(2 * 4 * 100 / 10) and none.recomputed == 0
    full = step_time.extrapolate(*remat, [], "TPU v5 lite", recomputed_flops=2 * 4 * 100.0,
                                 **kwargs)
    assert full.unseen == pytest.approx(2 * 4 * (100 + 50) / 10)
    assert full.compiler_flops == 2 * (40 + 4 * 250)
    assert "8e+04 ms of remat's recomputation" in step_time.describe(full, 1.0, 1.0)[0]


def test_program_cost_falls_back_on_the_compilers_roofline():
    given = step_time.program_cost({"optimal_seconds": 0.5, "flops": 10.0}, 100.0, 1000.0)
    assert given == step_time.ProgramCost(0.5, 10.0)
    none = step_time.program_cost({"optimal_seconds": -1.0, "flops": 300.0,
                                   "bytes accessed": 2000.0}, 100.0, 1000.0)
    assert none.optimal_seconds == 3.0  # FLOPs / peak > bytes / bandwidth


def _layers_program_cost(layers: int, remat: bool) -> step_time.ProgramCost:
    """The CPU compiler's cost of value_and_grad of a loss over `layers` layers x @ W1 @ W2
    ([M, D] x [D, F] x [F, D]), each under jax.checkpoint where `remat`."""
    def layer(x, w):
        return (x @ w[0]) @ w[1]

    block = jax.checkpoint(layer) if remat else layer

    def loss(weights, x):
        for w in weights:
            x = block(x, w)
        return jnp.sum(x * jnp.arange(x.shape[-1], dtype=x.dtype))  # no gradient of ones

    weights = [jax.ShapeDtypeStruct((2, D, D), jnp.float32)] * layers
    cost = jax.jit(jax.value_and_grad(loss)).lower(
        weights, jax.ShapeDtypeStruct((M, D), jnp.float32)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return step_time.program_cost(cost, 1e12, 1e12)


M = 64
D = 128
MATMUL = 2 * M * D * D  # the FLOPs of one [M, D] x [D, D] product


def test_extrapolation_and_recomputation_of_compiled_programs_counted_by_hand():
    """Programs with a known answer, compiled (CPU): a layer is two matmuls; value_and_grad
    runs 2 forward, 4 backward (dW1, dW2 and the two input gradients) less the first layer's
    input gradient, which nothing needs: 6L - 1 matmuls for L layers; remat recomputes x @ W1
    (W2's gradient reads it; the layer's output only the next layer does): 7L - 1.
    Extrapolated from 1 and 2 layers to 4 and 2 microbatches, the count is the 4-layer
    program's own (but a few scalar FLOPs: the cost model counts whole programs),
    and by hand 2 x (7 x 4 - 1) matmuls with remat, plus the elementwise FLOPs the cost model
    also counts (the loss's weights, the layers' additions: a few a [M, D] element, under 1%
    of a layer's 2 x M x D x D x 7). The recomputation the step estimate is given, 2 x 4
    matmuls, is what the cost model saw more with remat: the unseen FLOPs do not move."""
    kwargs = dict(layers=4, microbatches=2, optimizer_seconds=0.0, peak_flops=1e12)
    plain = step_time.extrapolate(_layers_program_cost(1, False), _layers_program_cost(2, False),
                                  [], "TPU v5 lite", analytic_flops=2 * 3 * 8 * MATMUL,
                                  recomputed_flops=0.0, **kwargs)
    one = _layers_program_cost(1, True)
    two = _layers_program_cost(2, True)
    full = step_time.extrapolate(one, two, [], "TPU v5 lite",
                                 analytic_flops=2 * 3 * 8 * MATMUL,
                                 recomputed_flops=2 * 4 * MATMUL, **kwargs)
    # the same up to a few scalar FLOPs (the first layer's differ), under one [M, D] pass
    assert full.compiler_flops == pytest.approx(2 * _layers_program_cost(4, True).flops,
                                                abs=M * D)
    assert plain.compiler_flops == pytest.approx(2 * _layers_program_cost(4, False).flops,
                                                 abs=M * D)
    assert 2 * (7 * 4 - 1) * MATMUL <= full.compiler_flops <= 2 * (7 * 4 - 1) * MATMUL * 1.01
    assert 2 * (6 * 4 - 1) * MATMUL <= plain.compiler_flops <= 2 * (6 * 4 - 1) * MATMUL * 1.01
    assert full.compiler_flops - plain.compiler_flops == pytest.approx(2 * 4 * MATMUL,
                                                                       abs=M * D)
    # flops.py's 3 x forward counts the first layer's input gradient, which no program runs
    assert full.unseen * 1e12 == pytest.approx(plain.unseen * 1e12, abs=M * D)
    assert 0 < plain.unseen
    assert plain.unseen * 1e12 <= 2 * MATMUL
    assert full.compute > plain.compute  # the roofline of more FLOPs and bytes


def test_opposite_permutes_beside_each_other_take_the_longer_time():
    """ICI links are full duplex: two permutes marked as one opposite pair (`duplex`) take
    the longer one's time, not the sum; the rest add up as before."""
    found = [step_time.Collective("collective-permute", 5000, 2, 3, duplex=1),
             step_time.Collective("collective-permute", 4000, 2, 3, duplex=1),
             step_time.Collective("all-gather", 8000, 4, 2)]
    # v5e: 200e9 B/s over 4 links, 50e9 each; the all-gather on two
    assert step_time.communication_seconds(found, "TPU v5 lite") == pytest.approx(
        3 * 5000 / 50e9 + 2 * 6000 / 100e9)


# The body of a TPU windowed collective matmul (its HLO as compiled for lm_125m at context 8,
# shapes shrunk): two rings, one each way (a and b), each start fed by the other start's done
# its own way; then a permute back (r) that reads both rings' results, and a permute the way
# of a (s) that reads r's: opposite to r, but after it.
DUPLEX = """\
HloModule jit_train_step, is_scheduled=true

ENTRY %main (p: (bf16[8], bf16[8])) -> bf16[8] {
  %x = bf16[8]{0} get-tuple-element(%p), index=0
  %y = bf16[8]{0} get-tuple-element(%p), index=1
  %a0 = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=36, \
source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  %b0 = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%y), channel_id=37, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %a0d = bf16[8]{0} collective-permute-done(%a0)
  %b0d = bf16[8]{0} collective-permute-done(%b0)
  %a1 = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%a0d), channel_id=38, \
source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  %b1 = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%b0d), channel_id=39, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %a1d = bf16[8]{0} collective-permute-done(%a1)
  %b1d = bf16[8]{0} collective-permute-done(%b1)
  %sum = bf16[8]{0} add(%a1d, %b1d)
  %r = bf16[16]{0} collective-permute(%sum), channel_id=40, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %s = bf16[8]{0} collective-permute(%r), channel_id=41, \
source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
}
"""


def test_opposite_permutes_paired_only_where_independent_in_the_hlo():
    """DUPLEX's rings pair as (a0, b0) and (a1, b1): opposite pairs, neither reading the
    other. r goes the other way from a1 and s, but reads a1's result and s reads r's, so
    each stays alone: 16 bytes a ring step, 32 for r and 16 for s, at 50e9 B/s a link."""
    found = step_time.collectives(DUPLEX)
    assert len(found) == 6
    pairs = sorted(c.duplex for c in found)
    assert pairs == [0, 0, 1, 1, 2, 2]
    alone = sorted(c.result_bytes for c in found if not c.duplex)
    assert alone == [16, 32]
    assert step_time.communication_seconds(found, "TPU v5 lite") == pytest.approx(
        (2 * 16 + 32 + 16) / 50e9)


INT8_HLO = """\
HloModule jit_train_step

%windowed_body (p: (s32[], s8[4,16,2,8,1])) -> (s32[], s8[4,16,2,8,1]) {
  %x = s8[4,16,2,8,1]{1,3,4,2,0:T(32,128)(4,1)} parameter(0)
  %w = s8[2,8,8,4,1]{1,3,0,2:T(32,128)(4,1)} parameter(1)
  %conv = bf16[4,16,8,4,1]{1,3,4,2,0} convolution(%x, %w), \
window={size=1x8x2 pad=0_0x7_7x0_0 rhs_reversal=0x1x0}, dim_labels=0b2f1_2i1o0->0b1f2
}

%cond (p: (s32[], s8[4,16,2,8,1])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: s8[32,64]) -> f32[32,16] {
  %a = s8[32,64]{1,0} parameter(0)
  %b = s8[64,16]{1,0} parameter(1)
  %c = bf16[64,16]{1,0} parameter(2)
  %d = bf16[32,64]{1,0} parameter(3)
  %dot.1 = s32[32,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.2 = f32[32,16]{1,0} dot(%d, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %loop = (s32[], s8[4,16,2,8,1]) while(%t), condition=%cond, body=%windowed_body, \
backend_config={"known_trip_count":{"n":"2"}}
}
"""


def test_int8_matmul_flops_counted_as_the_cost_model_counts_them_and_as_run():
    """The s8 x s8 matmuls of a program (not the bf16 dot): a dot, 2 x 32 x 16 x 64, once,
    and the TPU compiler's windowed matmul, a convolution in a loop of 2 trips whose body the
    cost model counts once. The convolution (lm_1b's key projection's form, smaller) takes
    the heads as a window of 8 taps over an input of 1 padded by 7 each side: 1 tap of each
    lands on the input; and contracts a window of 2 over 2 (1 output) and 8 features: 2 x
    (4 x 16 rows x 8 x 4 outputs) x 2 x 8."""
    dot = 2 * 32 * 16 * 64
    conv = 2 * (4 * 16 * 8 * 4) * 2 * 8
    assert step_time.int8_dots(INT8_HLO) == 1 + 2
    assert step_time.int8_dot_flops(INT8_HLO) == (dot + conv, dot + 2 * conv)


def test_int8_saving_only_where_the_estimate_charged_them_at_the_bfloat16_peak():
    """Peaks 10 (bfloat16) and 20 (int8): an int8 FLOP charged at 10 costs 0.05 s more.
    A program of 100 FLOPs, 80 of them int8 run, 40 of those counted by the cost model (a
    windowed loop's body once), and the step runs 150 (flops.py's): 50 unseen, 40 of them
    int8. Bytes-bound (20 s of bytes against 10 s of FLOPs), the roofline charged its
    counted int8 FLOPs nothing, so only the unseen 40 are saved: 2 s. FLOP-bound (5 s of
    bytes), the counted 40 are saved too, off the FLOPs side (10 - 2 s); so with the cost
    model's own 12 s. Charging all 80 at the int8 peak off the compute, as before, took 4 s
    off a bytes-bound program whose compute is its bytes."""
    def estimate(cost):
        one = step_time.program_cost(cost, 10.0, 1000.0, 80.0, 40.0, 20.0)
        return step_time.extrapolate(one, one, [], "TPU v5 lite", layers=1, microbatches=1,
                                     optimizer_seconds=0.0, analytic_flops=150.0,
                                     recomputed_flops=0.0, peak_flops=10.0, int8_peak=20.0)

    bytes_bound = estimate({"optimal_seconds": -1.0, "flops": 100.0, "bytes accessed": 2e4})
    assert bytes_bound.compute == 20.0
    assert bytes_bound.unseen == pytest.approx(50 / 10 - 40 * 0.05)
    assert bytes_bound.int8_saved == pytest.approx(40 * 0.05)
    assert bytes_bound.int8_counted == 40.0
    flop_bound = estimate({"optimal_seconds": -1.0, "flops": 100.0, "bytes accessed": 5e3})
    assert flop_bound.compute == pytest.approx(100 / 10 - 40 * 0.05)
    assert flop_bound.int8_saved == pytest.approx(80 * 0.05)
    given = estimate({"optimal_seconds": 12.0, "flops": 100.0})
    assert given.compute == pytest.approx(12 - 40 * 0.05)
    assert given.unseen == bytes_bound.unseen
