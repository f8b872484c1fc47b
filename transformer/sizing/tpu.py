"""Compiling for a TPU topology on a machine without a TPU (`train.py --compile_only --topology`).

With the `libtpu` wheel installed (`pip install -e ".[tpu]"`), `get_topology_desc` gives abstract
TPU devices that the TPU compiler targets ahead of time: the real train step is lowered and
compiled for them, and the compiler's memory and cost analyses are reported. Cloud TPU
accelerator-type names (`v5p-128`, `v5e-8`, `v4-32`, ...: the number counts TensorCores, two
per v4/v5p chip) map to libtpu's `<generation>:<chips per dimension>` names. An explicit
`v5e:2x2` passes through. v4 and v5p chips are one JAX device each (megacore), as on a TPU VM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
import tempfile
import time

import jax

from transformer.config import Resolved, grad_accum_steps, resolve
from transformer.parallel import sharding
from transformer.sizing import memory, report, step_flops, step_time
from transformer.util import progress

GiB = 2**30
GB = 10**9
LIBTPU_MISSING = '--topology needs libtpu: pip install -e ".[tpu]"'


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation: libtpu's name for it, its layout, and one device's figures."""

    generation: str  # the prefix get_topology_desc takes before ':'
    device: report.Accelerator  # per chip = per JAX device (megacore: both cores as one)
    cores_per_chip: int  # TensorCores; the number in a Cloud name counts these on v4/v5p
    megacore: bool
    dims: int  # 2: AxB slices, 3: AxBxC
    int8_ops: float  # peak int8 matmul ops/s per device


# Cloud TPU docs (cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}): HBM, peak bf16, HBM bandwidth,
# peak int8 (v4: "bf16 or int8", one rate; v5e 393 and v6e 1836 TOP/s; v5p's page gives bf16
# only, 918 TOP/s int8 is Google's announcement of it).
CHIPS = {
    "v4": Chip("v4", report.Accelerator("TPU v4", 32 * GiB, 275e12, 1200e9), 2, True, 3, 275e12),
    "v5p": Chip("v5", report.Accelerator("TPU v5", 95 * GiB, 459e12, 2765e9), 2, True, 3,
                918e12),
    "v5e": Chip("v5e", report.Accelerator("TPU v5 lite", 16 * GB, 197e12, 819e9), 1, False, 2,
                393e12),
    "v6e": Chip("v6e", report.Accelerator("TPU v6 lite", 32 * GB, 918e12, 1640e9), 1, False, 2,
                1836e12),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e"}
# Cloud TPU's slice shape for each chip count (the same table as MaxText's).
SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
             128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
             2048: (8, 16, 16), 4096: (16, 16, 16), 6144: (16, 16, 24)}
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
             128: (8, 16), 256: (16, 16)}
