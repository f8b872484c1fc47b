"""Collectives and int8 matmuls read from a compiled program's HLO text, for the step-time
estimate (`step_time.py`).

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
reduce-scatter it runs as. Given the program's mesh, each collective names the mesh axes its
groups span (a pipeline's stage transfers: collective-permutes along "stage") and whether a
group crosses slices: then it is timed at the chip's share of the data-center network. Two
opposite collective-permutes that can run together (`_duplex`) take the longer one's time: the
links are full duplex.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# Cloud TPU docs: interchip interconnect bandwidth per chip (all links, one direction each),
# and the links of a chip (2D torus 4, 3D torus 6). A ring collective along one mesh axis uses
# the two links of one torus dimension.
ICI_BYTES_PER_S = {"TPU v4": 2400e9 / 8, "TPU v5": 4800e9 / 8, "TPU v5 lite": 1600e9 / 8,
                   "TPU v6 lite": 3584e9 / 8}
LINKS = {"TPU v4": 6, "TPU v5": 6, "TPU v5 lite": 4, "TPU v6 lite": 4}
# Cloud TPU docs: data-center network bandwidth per chip (v5p: 50 Gbps a chip; v5e, v6e: a
# pod's 6.4 and 25.6 Tbps over its 256 chips). v4's pages give none: its collectives across
# slices are timed at ICI bandwidth.
DCN_BYTES_PER_S = {"TPU v5": 50e9 / 8, "TPU v5 lite": 6.4e12 / 8 / 256,
                   "TPU v6 lite": 25.6e12 / 8 / 256}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its kind, the bytes of its result, the devices in
    a group, how many times a step runs it, the mesh axes its groups span (where the program's
    devices were given: `collectives`' `mesh`) and whether they cross slices (DCN)."""

    kind: str
    result_bytes: int
    group: int
    count: int = 1
    axes: tuple[str, ...] = ()
    dcn: bool = False
    duplex: int = 0  # > 0: the id it shares with the opposite permute it runs beside (`_duplex`)

    def bytes_per_device(self) -> float:
        """What passes through one chip's links, ring algorithms."""
        n = self.group
        b = self.result_bytes
        if n <= 1:
            return 0.0
        return {"all-gather": b * (n - 1) / n, "reduce-scatter": b * (n - 1),
                "all-reduce": 2 * b * (n - 1) / n, "all-to-all": b * (n - 1) / n,
                "collective-permute": b, "send": b}[self.kind]

    def seconds(self, device_kind: str) -> float:
        """Its time on one torus axis (two links) of `device_kind`, times its count. A
        collective-permute sends one way (one link). Across slices, at the chip's share of
        the data-center network (`DCN_BYTES_PER_S`, where known)."""
        if self.dcn and device_kind in DCN_BYTES_PER_S:
            return self.count * self.bytes_per_device() / DCN_BYTES_PER_S[device_kind]
        link = ICI_BYTES_PER_S[device_kind] / LINKS[device_kind]
        links = 1 if self.kind in ("collective-permute", "send") else 2
        return self.count * self.bytes_per_device() / (links * link)

    @property
    def stage_transfer(self) -> bool:
        """A pipeline's stage-to-stage transfer: a collective-permute along "stage" alone."""
        return self.kind == "collective-permute" and self.axes == ("stage",)

    @property
    def along_stage(self) -> bool:
        """Any collective along "stage" alone: the transfers, the last stage's outputs to the
        buffer that every stage holds, the gradients of what the stages replicate."""
        return self.axes == ("stage",)


def _array_bytes(shape_text: str) -> int:
    return sum(_ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(shape_text))


def _group_size(line: str) -> int:
    """Devices per replica group: the first of `_device_groups`, or the mesh form
    `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`. Source-target pairs count 2; none given, 1."""
    if match := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", match.group(2)))
    groups = _device_groups(line)
    return max(len(groups[0]), 1) if groups else 1


