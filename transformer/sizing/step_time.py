"""A TPU step-time estimate built from the compiler's own figures for the whole step.

XLA's cost model (`cost_analysis()["optimal_seconds"]`) counts the body of a loop once: with
scanned layers and gradient accumulation it prices one layer of one microbatch. So the model is
compiled again twice, unrolled (`scan_layers=False`), with one microbatch of the same rows and
with 1 and with 2 layers (each stack). The difference is one layer's cost, the rest the step's
base (embeddings, loss, optimizer), and

    compute = A x (base + L x layer) - (A - 1) x optimizer update

for L layers and A microbatches, the optimizer's update (elementwise over the device's params
and Adam moments: read and written once a step, at the chip's HBM bandwidth) counted once.

Communication is read from the HLO of the step's own program (`hlo.py`), not from the 1- and
2-layer ones, whose collectives XLA combines differently (their difference can be below zero).

Pipeline stages (`mesh.stage`): the 1- and 2-layer programs fold the stage axis into FSDP, and
the estimate adds the bubble (the stages' idle ticks) and the embeddings and loss that every
stage runs (`extrapolate`); the stage transfers are the step's collective-permutes along
"stage", over DCN where that axis spans slices.

Where the cost model gives no figure (a negative one, as for programs with the splash kernel),
a program's compute is its roofline from the compiler's counts: max(FLOPs / peak, bytes
accessed / HBM bandwidth).

The FLOPs the cost model does not see (a custom kernel's, a loop's trips after the first) are
what the step runs, `flops.py`'s FLOPs and remat's recomputation of them (`step_flops.remat_flops`:
under `full` the layers' forward but each sublayer's last matmul, under `dots`/`dots_no_batch`
the attention's scores and values, which no policy saves inside the splash kernel), less what
the compiler counts in the programs as they train. Not the compiler's FLOPs without remat: the
TPU compiler runs some matmuls as windowed loops beside their FSDP gathers, whose body the cost
model counts once, and chooses them per program (lm_1b at 2,048 tokens: 3.0e12 FLOPs a layer
and microbatch seen with remat `dots_no_batch`, 5.0e12 without it, 6.4e12 in flops.py), so
programs compiled without remat leave different FLOPs out.

The estimate is `compute + FLOPs the cost model does not see + communication` (no overlap), and
beside it the same with the communication hidden behind compute. Left out: overlap (XLA's
latency-hiding scheduler hides part of the communication: the truth lies between the two
figures), a custom kernel's time (the splash kernel's FLOPs are added at the chip's peak, as
`flops.py` counts them; its memory traffic is not), the loops left inside a layer (the loss's
chunks, ring attention's steps, the chunked kernel's blocks: their compute counted once, their
missing FLOPs added at peak), the non-matmul FLOPs the compiler counts in the layers (norms,
activations, casts: they come off the unseen term, which flops.py's matmuls less the compiler's
all-op count underestimates by them), loops whose trip count the HLO does not state (their
collectives counted once), and everything off the device (input pipeline, host, launch overhead).
"""

from __future__ import annotations

import dataclasses

