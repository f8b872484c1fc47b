"""The report `train.py --compile_only` prints (`compile_report`): the analytic and compiled
accounts of `memory.plan` side by side, per device, then whether they fit common
accelerators, or, compiled for a TPU topology, the chip's fit, time and MFU lines.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from transformer.config import Resolved
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding
from transformer.sizing.batches import batch_lengths
from transformer.sizing.memory import GiB, MemoryPlan, plan
from transformer.sizing.step_flops import step_flops_per_device

# Nominal memory per device (GiB) of common accelerators; a runtime keeps a few % for itself.
ACCELERATOR_MEMORY_GIB = (("TPU v5e", 16), ("TPU v4", 32), ("TPU v6e", 32), ("A100 40GB", 40),
                          ("A100 80GB", 80), ("H100", 80), ("TPU v5p", 95), ("H200", 141),
                          ("B200", 180))


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's nominal figures, for the fit, time and MFU lines of a compile for it."""

    name: str  # jax's device_kind
    memory_bytes: int
    peak_flops: float  # dense bfloat16 FLOP/s
    memory_bytes_per_s: float


def _human(num_bytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def _compiler_lines(model: TransformerConfig, memory_plan: MemoryPlan,
                    accelerator: Accelerator, estimate: list[str] | None) -> list[str]:
    """Peak memory against HBM, the compiler's FLOPs, its time estimate and the MFU implied
    (`estimate`: the lines of `step_time.describe`, in place of the program's own)."""
    peak = memory_plan.peak_bytes
    hbm = accelerator.memory_bytes
    cost = memory_plan.cost
    analytic = step_flops_per_device(model, memory_plan)
    optimal = cost["optimal_seconds"]
    compute_bound = analytic / accelerator.peak_flops
    if optimal >= compute_bound:
        seconds = optimal
        bound = ""
        source = "the compiler's cost model (optimal_seconds)"
    elif optimal > 0:  # the cost model counts a loop body (scanned layer, microbatch) once
        seconds = compute_bound
        bound = "at least "
        source = ("flops.py FLOPs / peak: the compiler's cost model counts each loop body once "
                  f"and gave {optimal * 1e3:.3f} ms")
    else:  # the cost model gave up (a negative figure): a lower bound on the time
        seconds = max(max(cost["flops"], analytic) / accelerator.peak_flops,
                      cost["bytes accessed"] / accelerator.memory_bytes_per_s)
        bound = "at least "
        source = ("a roofline: max(FLOPs / peak, compiler's bytes accessed / HBM bandwidth); "
                  "the compiler's cost model gave none")
    scanned = " (a scanned layer counted once)" if model.scan_layers else ""
    return [
        f"{accelerator.name}: {_human(hbm)} HBM, {accelerator.peak_flops / 1e12:.0f} TFLOP/s "
        f"bf16, {accelerator.memory_bytes_per_s / 1e9:.0f} GB/s per device",
        f"peak memory per device (compiler): {_human(peak)}, {peak / hbm:.1%} of HBM: "
        f"{'fits' if peak <= hbm else 'does not fit'}",
        f"compiler FLOPs per device per step: {cost['flops']:.3e}{scanned}; "
        f"flops.py: {analytic:.3e}",
    ] + (estimate or [
        f"step time estimate: {bound}{seconds * 1e3:.3f} ms, from {source}",
        f"MFU estimate: {'at most ' if bound else ''}"
        f"{analytic / (seconds * accelerator.peak_flops):.1%} (flops.py FLOPs / estimated time "
        f"/ peak)",
    ])


def pipeline_lines(memory_plan: MemoryPlan) -> list[str]:
    """With pipeline stages, the schedule and its bubble: the share of each stage's ticks it
    idles, (S - 1) / (M R + S - 1) (`pipeline.bubble_fraction`)."""
    stages, microbatches, repeats = memory_plan.pipeline
    if stages == 1:
        return []
    return [f"pipeline: {stages} stages x {repeats} repeat(s), {microbatches} microbatches: "
            f"{microbatches * repeats + stages - 1} ticks, bubble (S - 1) / (M R + S - 1) = "
            f"{memory_plan.bubble:.6f} of each stage's ticks"]


def format_report(model: TransformerConfig, memory_plan: MemoryPlan,
                  accelerator: Accelerator | None = None,
                  estimate: list[str] | None = None) -> str:
    """The table `--compile_only` prints. Its last line, `per_device_bytes: key=value ...`, is
    for tools to read. With the `accelerator` compiled for, its fit, time and MFU lines
    (`estimate`: the step-time lines of `step_time.describe`)."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in memory_plan.mesh_shape.items())
    devices = math.prod(memory_plan.mesh_shape.values())
    accum, rows, source, _ = batch_lengths(model, memory_plan.batch)
    per_device = rows // sharding.batch_shards(memory_plan.mesh_shape)
    if model.architecture == "vision":
        lengths = (f"images {'x'.join(map(str, memory_plan.batch['image'][2:]))} as {source} "
                   f"tokens")
    else:
        lengths = "lengths " + ", ".join(f"{k} {shape[2]}" for k, shape in
                                         memory_plan.batch.items() if k in ("inputs", "targets"))
    a = memory_plan.analytic
    c = memory_plan.compiled

    def row(name: str, analytic: str, compiled: str) -> str:
        return f"{name:<34}{analytic:>14}{compiled:>14}".rstrip()

    lines = [
        f"compile only: {devices} {memory_plan.platform} devices, mesh {mesh}",
        f"batch: {accum * rows} rows per update = {accum} microbatch(es) x {rows} rows "
        f"({per_device} per device), {lengths}",
        f"model: {memory_plan.param_count:,} params (float32), compute {model.dtype}, remat "
        f"{model.remat_policy}, scan_layers {model.scan_layers}, attention "
        f"{memory_plan.attention_implementation}",
        f"train step lowered in {memory_plan.lower_seconds:.1f} s, compiled in "
        f"{memory_plan.compile_seconds:.1f} s",
    ] + pipeline_lines(memory_plan) + [
        "",
        row("per device", "analytic", "compiled"),
        row("params", _human(a["params"]), ""),
        row("optimizer state", _human(a["optimizer_state"]), ""),
        row("gradients" + (" + accumulator" if accum > 1 else ""), _human(a["gradients"]), ""),
        row("optimizer update temporaries", _human(a["update"]), ""),
        row(f"activations (remat {model.remat_policy})", _human(a["activations"]), ""),
        row("batch", _human(a["batch"]), ""),
    ] + ([row("pipeline buffers (in temporaries)", _human(a["pipeline_buffers"]), "")]
         if "pipeline_buffers" in a else []) + [
        row("arguments (state, batch)", "", _human(c["arguments"])),
        row("outputs (state, metrics)", "", _human(c["outputs"])),
        row("aliased (donated state)", "", "-" + _human(c["aliased"])),
        row("temporaries", "", _human(c["temporaries"])),
        row("generated code", "", _human(c["generated_code"])),
        row("total", _human(memory_plan.analytic_total), _human(memory_plan.compiled_total)),
    ]
    if memory_plan.platform == "cpu":
        lines.append("(compiled on CPU: XLA's CPU buffer assignment, an estimate of an "
                     "accelerator's)")
    if accelerator is None:
        need = max(memory_plan.analytic_total, memory_plan.compiled_total)
        lines += ["", f"fits? the larger total, {_human(need)}, against nominal memory per "
                  f"device:"]
        lines += [f"  {name:<10} {gib:>4} GiB  {need / (gib * GiB):>7.0%}  "
                  f"{'fits' if need <= gib * GiB else 'does not fit'}"
                  for name, gib in ACCELERATOR_MEMORY_GIB]
    else:
        lines += [""] + _compiler_lines(model, memory_plan, accelerator, estimate)
    figures = {f"analytic_{k}": v for k, v in a.items()}
    figures |= {"analytic_total": memory_plan.analytic_total}
    figures |= {f"compiled_{k}": v for k, v in c.items()}
    figures |= {"compiled_total": memory_plan.compiled_total,
                "compiled_peak": memory_plan.peak_bytes}
    lines.append("per_device_bytes: " + " ".join(f"{k}={v}" for k, v in figures.items()))
    return "\n".join(lines)


def compile_report(run: Resolved, num_devices: int) -> str:
    """The `--compile_only` report for `run` (resolved for `num_devices`) on the first
    `num_devices` devices."""
    mesh = sharding.make_mesh(run.config.mesh, jax.devices()[:num_devices])
    return format_report(run.model, plan(run, mesh))