ACCEPTED = ("accelerator types v4-8 ... v4-8192, v5p-8 ... v5p-12288, v5e-1 ... v5e-256 "
            "(or v5litepod-N), v6e-1 ... v6e-256, or a chip grid such as v5e:2x2, v4:2x2x4, "
            "v5p:4x4x8")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice shape (chips per dimension), repeated over `num_slices` slices."""

    name: str  # as given
    chip: Chip
    shape: tuple[int, ...]
    num_slices: int

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape) * self.num_slices

    @property
    def libtpu_name(self) -> str:
        return f"{self.chip.generation}:{'x'.join(map(str, self.shape))}"

    def kwargs(self) -> dict:
        """`get_topology_desc`'s arguments. Torus links (`wrap`): 3D slices of whole 4x4x4
        cubes, 2D dimensions of 16 chips. They only change the cost of collectives."""
        if self.chip.dims == 3:
            wrap = (all(s % 4 == 0 for s in self.shape),) * 3
        else:
            wrap = tuple(s == 16 for s in self.shape) + (False,)
        return dict(platform="tpu", topology_name=self.libtpu_name,
                    chip_config_name="megacore" if self.chip.megacore else "default",
                    chips_per_host_bounds=(2, 2, 1) if math.prod(self.shape) >= 4 else (1, 1, 1),
                    num_slices=self.num_slices, wrap=wrap)


def parse_topology(name: str, num_slices: int = 1) -> Topology:
    """'v5p-128' | 'v5litepod-4' | 'v5e:2x2' | 'v4:2x2x4' -> Topology; ValueError (one line
    listing the accepted forms) otherwise."""
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} must be >= 1")
    bad = f"--topology={name!r} is not a TPU topology; use {ACCEPTED}"
    match = re.fullmatch(r"([a-z0-9]+?)(-|:)([0-9]+(?:x[0-9]+)*)", name.strip().lower())
    if not match:
        raise ValueError(bad)
    generation, separator, size = match.groups()
    chip = CHIPS.get(ALIASES.get(generation, generation))
    if chip is None:
        raise ValueError(bad)
    if separator == ":":
        shape = tuple(int(s) for s in size.split("x"))
        shape += (1,) * (chip.dims - len(shape))
        if len(shape) != chip.dims or min(shape) < 1:
            raise ValueError(bad)
    else:
        if "x" in size or int(size) % chip.cores_per_chip:
            raise ValueError(bad)
        shape = (SHAPES_3D if chip.dims == 3 else SHAPES_2D).get(
            int(size) // chip.cores_per_chip)
        if shape is None:
            raise ValueError(bad)
    return Topology(name, chip, shape, num_slices)


def prepare_environment() -> None:
    """Before JAX starts a backend: CPU for the host's arrays, and what keeps libtpu quiet
    (TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES: any values do, they do not change the target)
    and lets it load beside another process that holds /tmp/libtpu_lockfile."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def abstract_devices(topology: Topology) -> list:
    """The topology's compile-only TPU devices (multi-slice ones carry `slice_index`)."""
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(**topology.kwargs()).devices)
    if len(devices) != topology.num_devices:
        raise ValueError(f"--topology={topology.name}: libtpu gave {len(devices)} devices, "
                         f"expected {topology.num_devices}")
    return devices


def compile_report(run: Resolved, topology: Topology, devices) -> str:
    """The `--compile_only` report of the train step compiled for `devices` (`run` resolved for
    them), with the chip's memory, the step-time estimate (`step_estimate`) and the MFU it
    implies."""
    mesh = sharding.make_mesh(run.config.mesh, devices)
    header = (f"topology: {topology.name} = {topology.libtpu_name} x {topology.num_slices} "
              f"slice(s), {len(devices)} x {devices[0].device_kind}")
    if topology.num_slices > 1:
        ici, dcn = sharding.hybrid_shape(run.config.mesh, len(devices), topology.num_slices)
        axes = ", ".join(sharding.mesh_axes(run.config.mesh))
        header += f"; {axes} within a slice {tuple(ici)}, across slices {tuple(dcn)}"
    memory_plan = _plan(run, mesh, topology)
    estimate = step_estimate(run, topology, devices, memory_plan)
    analytic = step_flops.step_flops_per_device(run.model, memory_plan)
    device = topology.chip.device
    lines = report.format_report(run.model, memory_plan, device, step_time.describe(
        estimate, analytic, device.peak_flops, topology.chip.int8_ops, device.name))
    return f"{header}\n{lines}"


def layer_variant(run: Resolved, layers: int, num_devices: int, num_slices: int) -> Resolved:
    """`run` with at most `layers` layers in each stack, unrolled (`scan_layers` False), and
    one microbatch of the same rows: a program whose every layer the cost model counts. Its
    pipeline stages are folded into FSDP (a device then runs every layer on 1 / S of the
    rows: a stage's FLOPs; `step_time.extrapolate` adds the bubble)."""
    cfg = run.config.copy_and_resolve_references()
    model = cfg.model
    if sharding.STAGE_AXIS in sharding.mesh_axes(cfg.mesh):
        ici, dcn = sharding.hybrid_shape(cfg.mesh, num_devices, num_slices)
        for axis, inside, across in zip(sharding.mesh_axes(cfg.mesh), ici, dcn, strict=True):
            cfg.mesh[axis] = inside
            cfg.mesh[f"dcn_{axis}"] = across
        cfg.mesh.fsdp *= cfg.mesh.stage
        cfg.mesh.dcn_fsdp *= cfg.mesh.dcn_stage
        cfg.mesh.stage = cfg.mesh.dcn_stage = 1
    model.scan_layers = False
    for stack in ("num_encoder_layers", "num_decoder_layers"):
        if int(model.get(stack, 0) or 0) > 0:
            model[stack] = min(int(model[stack]), layers)
    cfg.data.batch_size = int(cfg.data.batch_size) // int(cfg.grad_accum_steps)
    cfg.grad_accum_steps = 1
    return resolve(cfg, num_devices, num_slices=num_slices)


