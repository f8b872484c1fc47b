"""Will a config fit? Per-device memory of the real train step, planned without allocating it.

`plan(run, mesh)` builds the abstract train state (`jax.ShapeDtypeStruct`s carrying their
`NamedSharding`s) and an abstract batch (`batches.py`), lowers and compiles the jitted train
step for them, and sets two accounts side by side, per device:

- **analytic**: bytes of params, optimizer state and gradients from the state's shardings
  (shard shape x itemsize, so FSDP, tensor sharding and replicated leaves are honoured). The
  update's temporaries, 2 x params (the updates, needed whole for the non-finite check, and
  the new moments beside the old state the check may keep: what XLA's CPU buffer assignment
  of this step shows), and an estimate of the activations under the config's remat policy
  (`activations.py`);
- **compiled**: XLA's `Compiled.memory_analysis()` (arguments, outputs, donated aliases,
  temporaries, generated code). On a CPU backend (fake devices) it is the CPU compiler's buffer
  assignment: an estimate of what an accelerator would need, not a measurement of one. Compiled
  for a TPU topology (`transformer/sizing/tpu.py`) it is the TPU compiler's.

`report.py` prints the two accounts, as `train.py --compile_only` does, and for a TPU topology
the chip's peak memory against its HBM, the FLOP count, time estimate and the MFU they imply.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from transformer.config import Resolved
from transformer.parallel import pipeline, sharding
from transformer.sizing import flops, step_time
from transformer.sizing.activations import activation_bytes
from transformer.sizing.batches import abstract_batch, batch_lengths, batch_shapes
from transformer.training import train_state

GiB = 1024 ** 3


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s: each leaf's shard shape
    times its itemsize (a replicated leaf counts in full on every device)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes, analytic and compiled, of one config's train step on a mesh."""

    mesh_shape: dict[str, int]
    platform: str
    batch: dict[str, tuple[int, ...]]  # key -> [A, rows per microbatch, ...] (`batch_shapes`)
    param_count: int
    analytic: dict[str, int]  # params, optimizer_state, gradients, update, activations, batch
    compiled: dict[str, int]  # arguments, outputs, aliased, temporaries, generated_code
    lower_seconds: float
    compile_seconds: float
    peak_bytes: int  # the compiler's peak memory (memory_analysis().peak_memory_in_bytes)
    cost: dict[str, float]  # the compiler's per-device flops, bytes accessed, optimal_seconds
    attention_implementation: str  # as compiled: "auto" on a TPU mesh is "splash"
    collectives: tuple = ()  # step_time.Collective of the compiled program
    int8_flops: float = 0.0  # per device, its int8 matmuls' (step_time.int8_flops)
    int8_dots: int = 0  # s8 x s8 matmuls a step runs (step_time.int8_dots)
    pipeline: tuple[int, int, int] = (1, 1, 1)  # stages S, microbatches M, repeats R
    int8_counted: float = 0.0  # of `cost`'s flops, the int8 matmuls' (step_time.int8_dot_flops)

    @property
    def bubble(self) -> float:
        """The share of each stage's ticks it idles, (S - 1) / (M R + S - 1)
        (`pipeline.bubble_fraction`); 0 without stages."""
        return pipeline.bubble_fraction(*self.pipeline)

    @property
    def analytic_total(self) -> int:
        return sum(self.analytic.values())

    @property
    def compiled_total(self) -> int:
        """Arguments + outputs - aliased (donated inputs reused as outputs) + temporaries +
        generated code: the program's peak as XLA's buffer assignment sees it."""
        c = self.compiled
        return (c["arguments"] + c["outputs"] - c["aliased"] + c["temporaries"]
                + c["generated_code"])


