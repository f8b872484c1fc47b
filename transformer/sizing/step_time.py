"""A TPU step-time estimate built from the compiler's own figures for the whole step.

XLA's cost model (`cost_analysis()["optimal_seconds"]`) counts the body of a loop once: with
scanned layers and gradient accumulation it prices one layer of one microbatch. So the model is
compiled again twice, unrolled (`scan_layers=False`), with one microbatch of the same rows and
with 1 and with 2 layers (each stack). The difference is one layer's cost, the rest the step's
base (embeddings, loss, optimizer), and

    compute = A x (base + L x layer) - (A - 1) x optimizer update

for L layers and A microbatches, the optimizer's update (elementwise over the device's params
and Adam moments: read and written once a step, at the chip's HBM bandwidth) counted once.

Communication is read from the HLO of the step's own program (the config as it trains: scanned
layers and the microbatch loop included), not from the 1- and 2-layer ones, whose collectives XLA
combines differently (their difference can be below zero): every all-gather, reduce-scatter,
all-reduce, all-to-all and collective-permute, with its bytes, its group (replica groups) and how
many times a step runs it (the trip counts of the loops around it, `_trip_count`), timed at the
chip's ICI bandwidth along one torus axis (ring algorithms: an all-gather or reduce-scatter moves
(n-1)/n of the bytes through each chip, an all-reduce twice that). The TPU compiler splits an
async collective into a chain of fusions (start, continuations, done; the continuations often
inside a neighbouring loop), each holding the whole collective and sharing its `channel_id` and
`chain_id`: a chain is one collective, run as often as its least-run piece. An all-reduce in an
`AllReduceScatterFusion` (an all-reduce whose result each chip slices) is timed as the
reduce-scatter it runs as.

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
collectives counted once), data-center links (collectives across slices are timed at ICI
bandwidth), and everything off the device (input pipeline, host, launch overhead).
"""

from __future__ import annotations

import dataclasses
import math
import re

# Cloud TPU docs: interchip interconnect bandwidth per chip (all links, one direction each),
# and the links of a chip (2D torus 4, 3D torus 6). A ring collective along one mesh axis uses
# the two links of one torus dimension.
ICI_BYTES_PER_S = {"TPU v4": 2400e9 / 8, "TPU v5": 4800e9 / 8, "TPU v5 lite": 1600e9 / 8,
                   "TPU v6 lite": 3584e9 / 8}
LINKS = {"TPU v4": 6, "TPU v5": 6, "TPU v5 lite": 4, "TPU v6 lite": 4}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its kind, the bytes of its result, the devices in
    a group, and how many times a step runs it."""

    kind: str
    result_bytes: int
    group: int
    count: int = 1

    def bytes_per_device(self) -> float:
        """What passes through one chip's links, ring algorithms."""
        n = self.group
        b = self.result_bytes
        if n <= 1:
            return 0.0
        return {"all-gather": b * (n - 1) / n, "reduce-scatter": b * (n - 1),
                "all-reduce": 2 * b * (n - 1) / n, "all-to-all": b * (n - 1) / n,
                "collective-permute": b}[self.kind]

    def seconds(self, device_kind: str) -> float:
        """Its time on one torus axis (two links) of `device_kind`, times its count. A
        collective-permute sends one way (one link)."""
        link = ICI_BYTES_PER_S[device_kind] / LINKS[device_kind]
        links = 1 if self.kind == "collective-permute" else 2
        return self.count * self.bytes_per_device() / (links * link)


def _array_bytes(shape_text: str) -> int:
    return sum(_ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(shape_text))


def _group_size(line: str) -> int:
    """Devices per replica group: `{{0,1},{2,3}}`, iota `[2,4]<=[8]`, or the mesh form
    `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`. Source-target pairs count 2."""
    if match := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", match.group(2)))
    if match := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line):
        return int(match.group(2))
    if match := re.search(r"replica_groups=\{\{([0-9,]*)\}", line):
        return len(match.group(1).split(","))
    return 2 if "source_target_pairs" in line else 1


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines (the entry's name is "ENTRY"). A computation
    opens at the start of a line and closes with a "}" line. Its instructions are indented,
    and an attribute of several lines (the splash kernel's `kernel_metadata={`) stays in it."""
    out = {}
    name = None
    for line in hlo.splitlines():
        if match := re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line):
            name = "ENTRY" if match.group(1) else match.group(2)
            out[name] = []
        elif line.rstrip() == "}":
            name = None
        elif name is not None:
            out[name].append(line)
    return out


_CONSTANT = re.compile(r"%([\w.\-]+) = [su](?:8|16|32|64)\[\]\S* constant\((-?\d+)\)")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|branch_computations)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_FLIPPED = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}