def _device_groups(line: str) -> list[list[int]] | None:
    """The device ids of each group of a collective's line: explicit replica groups
    `{{0,1},{2,3}}`, iota ones `[2,4]<=[4,2]T(1,0)`, or source-target pairs (each a group of
    two); None for the mesh form or none given."""
    if match := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
    if match := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                          line):
        shape, dims, perm = (tuple(int(d) for d in g.split(",")) if g else None
                             for g in match.groups())
        ids = np.arange(math.prod(dims)).reshape(dims)
        ids = ids.transpose(perm) if perm else ids
        return ids.reshape(shape[0], -1).tolist()
    if match := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}", line):
        return [[int(d) for d in g.split(",") if d]
                for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
    return None


def _spans(groups: list[list[int]] | None, mesh) -> tuple[tuple[str, ...], bool]:
    """(the mesh axes along which the members of some group differ, whether a group spans
    slices) for device ids that index `mesh.devices.flat` (the program's devices in order)."""
    if groups is None or mesh is None:
        return (), False
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    slices = np.array([getattr(d, "slice_index", 0) for d in mesh.devices.flat])
    axes = set()
    dcn = False
    for group in groups:
        if not group or max(group) >= len(coords):
            return (), False
        members = coords[group]
        axes |= {a for a, name in enumerate(mesh.axis_names)
                 if len(set(members[:, a].tolist())) > 1}
        dcn = dcn or len(set(slices[group].tolist())) > 1
    return tuple(mesh.axis_names[a] for a in sorted(axes)), dcn


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


_SEND = re.compile(r"=\s*\((\w+\[[\d,]*\])[^=]*? send\(.*_xla_host_transfer_rendezvous="
                   r"\"([a-z\-]+)\.[^\"]*\".*_xla_megascale_target=(\{(?:\{\d+->\d+\},?)*\}|"
                   r"\"\{[\d,]*\}x[^\"]*\")")


def _dcn_send(send: re.Match, count: int, mesh) -> Collective:
    """A collective's part across slices: the TPU compiler sends it through the data-center
    network's runtime (a `send` with `_xla_megascale_target={{from->to},..}`, global device
    ids). Timed as one transfer of its bytes; its kind is the collective's, "send" but for a
    collective-permute (whose bytes are the transfer). A collective over slices
    (`"{slices}x{devices}"`) is timed as its ring over those slices, along the mesh axes
    that cross slices."""
    kind = send.group(2)
    if slices := re.match(r'"\{([\d,]*)\}x', send.group(3)):
        group = len(slices.group(1).split(","))
        piece = _array_bytes(send.group(1))
        axes = ()
        if mesh is not None:
            index = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
            axes = tuple(name for a, name in enumerate(mesh.axis_names)
                         if (np.diff(index, axis=a) != 0).any())
        return Collective(kind, piece * (group if kind == "all-gather" else 1), group, count,
                          axes, True)
    pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+)->(\d+)\}", send.group(3))]
    if mesh is not None:
        index = {d.id: i for i, d in enumerate(mesh.devices.flat)}
        pairs = [[index[a], index[b]] for a, b in pairs if a in index and b in index]
    axes, _ = _spans(pairs if mesh is not None else None, mesh)
    return Collective(kind if kind == "collective-permute" else "send",
                      _array_bytes(send.group(1)), 2, count, axes, True)


def collectives(hlo: str, mesh=None) -> list[Collective]:
    """The collectives of a compiled program's HLO text (`compiled.as_text()`), each with the
    number of times a step runs it. The pieces of a chain (one `channel_id` and `chain_id`)
    as one collective, run as often as its least-run piece (module docstring). With the
    program's `mesh` (device id i is `mesh.devices.flat[i]`), the axes each spans and whether
    it crosses slices."""
    computations = _computations(hlo)
    counts = _counts(computations)
    scattering = {callee for lines in computations.values() for line in lines
                  if re.search(r'"emitter":"\w*AllReduceScatterFusion"', line)
                  for callee in re.findall(r"\bcalls=%?([\w.\-]+)", line)}
    found: dict[object, Collective] = {}
    where: dict[object, tuple[str, str, frozenset]] = {}  # a permute's computation, name, pairs
    for name, lines in computations.items():
        for index, line in enumerate(lines):
            if counts.get(name, 0) and (send := _SEND.search(line)):
                found[(name, index)] = _dcn_send(send, counts[name], mesh)
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
            spans = _spans(_device_groups(line), mesh)
            if key in found and not spans[0]:  # a chain's piece without its groups
                spans = found[key].axes, found[key].dcn
            found[key] = Collective(kind, result, group, count, *spans)
            if kind == "collective-permute" and key not in where:
                where[key] = (name, re.match(r"\s*(?:ROOT )?%?([\w.\-]+)", line).group(1),
                              _pairs(line))
    return _duplex(found, where, computations)


def _pairs(line: str) -> frozenset[tuple[int, int]]:
    """A collective-permute's (source, target) device pairs; empty where it names none."""
    match = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    return frozenset((int(a), int(b)) for a, b in
                     re.findall(r"\{(\d+),(\d+)\}", match.group(1) if match else ""))