def plan(run: Resolved, mesh) -> MemoryPlan:
    """Lowers and compiles the real train step on abstract state and batch (nothing is
    allocated) and accounts for its memory. `run` must be resolved for the mesh's devices."""
    cfg = run.config
    trainer = train_state.build_trainer(run, mesh)
    model = trainer.model.config  # with "auto" attention resolved for the mesh's platform
    if jax.default_backend() == "cpu" and cfg.loss_chunk_tokens == -1:
        # Fake CPU devices (or abstract TPU ones) stand in for accelerators: size the loss's
        # chunks as there.
        trainer = trainer.replace(
            loss_chunk_tokens=train_state.AUTO_LOSS_CHUNK_TOKENS_ACCELERATOR)
    batch = abstract_batch(cfg, mesh)
    started = time.perf_counter()
    lowered = train_state.make_train_step(trainer, cfg).lower(trainer.abstract_state, batch)
    lowered_at = time.perf_counter()
    executable = lowered.compile()
    compiled_at = time.perf_counter()
    stats = executable.memory_analysis()
    cost = executable.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # a list before jax 0.12

    shapes = batch_shapes(cfg)
    accum, global_rows, source, target = batch_lengths(model, shapes)
    rows = global_rows // sharding.batch_shards(mesh.shape)
    params = device_bytes(trainer.abstract_state.params)
    stages = dict(mesh.shape).get(pipeline.STAGE_AXIS, 1)
    schedule = (stages, model.pipeline_microbatches or stages, model.pipeline_repeats)
    analytic = {
        "params": params,
        "optimizer_state": device_bytes(trainer.abstract_state.opt_state),
        "gradients": params * (2 if accum > 1 else 1),
        "update": 2 * params,
        "activations": _activations(model, schedule, rows=rows, source_length=source,
                                    target_length=target,
                                    loss_chunk_tokens=trainer.loss_chunk_tokens,
                                    tensor=mesh.shape["tensor"])
        // dict(mesh.shape).get(sharding.LENGTH_AXIS, 1),  # context splits every position
        "batch": device_bytes(batch),
    }
    if stages > 1:
        analytic["pipeline_buffers"] = pipeline_buffer_bytes(model, schedule, rows, target)
    hlo = executable.as_text()
    compiled = {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "generated_code": stats.generated_code_size_in_bytes,
    }
    return MemoryPlan(dict(mesh.shape), mesh.devices.flat[0].platform, shapes,
                      flops.param_counts(model)["total"], analytic, compiled,
                      lowered_at - started, compiled_at - lowered_at, stats.peak_memory_in_bytes,
                      {key: float(cost.get(key, 0.0))
                       for key in ("flops", "bytes accessed", "optimal_seconds")},
                      model.attention_implementation, tuple(step_time.collectives(hlo, mesh)),
                      step_time.int8_flops(lowered.as_text(), mesh.devices.size),
                      step_time.int8_dots(hlo), schedule, step_time.int8_dot_flops(hlo)[0])


def _activations(model, schedule: tuple[int, int, int], **kwargs) -> int:
    """`activation_bytes` on one device. With S stages (`schedule` (S, M, R)) a device keeps its
    L / S layers' activations for all its rows, and those of the chunks it runs in the
    bubble's idle ticks (the schedule runs every stage every tick and discards the idle ones'
    results): (S - 1) / (M R) of that again, L / (S R) layers of a microbatch a tick."""
    stages, microbatches, repeats = schedule
    if stages == 1:
        return activation_bytes(model, **kwargs)
    stack = pipeline.stack_field(model.architecture)
    per_stage = getattr(model, stack) // stages
    kept = activation_bytes(dataclasses.replace(model, **{stack: per_stage}), **kwargs)
    layers = activation_bytes(dataclasses.replace(model, **{stack: 2 * per_stage}),
                              **kwargs) - kept  # the stage's L / S layers alone
    return kept + layers * (stages - 1) // (microbatches * repeats)


def pipeline_buffer_bytes(model, schedule: tuple[int, int, int], rows: int,
                          length: int) -> int:
    """Bytes a device holds of the schedule's own buffers (`pipeline.run`) for `rows` rows of
    `length` positions: the M slots stage 0 reads and the last stage writes ([M, rows / M, T,
    D], replicated over the stages) and the stages' state ([S, rows / M, T, D], a stage's
    share on each device), each twice: in the forward and as its gradient in the backward."""
    stages, microbatches, _ = schedule
    row = length * model.d_model * jnp.dtype(model.dtype).itemsize
    return 2 * (rows * row + rows // microbatches * row)