def step_estimate(run: Resolved, topology: Topology, devices,
                  memory_plan: memory.MemoryPlan) -> step_time.StepEstimate:
    """`step_time`'s estimate of `run`'s train step on `devices`: the compute of the programs
    with 1 and 2 layers per stack (one microbatch, unrolled) compiled for them, extrapolated
    to the config's layers (the deeper stack) and microbatches. The communication of the
    step's own program (`memory_plan`'s collectives)."""
    model = run.model
    device = topology.chip.device
    layers = max(model.num_decoder_layers if model.architecture in ("decoder", "encoder_decoder")
                 else 0, model.num_encoder_layers if model.architecture != "decoder" else 0)
    costs = []
    updates = []  # each program's optimizer update
    plans = {_config_key(run): memory_plan}  # a variant that is the step itself, or the other
    for depth in (1, 2):
        variant = layer_variant(run, depth, len(devices), topology.num_slices)
        key = _config_key(variant)
        if key not in plans:
            mesh = sharding.make_mesh(variant.config.mesh, devices)
            plans[key] = _plan(variant, mesh, topology)
        variant_plan = plans[key]
        costs.append(step_time.program_cost(
            variant_plan.cost, device.peak_flops, device.memory_bytes_per_s,
            variant_plan.int8_flops, variant_plan.int8_counted, topology.chip.int8_ops))
        updates.append(step_time.optimizer_seconds(
            variant_plan.analytic["params"], device.memory_bytes_per_s,
            variant_plan.analytic["optimizer_state"]))
    return step_time.extrapolate(
        *costs, list(memory_plan.collectives), device.name, layers=layers,
        microbatches=int(run.config.grad_accum_steps),
        optimizer_seconds=step_time.optimizer_seconds(
            memory_plan.analytic["params"], device.memory_bytes_per_s,
            memory_plan.analytic["optimizer_state"]),
        analytic_flops=step_flops.step_flops_per_device(model, memory_plan),
        recomputed_flops=step_flops.remat_flops(model, memory_plan),
        peak_flops=device.peak_flops, int8_peak=topology.chip.int8_ops,
        int8_dots_=memory_plan.int8_dots, pipeline=memory_plan.pipeline,
        base_optimizer_seconds=max(0.0, 2 * updates[0] - updates[1]))


def _config_key(run: Resolved) -> str:
    """`run`'s config as text: two runs alike in it compile the same program."""
    return run.config.to_json_best_effort(sort_keys=True)


class DoesNotFit(ValueError):
    """The TPU compiler refused a program for HBM, or its peak is over HBM."""