def _duplex(found: dict, where: dict, computations: dict[str, list[str]]) -> list[Collective]:
    """`found`'s collectives, each ICI collective-permute paired with one that sends the same
    way back (its source-target pairs reversed, a pair set that is not its own reverse) and
    runs beside it: in the same computation, as often, and neither reached from the other
    through the operands of that computation's instructions (the data dependence of the HLO;
    an async start's done and what reads it included). ICI links are full duplex, so such a
    pair takes the time of the longer (`communication_seconds`). Greedy, in program order:
    the windowed collective matmul's two rings (start.86 one way, start.88 the other, each
    then feeding the next start its way) pair as (86, 88) and (87, 89)."""
    operands: dict[str, dict[str, list[str]]] = {}

    def reaches(computation: str, start: str, target: str) -> bool:
        graph = operands.setdefault(computation, {
            m.group(1): re.findall(r"%([\w.\-]+)", m.group(2)) for line in
            computations[computation]
            if (m := re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line))})
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name == target:
                return True
            if name not in seen:
                seen.add(name)
                todo += graph.get(name, [])
        return False

    out = dict(found)
    keys = [k for k in where if not found[k].dcn and found[k].count
            and where[k][2] and where[k][2] != {(b, a) for a, b in where[k][2]}]
    paired: set = set()
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            (ca, na, pa), (cb, nb, pb) = where[a], where[b]
            if a in paired or b in paired or ca != cb or found[a].count != found[b].count \
                    or pb != {(t, s) for s, t in pa} \
                    or reaches(ca, na, nb) or reaches(ca, nb, na):
                continue
            paired |= {a, b}
            out[a] = dataclasses.replace(found[a], duplex=len(paired) // 2)
            out[b] = dataclasses.replace(found[b], duplex=len(paired) // 2)
    return list(out.values())


_OPERANDS = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])", re.M)
_DOT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\w+\[[\d,]*\])\S* (convolution|dot)\("
                  r"%([\w.\-]+), %([\w.\-]+)\)(.*)$", re.M)


def _int8_matmuls(hlo: str):
    """(runs of its computation, FLOPs) of each s8 x s8 dot and convolution of a compiled
    program (the TPU compiler writes a matmul as a convolution): `_counts`' runs, the loops'
    trips; `_matmul_flops`' FLOPs."""
    computations = _computations(hlo)
    counts = _counts(computations)
    for name, lines in computations.items():
        text = "\n".join(lines)
        shapes = dict(_OPERANDS.findall(text))
        for result, kind, a, b, rest in _DOT.findall(text):
            if shapes.get(a, "").startswith("s8[") and shapes.get(b, "").startswith("s8["):
                yield counts.get(name, 0), _matmul_flops(kind, result, shapes[a], shapes[b],
                                                         rest)


def _dims(array: str) -> list[int]:
    return [int(d) for d in array.partition("[")[2].rstrip("]").split(",") if d]


def _matmul_flops(kind: str, result: str, lhs: str, rhs: str, attributes: str) -> int:
    """2 x the multiply-adds of a dot (its result's elements x its contracted size) or a
    convolution, as XLA's cost analysis counts them: the output's batch x features x the
    kernel's input features x, per spatial dimension, the kernel taps that fall on the input
    (not on its padding), summed over the output's positions. No dilation."""
    if kind == "dot":
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes).group(1)
        lhs_dims = _dims(lhs)
        return 2 * math.prod(_dims(result)) * math.prod(
            lhs_dims[int(d)] for d in contracted.split(",") if d)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attributes).groups()
    sizes = [dict(zip(label, _dims(array), strict=True))
             for label, array in zip(labels, (lhs, rhs, result), strict=True)]
    window = re.search(r"window=\{([^}]*)\}", attributes)
    window = dict(re.findall(r"(\w+)=([\d_x]+)", window.group(1) if window else ""))
    spatial = sorted(c for c in labels[0] if c.isdigit())
    strides = [int(s) for s in window["stride"].split("x")] if "stride" in window \
        else [1] * len(spatial)
    lows = [int(p.split("_")[0]) for p in window["pad"].split("x")] if "pad" in window \
        else [0] * len(spatial)
    taps = 1
    for axis, stride, low in zip(spatial, strides, lows, strict=True):
        n, k = sizes[0][axis], sizes[1][axis]
        taps *= sum(max(0, min(k, n + low - o * stride) - max(0, low - o * stride))
                    for o in range(sizes[2][axis]))
    return 2 * sizes[2]["b"] * sizes[2]["f"] * sizes[1]["i"] * taps


def int8_dots(hlo: str) -> int:
    """How many int8 matmuls a step of a compiled program runs: its dots and convolutions
    whose two operands are s8, each times the runs of its computation (`_int8_matmuls`)."""
    return sum(runs for runs, _ in _int8_matmuls(hlo))


def int8_dot_flops(hlo: str) -> tuple[int, int]:
    """(counted, run): the FLOPs of a compiled program's int8 matmuls (`_int8_matmuls`) as
    its cost model counts them, each computation once (a loop's body once: the TPU
    compiler's windowed matmuls run theirs 2 or more times), and as a step runs them."""
    matmuls = list(_int8_matmuls(hlo))
    return (sum(flops_ for runs, flops_ in matmuls if runs),
            sum(runs * flops_ for runs, flops_ in matmuls))


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
    """The collectives' time one after the other, but for each pair of opposite permutes
    that run beside each other (one `duplex` id), the longer of the two."""
    pairs: dict[int, float] = {}
    alone = 0.0
    for c in found:
        if c.duplex:
            pairs[c.duplex] = max(pairs.get(c.duplex, 0.0), c.seconds(device_kind))
        else:
            alone += c.seconds(device_kind)
    return alone + sum(pairs.values())