def _trip_count(loop: str, computations: dict[str, list[str]]) -> int:
    """A while loop's trips: the compiler's `known_trip_count` where the `loop` line has one,
    else from its condition `i < N` or `i <= N` (either operand order, the compare in the
    condition or a fusion it calls), i counting from 0 by the step its body adds
    (`_counter_step`: 1 for JAX's loops, 2 for the TPU compiler's windowed collective matmuls,
    which unroll two steps of the ring into a trip), else 1 (unknown)."""
    if known := re.search(r'"known_trip_count":\{"n":"(\d+)"', loop):
        return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", loop)
    lines = list(computations.get(condition.group(1), [])) if condition else []
    for line in list(lines):
        for callee in re.findall(r"\bcalls=%?([\w.\-]+)", line):
            lines += computations.get(callee, [])
    constants = dict(_CONSTANT.findall("\n".join(lines)))
    compares = [m for line in lines
                if (m := re.search(r"compare\(([^)]*)\).*direction=(\w+)", line))]
    if len(compares) != 1:
        return 1
    operands = re.findall(r"%([\w.\-]+)", compares[0].group(1))
    direction = compares[0].group(2)
    if len(operands) != 2 or (operands[0] in constants) == (operands[1] in constants):
        return 1
    if operands[0] in constants:
        bound, direction = int(constants[operands[0]]), _FLIPPED.get(direction, direction)
        counter = operands[1]
    else:
        bound = int(constants[operands[1]])
        counter = operands[0]
    trips = {"LT": bound, "LE": bound + 1}.get(direction)
    if trips is None:
        return 1
    return -(-trips // _counter_step(loop, counter, lines, computations))


def _counter_step(loop: str, counter: str, condition: list[str],
                  computations: dict[str, list[str]]) -> int:
    """What the loop's body adds to the counter its condition compares (`counter`, element k
    of the loop's tuple): the constant in the add that the body's ROOT tuple passes on as
    element k, else 1."""
    element = next((int(m.group(1)) for line in condition if (m := re.search(
        rf"%{re.escape(counter)} = .*get-tuple-element\([^)]*\), index=(\d+)", line))), None)
    body = re.search(r"\bbody=%?([\w.\-]+)", loop)
    lines = computations.get(body.group(1), []) if body else []
    root = next((line for line in lines if line.lstrip().startswith("ROOT ")), "")
    passed = re.findall(r"%([\w.\-]+)", root.rpartition(" tuple(")[2].partition(")")[0])
    if element is None or element >= len(passed):
        return 1
    constants = dict(_CONSTANT.findall("\n".join(lines)))
    counters = {m.group(1) for line in lines if (m := re.search(
        rf"%([\w.\-]+) = .*get-tuple-element\([^)]*\), index={element}\b", line))}
    copies = [m.groups() for line in lines
              if (m := re.search(r"%([\w.\-]+) = \S+ (?:copy|bitcast)\(%([\w.\-]+)\)", line))]
    for _ in copies:  # the counter through copies of it
        counters |= {name for name, source in copies if source in counters}
    for line in lines:
        if m := re.search(rf"%{re.escape(passed[element])} = \S+ add\(%([\w.\-]+), "
                          rf"%([\w.\-]+)\)", line):
            a, b = m.groups()
            step = constants.get(b) if a in counters else constants.get(a) if b in counters \
                else None
            return int(step) if step and int(step) > 0 else 1
    return 1


def _counts(computations: dict[str, list[str]]) -> dict[str, int]:
    """How many times a step runs each computation: 1 for the entry, times a while loop's
    trip count (`_trip_count`) for its body, summed over its call sites (an async op's
    computation once, from its start: its update and done name it too)."""
    calls: dict[str, list[tuple[str, int]]] = {name: [] for name in computations}
    for caller, lines in computations.items():
        for line in lines:
            if re.search(r"\sasync-(update|done)\(", line):
                continue
            trips = _trip_count(line, computations) if " while(" in line else 1
            for key, callees in _CALLEE.findall(line):
                for callee in re.findall(r"[\w.\-]+", callees.replace("%", "")):
                    if callee in calls:
                        calls[callee].append((caller, trips if key == "body" else 1))
    counts: dict[str, int] = {}

    def count(name: str, seen=()) -> int:
        if name == "ENTRY":
            return 1
        if name not in counts:
            counts[name] = sum(count(caller, seen + (name,)) * times
                               for caller, times in calls.get(name, []) if caller not in seen)
        return counts[name]

    return {name: count(name) for name in computations}


def collectives(hlo: str) -> list[Collective]:
    """The collectives of a compiled program's HLO text (`compiled.as_text()`), each with the
    number of times a step runs it. The pieces of a chain (one `channel_id` and `chain_id`)
    as one collective, run as often as its least-run piece (module docstring)."""
    computations = _computations(hlo)
    counts = _counts(computations)
    scattering = {callee for lines in computations.values() for line in lines
                  if re.search(r'"emitter":"\w*AllReduceScatterFusion"', line)
                  for callee in re.findall(r"\bcalls=%?([\w.\-]+)", line)}
    found: dict[object, Collective] = {}
    for name, lines in computations.items():
        for index, line in enumerate(lines):
            if not ((match := _OP.search(line)) and counts.get(name, 0)):
                continue
            shape = match.group(1)
            kind = match.group(2)
            group = _group_size(line)
            if match.group(3):  # an async start's tuple holds its operand and result
                arrays = _ARRAY.findall(shape)
                shape = " ".join(f"{d}[{s}]" for d, s in arrays[1:2] or arrays[:1])
            result = _array_bytes(shape)
            if kind == "all-reduce" and name in scattering:
                kind, result = "reduce-scatter", result // group
            chain = re.search(r'channel_id=(\d+).*chain_id="(\d+)"', line)
            key = chain.groups() if chain else (name, index)
            count = min(counts[name], found[key].count) if key in found else counts[name]
            found[key] = Collective(kind, result, group, count)
    return list(found.values())


_OPERANDS = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", re.M)
_DOT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[[\d,]*\]\S* (?:convolution|dot)\("
                  r"%([\w.\-]+), %([\w.\-]+)\)", re.M)


def int8_dots(hlo: str) -> int:
    """How many int8 matmuls a step of a compiled program runs: its dots and convolutions (the
    TPU compiler writes a matmul as a convolution) whose two operands are s8, each times the
    runs of its computation (`_counts`: the loops' trips)."""
    computations = _computations(hlo)
    counts = _counts(computations)
    found = 0
    for name, lines in computations.items():
        text = "\n".join(lines)
        dtypes = dict(_OPERANDS.findall(text))
        found += counts.get(name, 0) * sum(
            1 for a, b in _DOT.findall(text) if dtypes.get(a) == dtypes.get(b) == "s8")
    return found


_DOT_GENERAL = re.compile(
    r"stablehlo\.dot_general .*contracting_dims = \[([\d, ]*)\] x .*: "
    r"\(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")


def int8_flops(stablehlo: str, num_devices: int) -> float:
    """The FLOPs per device of the int8 matmuls in a lowered program's StableHLO
    (`lowered.as_text()`): 2 x result elements x contracted size over the dot_generals of two
    i8 operands, a loop's body counted once (as the cost model counts it), the program's
    global shapes divided over its `num_devices` (every such matmul split over all of them)."""
    total = 0
    for contracting, lhs, rhs, result in _DOT_GENERAL.findall(stablehlo):
        if not (lhs.endswith("xi8") and rhs.endswith("xi8")):
            continue
        lhs_shape = [int(n) for n in lhs.split("x")[:-1]]
        contracted = math.prod(lhs_shape[int(d)] for d in contracting.split(",") if d.strip())
        total += 2 * math.prod(int(n) for n in result.split("x")[:-1]) * contracted
    return total / num_devices


def communication_seconds(found: list[Collective], device_kind: str) -> float:
    return sum(c.seconds(device_kind) for c in found)


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per-device compute figures of one compiled program."""

    optimal_seconds: float
    flops: float
    int8_flops: float = 0.0  # of `flops`, the int8 matmuls' (`int8_flops`)


def program_cost(cost: dict[str, float], peak_flops: float,
                 hbm_bytes_per_s: float, int8_flops_: float = 0.0) -> ProgramCost:
    """A compiled program's figures: the cost model's `optimal_seconds` where it gives one,
    else (it gives a negative figure for some TPU programs) the program's roofline from the
    compiler's own counts, max(FLOPs / peak, bytes accessed / HBM bandwidth); and the FLOPs of
    its int8 matmuls, which both price at the bfloat16 peak (`extrapolate` reprices them)."""
    flops_ = cost.get("flops", 0.0)
    seconds = cost.get("optimal_seconds", 0.0)
    if seconds <= 0:
        seconds = max(flops_ / peak_flops, cost.get("bytes accessed", 0.0) / hbm_bytes_per_s)
    return ProgramCost(seconds, flops_, int8_flops_)


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

    @property
    def seconds(self) -> float:
        """No overlap of communication with compute."""
        return self.compute + self.unseen + self.communication

    @property
    def overlapped_seconds(self) -> float:
        """The communication hidden behind compute."""
        return max(self.compute + self.unseen, self.communication)


def extrapolate(one: ProgramCost, two: ProgramCost, found: list[Collective], device_kind: str,
                *, layers: int, microbatches: int, optimizer_seconds: float,
                analytic_flops: float, recomputed_flops: float,
                peak_flops: float, int8_peak: float | None = None,
                int8_dots_: int = 0) -> StepEstimate:
    """The step's estimate: its compute from the programs with 1 and 2 layers per stack and
    one microbatch, `layers` per stack, `microbatches` A, the optimizer's update counted once.
    The FLOPs the cost model leaves out, flops.py's per device (`analytic_flops`) and remat's
    recomputation (`recomputed_flops`) less the compiler's, at peak. Its communication from
    `found`, the collectives of the step's own program (`collectives`).

    The int8 matmuls' FLOPs (the programs' `int8_flops`, extrapolated alike) are priced at
    `int8_peak` (ops/s; None: the bfloat16 peak): the TPU cost model prices an s8 x s8 matmul
    as a bfloat16 one or slower (an 8192^3 product takes the same `optimal_seconds` on v5p, 6%
    and 14% longer on v5e and v6e), so the compute loses int8 FLOPs x (1 / peak - 1 / int8
    peak) and keeps that surplus.
    `int8_dots_` (the step's own program's count) is carried for the report."""

    def whole(field: str) -> float:
        a = getattr(one, field)
        b = getattr(two, field)
        return microbatches * (a + (layers - 1) * (b - a))

    int8 = whole("int8_flops")
    saved = int8 * (1 / peak_flops - 1 / (int8_peak or peak_flops))
    compute = whole("optimal_seconds") - (microbatches - 1) * optimizer_seconds - saved
    flops_ = whole("flops")
    return StepEstimate(compute, max(0.0, analytic_flops + recomputed_flops - flops_) / peak_flops,
                        recomputed_flops / peak_flops, communication_seconds(found, device_kind),
                        sum(c.count * c.bytes_per_device() for c in found),
                        sum(c.count for c in found), flops_, layers, microbatches, int8, saved,
                        int8_dots_)


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
             int8_peak: float | None = None) -> list[str]:
    """The report's lines: the estimate, its parts, the MFU it implies (against the bfloat16
    peak), and the int8 matmuls where there are any."""
    e = estimate
    int8 = [f"int8 matmuls: {e.int8_dots} s8 x s8 dot(s) a step in the compiled program, "
            f"{e.int8_flops:.4g} FLOPs per device = {e.int8_flops / max(e.compiler_flops, 1):.1%}"
            f" of the compiler's, priced at the int8 peak {(int8_peak or peak_flops) / 1e12:.0f}"
            f" TOP/s: {_ms(e.int8_saved)} less than at the bfloat16 peak"] \
        if e.int8_dots or e.int8_flops else []
    return [
        f"step time estimate: {_ms(e.seconds)} = compute {_ms(e.compute)} (the compiler's cost "
        f"model over {e.layers} layer(s) x {e.microbatches} microbatch(es)) + {_ms(e.unseen)} "
        f"of FLOPs it does not count (at peak: flops.py's and {_ms(e.recomputed)} of remat's "
        f"recomputation, less the compiler's) + communication "
        f"{_ms(e.communication)} "
        f"({e.num_collectives:.0f} collectives, {e.communication_bytes / 2**20:.4g} MiB per "
        f"device, not overlapped); {_ms(e.overlapped_seconds)} with it hidden",
        f"MFU estimate: {analytic_flops / (e.seconds * peak_flops):.1%} "
        f"({analytic_flops / (e.overlapped_seconds * peak_flops):.1%} with the communication "
        f"hidden; flops.py FLOPs / estimated time / peak)",
    ] + int8


def group_sizes(found: list[Collective]) -> dict[str, list[int]]:
    """kind -> the sorted group sizes seen (for reports and tests)."""
    out: dict[str, set[int]] = {}
    for c in found:
        out.setdefault(c.kind, set()).add(c.group)
    return {k: sorted(v) for k, v in out.items()}