def _plan(run: Resolved, mesh, topology: Topology) -> memory.MemoryPlan:
    """`memory.plan` for TPU devices. libtpu's compiler logs to file descriptor 2, and a program
    that does not fit in HBM is an error with a memory dump of 100s of lines: that becomes one
    line (DoesNotFit, a ValueError). Any other log is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    oom = None
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            return memory.plan(run, mesh)
        except jax.errors.JaxRuntimeError as error:
            oom = re.search(r"CompileTimeHbmOom: (.*?)\. HLO module", str(error))
            if oom is None:
                raise
            raise DoesNotFit(f"does not fit on {topology.name}: the TPU compiler says "
                             f"{oom.group(1)}; shard more (mesh.fsdp, mesh.tensor), remat "
                             f"(model.remat_policy) or fewer rows per device") from None
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            if oom is None:
                sys.stderr.write(log.read())


SWEEP_CONTEXTS = (1, 2, 4, 8)
SWEEP_REMAT = ("none", "full", "dots_no_batch")
SWEEP_REPEATS = (1, 2)  # mesh.pipeline_repeats tried at each stage count


def sweep_microbatches(cfg, num_devices: int, context: int) -> list[int]:
    """The microbatch counts tried with `context`: the count `data.max_rows_per_device` sizes
    (`grad_accum_steps`: a split row counts whole, so the count grows with the split), then
    each half of it down to the count of context 1: the same memory spent on more rows."""
    most = grad_accum_steps(cfg, num_devices // context)
    least = grad_accum_steps(cfg, num_devices)
    counts = [most]
    while counts[-1] % 2 == 0 and counts[-1] // 2 >= least:
        counts.append(counts[-1] // 2)
    return counts


def sweep_quantizations(value: str | None) -> tuple[str, ...]:
    """`--sweep_quantization` ("none,int8") as a tuple of `model.quantization` values; None
    or "" is () (the config's own). ValueError (one line) for a name that is not one."""
    from transformer.model import quantization

    names = tuple(name.strip() for name in (value or "").split(",") if name.strip())
    for name in names:
        if name not in quantization.QUANTIZATIONS:
            raise ValueError(f"--sweep_quantization names {name!r}; use a comma-separated list "
                             f"of {', '.join(quantization.QUANTIZATIONS)}")
    return names


def sweep_values(flag: str, value: str | None, default: tuple, kind=int) -> tuple:
    """A comma-separated `--sweep_*` flag as a tuple of `kind`; None or "" is `default`.
    ValueError (one line naming the flag) for a value that is not one."""
    try:
        values = tuple(kind(v.strip()) for v in (value or "").split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{flag}={value!r}: use a comma-separated list like "
                         f"{','.join(map(str, default))}") from None
    if kind is str and (bad := [v for v in values if v not in SWEEP_REMAT + ("dots",)]):
        raise ValueError(f"--{flag} names {bad[0]!r}; use {', '.join(SWEEP_REMAT + ('dots',))}")
    return values or default


def sweep_points(cfg, num_devices: int, quantizations: tuple[str, ...] = (), *,
                 num_slices: int = 1, contexts: tuple[int, ...] = SWEEP_CONTEXTS,
                 remats: tuple[str, ...] = SWEEP_REMAT,
                 stages: tuple[int, ...] = ()) -> list[dict[str, object]]:
    """The default grid: for each split of the positions over `context` in `contexts` that
    divides a slice's devices, the rest of them as FSDP (data parallelism across slices),
    under each remat policy in `remats`, at each of `sweep_microbatches`, fewest last. Then
    for each count in `stages` (> 1) and each of SWEEP_REPEATS, pipeline stages: across the
    slices first (`mesh.dcn_stage`, the rest within a slice), the rest of the devices as
    FSDP, at the microbatch counts a split of that size sizes (a stage holds 1 / S of the
    layers for S times the rows). A stage point the model cannot take (layers not divisible
    by stages x repeats, fewer pipeline microbatches than stages) is kept: the sweep drops it
    with its reason. With `quantizations` (`model.quantization` values), each point once
    with each."""
    per_slice = num_devices // num_slices
    points = [{"mesh.data": 1, "mesh.fsdp": per_slice // c, "mesh.context": c,
               "mesh.tensor": 1, "model.remat_policy": remat, "grad_accum_steps": a}
              for c in contexts if per_slice % c == 0 for remat in remats
              for a in sweep_microbatches(cfg, num_devices, c)]
    for split in (s for s in stages if s > 1 and num_devices % s == 0):
        across = math.gcd(split, num_slices)
        within = split // across
        if per_slice % within:
            continue
        points += [{"mesh.data": 1, "mesh.fsdp": per_slice // within, "mesh.context": 1,
                    "mesh.tensor": 1, "mesh.stage": within, "mesh.dcn_stage": across,
                    "mesh.dcn_data": -1 if across < num_slices else 1,
                    "mesh.pipeline_repeats": repeats, "model.remat_policy": remat,
                    "grad_accum_steps": a}
                   for repeats in SWEEP_REPEATS for remat in remats
                   for a in sweep_microbatches(cfg, num_devices, split)]
    if not quantizations:
        return points
    return [{**point, "model.quantization": q} for point in points for q in quantizations]


def sweep_report(cfg, topology: Topology, devices, points: list[dict[str, object]]) -> str:
    """Compiles the train step for each point of the grid (overrides of `cfg`), drops those
    that do not fit (and, untried, a point with fewer microbatches than one that did not fit,
    the rest alike) and ranks the rest by `step_estimate` (no overlap; the overlapped figure
    beside it): one line each, fastest first, then the ones dropped and why. Each point's
    outcome goes to stderr as it comes, with the time so far and an ETA."""
    ranked = []
    dropped = []
    too_big = []
    started = time.monotonic()
    for done, overrides in enumerate(points, 1):
        line = _sweep_point(cfg, topology, devices, overrides, too_big)
        (ranked if isinstance(line, tuple) else dropped).append(line)
        elapsed = time.monotonic() - started
        print(f"{time.strftime('%H:%M:%S')} sweep: {done}/{len(points)} points, "
              f"{progress.clock(elapsed)} so far, ETA "
              f"{progress.clock(elapsed / done * (len(points) - done))}: "
              f"{line[1] if isinstance(line, tuple) else line.strip()}",
              file=sys.stderr, flush=True)
    lines = [f"sweep on {topology.name}: {len(ranked)} of {len(points)} fit, fastest first"]
    lines += [f"{rank:>3}. {text}" for rank, (_, text) in enumerate(sorted(ranked), 1)]
    return "\n".join(lines + (["dropped:"] + dropped if dropped else []))


def _sweep_point(cfg, topology: Topology, devices, overrides: dict[str, object],
                 too_big: list) -> tuple[float, str] | str:
    """One point of `sweep_report`: (estimated seconds, its ranked line), or its dropped line
    (and, where it did not fit at a microbatch count, that count added to `too_big`)."""
    device = topology.chip.device
    point = cfg.copy_and_resolve_references()
    with point.unlocked():
        for key, value in overrides.items():
            section, _, name = key.rpartition(".")
            (point[section] if section else point)[name] = value
    label = (f"data {point.mesh.data} fsdp {point.mesh.fsdp} context "
             f"{point.mesh.context} tensor {point.mesh.tensor}, remat "
             f"{point.model.remat_policy}")
    if "mesh.stage" in overrides:
        stages = int(point.mesh.stage) * int(point.mesh.dcn_stage)
        label = (f"stage {stages} ({point.mesh.dcn_stage} across slices) x {label}, "
                 f"{point.mesh.pipeline_repeats} repeat(s), "
                 f"{point.mesh.pipeline_microbatches or stages} pipeline microbatches")
    if "model.quantization" in overrides:
        label += f", {point.model.quantization}"
    if "grad_accum_steps" in overrides:
        label += f", {point.grad_accum_steps} microbatch(es)"
    rest = {k: v for k, v in overrides.items() if k != "grad_accum_steps"}
    fewer = [a for others, a in too_big if others == rest]
    if fewer and int(point.grad_accum_steps) < min(fewer):
        return f"  {label}: not tried, {min(fewer)} microbatch(es) did not fit"
    try:
        run = resolve(point, len(devices), num_slices=topology.num_slices)
        memory_plan = _plan(run, sharding.make_mesh(run.config.mesh, devices), topology)
        if memory_plan.peak_bytes > device.memory_bytes:
            raise DoesNotFit(f"peak {memory_plan.peak_bytes / GiB:.2f} GiB > HBM")
        estimate = step_estimate(run, topology, devices, memory_plan)
    except ValueError as error:
        if isinstance(error, DoesNotFit) and "grad_accum_steps" in overrides:
            too_big.append((rest, int(overrides["grad_accum_steps"])))
        return f"  {label}: {error}"
    mfu = step_flops.step_flops_per_device(run.model, memory_plan) / (
        estimate.seconds * device.peak_flops)
    if "grad_accum_steps" not in overrides:
        label += f", {run.config.grad_accum_steps} microbatch(es)"
    bubble = ""
    if "mesh.stage" in overrides:  # a stage point: its pipeline's price
        transfers = step_time.communication_seconds(list(estimate.stage_transfers), device.name)
        bubble = (f", bubble {estimate.bubble_fraction:.3f} = {estimate.bubble * 1e3:.1f} ms, "
                  f"stage transfers {transfers * 1e3:.1f} ms, along stage "
                  f"{estimate.along_stage * 1e3:.1f} ms")
    return estimate.seconds, (f"{label}: {estimate.seconds * 1e3:.1f} ms "
                              f"({estimate.overlapped_seconds * 1e3:.1f} ms overlapped), "
                              f"MFU {mfu:.1%}, peak {memory_plan.peak_bytes / GiB:.2f} GiB"
                              f"{bubble}")