from transformer.parallel.pipeline import bubble_fraction
from transformer.sizing.hlo import (  # noqa: F401  (re-exported: step_time's API)
    DCN_BYTES_PER_S,
    ICI_BYTES_PER_S,
    LINKS,
    Collective,
    collectives,
    communication_seconds,
    int8_dot_flops,
    int8_dots,
    int8_flops,
)


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per-device compute figures of one compiled program."""

    optimal_seconds: float
    flops: float
    int8_flops: float = 0.0  # the int8 matmuls' FLOPs the program runs (`int8_flops`)
    int8_counted: float = 0.0  # of `flops`, the int8 matmuls' (`int8_dot_flops`)
    int8_saved: float = 0.0  # seconds off `optimal_seconds`: those at the int8 peak


def program_cost(cost: dict[str, float], peak_flops: float,
                 hbm_bytes_per_s: float, int8_flops_: float = 0.0,
                 int8_counted: float = 0.0, int8_peak: float | None = None) -> ProgramCost:
    """A compiled program's figures: the cost model's `optimal_seconds` where it gives one,
    else (it gives a negative figure for some TPU programs) the program's roofline from the
    compiler's own counts, max(FLOPs / peak, bytes accessed / HBM bandwidth), both pricing
    the int8 matmuls at the bfloat16 peak; and the FLOPs of its int8 matmuls, all it runs
    (`int8_flops_`) and those the cost model counts (`int8_counted`, the windowed matmuls'
    loop bodies once). `int8_saved` is what `int8_peak` (ops/s; None: the bfloat16 peak)
    takes off the seconds for the counted ones: int8_counted x (1 / peak - 1 / int8 peak)
    off the cost model's figure, off the roofline's FLOPs side only (where its bytes bound
    it, nothing: those matmuls' time was never in it)."""
    flops_ = cost.get("flops", 0.0)
    seconds = cost.get("optimal_seconds", 0.0)
    cheaper = int8_counted * (1 / peak_flops - 1 / (int8_peak or peak_flops))
    if seconds > 0:
        return ProgramCost(seconds, flops_, int8_flops_, int8_counted, cheaper)
    memory = cost.get("bytes accessed", 0.0) / hbm_bytes_per_s
    seconds = max(flops_ / peak_flops, memory)
    return ProgramCost(seconds, flops_, int8_flops_, int8_counted,
                       seconds - max(flops_ / peak_flops - cheaper, memory))


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The whole step's estimate per device (module docstring), in seconds and FLOPs."""

    compute: float  # the cost model's time over every layer and microbatch
    unseen: float  # FLOPs run (flops.py's, remat's recomputation) the cost model does not count
    recomputed: float  # remat's recomputation (seen by the cost model or not), at peak
    communication: float
    communication_bytes: float
    num_collectives: float
    compiler_flops: float
    layers: int
    microbatches: int
    int8_flops: float = 0.0  # the int8 matmuls' FLOPs over the step (`extrapolate`)
    int8_saved: float = 0.0  # seconds: those FLOPs at the int8 peak instead of bfloat16's
    int8_dots: int = 0  # int8 matmuls a step of the step's own program runs (`int8_dots`)
    pipeline: tuple[int, int, int] = (1, 1, 1)  # stages S, microbatches M, repeats R
    bubble: float = 0.0  # seconds each stage idles: the bubble's share of its layers' ticks
    redundant: float = 0.0  # of `compute`: the embeddings and loss rerun on the S - 1 others
    stage_transfers: tuple = ()  # the collective-permutes along "stage" (of `communication`)
    along_stage: float = 0.0  # seconds of every collective along "stage" alone, those included
    int8_counted: float = 0.0  # of `int8_flops`, those the cost model counts (`extrapolate`)

    @property
    def bubble_fraction(self) -> float:
        """(S - 1) / (M R + S - 1) (`parallel.pipeline`'s), 0 without stages."""
        return bubble_fraction(*self.pipeline)

    @property
    def seconds(self) -> float:
        """No overlap of communication with compute."""
        return self.compute + self.unseen + self.bubble + self.communication

    @property
    def overlapped_seconds(self) -> float:
        """The communication hidden behind compute."""
        return max(self.compute + self.unseen + self.bubble, self.communication)


def extrapolate(one: ProgramCost, two: ProgramCost, found: list[Collective], device_kind: str,
                *, layers: int, microbatches: int, optimizer_seconds: float,
                analytic_flops: float, recomputed_flops: float,
                peak_flops: float, int8_peak: float | None = None,
                int8_dots_: int = 0, pipeline: tuple[int, int, int] = (1, 1, 1),
                base_optimizer_seconds: float = 0.0) -> StepEstimate:
    """The step's estimate: its compute from the programs with 1 and 2 layers per stack and
    one microbatch, `layers` per stack, `microbatches` A, the optimizer's update counted once.
    The FLOPs the cost model leaves out, flops.py's per device (`analytic_flops`) and remat's
    recomputation (`recomputed_flops`) less the compiler's, at peak. Its communication from
    `found`, the collectives of the step's own program (`collectives`).

    The int8 matmuls' FLOPs (the programs' `int8_flops`, extrapolated alike) are priced at
    `int8_peak` (ops/s; None: the bfloat16 peak) wherever the estimate charged them at the
    bfloat16 peak: the TPU cost model prices an s8 x s8 matmul as a bfloat16 one or slower
    (an 8192^3 product takes the same `optimal_seconds` on v5p, 6% and 14% longer on v5e and
    v6e), so the compute loses the programs' `int8_saved` (those the cost model counts), and
    the unseen FLOPs, priced at the bfloat16 peak, lose the int8 ones among them (run less
    counted) x (1 / peak - 1 / int8 peak). Not all of them off the compute: where a program's
    roofline is its bytes, its counted int8 FLOPs cost nothing there to save.
    `int8_dots_` (the step's own program's count) is carried for the report.

    With pipeline stages (`pipeline` = (S, M, R), S > 1) `one` and `two` are compiled with the
    stage axis folded into FSDP (`tpu.layer_variant`): a device runs every layer on 1 / S of
    its stage's rows, the FLOPs of a stage's L / S layers on all of them. The pipelined step
    adds two things. Its stages idle (S - 1) / (M R + S - 1) of their ticks (the schedule runs
    them and discards what they compute): the layers' time (the cost model's and the unseen
    FLOPs') stretched to M R + S - 1 ticks from M R, `bubble`. And the embeddings and loss,
    replicated over "stage", run on every stage for all the rows: the base less its share of
    the optimizer's update (`base_optimizer_seconds`: the 1-layer program's update less a
    layer's) S - 1 times more, `redundant`."""

    def whole(field: str) -> float:
        a = getattr(one, field)
        b = getattr(two, field)
        return microbatches * (a + (layers - 1) * (b - a))

    int8 = whole("int8_flops")
    compute = (whole("optimal_seconds") - (microbatches - 1) * optimizer_seconds
               - whole("int8_saved"))
    flops_ = whole("flops")
    unseen_flops = max(0.0, analytic_flops + recomputed_flops - flops_)
    unseen_int8 = min(unseen_flops, max(0.0, int8 - whole("int8_counted")))
    cheaper = unseen_int8 * (1 / peak_flops - 1 / (int8_peak or peak_flops))
    unseen = unseen_flops / peak_flops - cheaper
    saved = whole("int8_saved") + cheaper
    stages, pipeline_microbatches, repeats = pipeline
    layer = two.optimal_seconds - one.optimal_seconds
    base = one.optimal_seconds - layer
    redundant = microbatches * (stages - 1) * max(0.0, base - base_optimizer_seconds)
    busy = max(0.0, microbatches * layers * layer) + unseen
    bubble = busy * (stages - 1) / (pipeline_microbatches * repeats)
    return StepEstimate(compute + redundant, unseen,
                        recomputed_flops / peak_flops, communication_seconds(found, device_kind),
                        sum(c.count * c.bytes_per_device() for c in found),
                        sum(c.count for c in found), flops_, layers, microbatches, int8, saved,
                        int8_dots_, pipeline, bubble, redundant,
                        tuple(c for c in found if c.stage_transfer),
                        communication_seconds([c for c in found if c.along_stage], device_kind),
                        whole("int8_counted"))


def optimizer_seconds(param_bytes_per_device: int, hbm_bytes_per_s: float,
                      state_bytes_per_device: int | None = None) -> float:
    """The optimizer's update of a device's float32 params at HBM bandwidth: params read and
    written, the gradient read, the optimizer state read and written. Adam's float32 moments
    (state = 2 x params, the default) make 7 float32 passes; bfloat16 moments 5; Adafactor's
    factored state about 3."""
    state = 2 * param_bytes_per_device if state_bytes_per_device is None else state_bytes_per_device
    return (3 * param_bytes_per_device + 2 * state) / hbm_bytes_per_s


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def describe(estimate: StepEstimate, analytic_flops: float, peak_flops: float,
             int8_peak: float | None = None, device_kind: str = "TPU v5") -> list[str]:
    """The report's lines: the estimate, its parts, the MFU it implies (against the bfloat16
    peak), and the int8 matmuls where there are any."""
    e = estimate
    int8 = [f"int8 matmuls: {e.int8_dots} s8 x s8 dot(s) a step in the compiled program, "
            f"{e.int8_flops:.4g} FLOPs per device (the cost model counts {e.int8_counted:.4g}),"
            f" priced at the int8 peak {(int8_peak or peak_flops) / 1e12:.0f}"
            f" TOP/s: {_ms(e.int8_saved)} less than at the bfloat16 peak"] \
        if e.int8_dots or e.int8_flops else []
    stages, pipeline_microbatches, repeats = e.pipeline
    transfers = e.stage_transfers
    pipelined = [
        f"pipeline: bubble {e.bubble_fraction:.6f} of each stage's ticks ({stages} stages, "
        f"{pipeline_microbatches} microbatches, {repeats} repeat(s)): {_ms(e.bubble)} idle; "
        f"{_ms(e.redundant)} of the compute is the embeddings and loss on every stage; stage "
        f"transfers {sum(c.count for c in transfers):.0f} collective-permutes, "
        f"{sum(c.count * c.bytes_per_device() for c in transfers) / 2**20:.4g} MiB per device, "
        f"{_ms(communication_seconds(list(transfers), device_kind))} "
        f"({'over DCN' if any(c.dcn for c in transfers) else 'over ICI'}) of the communication,"
        f" {_ms(e.along_stage)} with every collective along the stage axis alone"
    ] if stages > 1 else []
    return [
        f"step time estimate: {_ms(e.seconds)} = compute {_ms(e.compute)} (the compiler's cost "
        f"model over {e.layers} layer(s) x {e.microbatches} microbatch(es)) + {_ms(e.unseen)} "
        f"of FLOPs it does not count (at peak: flops.py's and {_ms(e.recomputed)} of remat's "
        f"recomputation, less the compiler's) + "
        f"{f'bubble {_ms(e.bubble)} + ' if stages > 1 else ''}communication "
        f"{_ms(e.communication)} "
        f"({e.num_collectives:.0f} collectives, {e.communication_bytes / 2**20:.4g} MiB per "
        f"device, not overlapped); {_ms(e.overlapped_seconds)} with it hidden",
        f"MFU estimate: {analytic_flops / (e.seconds * peak_flops):.1%} "
        f"({analytic_flops / (e.overlapped_seconds * peak_flops):.1%} with the communication "
        f"hidden; flops.py FLOPs / estimated time / peak)",
    ] + pipelined + int8


def group_sizes(found: list[Collective]) -> dict[str, list[int]]:
    """kind -> the sorted group sizes seen (for reports and tests)."""
    out: dict[str, set[int]] = {}
    for c in found:
        out.setdefault(c.kind, set()).add(c.group)
    return {k: sorted(v) for k, v in out.items()}

