"""Will a config fit? Per-device memory of the real train step, planned without allocating it.

`compile_report(run, num_devices)` is what `train.py --compile_only` prints. It builds the mesh,
the abstract train state (`jax.ShapeDtypeStruct`s carrying their `NamedSharding`s) and an
abstract batch, lowers and compiles the jitted train step for them, and sets two accounts side
by side, per device:

- **analytic**: bytes of params, optimizer state and gradients from the state's shardings
  (shard shape x itemsize, so FSDP, tensor sharding and replicated leaves are honoured); the
  update's temporaries, 2 x params (the updates, needed whole for the non-finite check, and
  the new moments beside the old state the check may keep: what XLA's CPU buffer assignment
  of this step shows); and an estimate of the activations under the config's remat policy
  (`activation_bytes`);
- **compiled**: XLA's `Compiled.memory_analysis()` (arguments, outputs, donated aliases,
  temporaries, generated code). On a CPU backend (fake devices) it is the CPU compiler's buffer
  assignment: an estimate of what an accelerator would need, not a measurement of one. Compiled
  for a TPU topology (`transformer/sizing/tpu.py`) it is the TPU compiler's, and the report adds its
  peak memory against the chip's HBM, its FLOP count and time estimate, and the MFU they imply.

Shape legend: A accumulation microbatches, B rows per microbatch on one device, S source length,
T target length, N query heads, K kv heads, H head dim (d_k), Hv value head dim (d_v), D d_model,
F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.config import Resolved
from transformer.data import span_corruption
from transformer.model.config import TransformerConfig
from transformer.ops import attention, linear_attention, moe
from transformer.parallel import sharding
from transformer.sizing import flops, step_time
from transformer.training import train_state

GiB = 1024 ** 3
TRANSLATION_KEYS = ("inputs", "targets", "inputs_positions", "targets_positions",
                    "inputs_segmentation", "targets_segmentation")
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


def batch_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The global train batch's keys and shapes [A, rows per microbatch, length], from the
    config alone (no dataset is read). `grad_accum_steps` must be resolved (>= 1).

    Language-model configs (`data.objective` causal | prefix | masked) and translation configs
    use rows of `data.max_length`; the synthetic task's targets carry one more token (EOS);
    span corruption's targets are as long as one piece's noise and sentinels. Classifiers
    have "label" [A, rows] beside "inputs" (text) or "image" [A, rows, image_size,
    image_size, num_channels]."""
    accum = int(cfg.grad_accum_steps)
    rows = int(cfg.data.batch_size) // accum
    if cfg.model.architecture == "vision":
        side, channels = int(cfg.model.image_size), int(cfg.model.num_channels)
        return {"image": (accum, rows, side, side, channels), "label": (accum, rows)}
    length = int(cfg.data.max_length)
    objective = cfg.data.get("objective")
    if objective in ("causal", "prefix"):
        keys = ["targets", "targets_positions", "targets_segmentation"]
        keys += ["targets_prefix"] if objective == "prefix" else []
        return {k: (accum, rows, length) for k in keys}
    if objective == "masked":
        return {k: (accum, rows, length) for k in ("inputs", "inputs_positions",
                                                   "inputs_segmentation", "targets")}
    if objective == "span_corruption":  # targets: the noise and sentinels of a whole piece
        noise, spans = span_corruption.span_counts(span_corruption.raw_length(length),
                                                   span_corruption.NOISE_DENSITY,
                                                   span_corruption.MEAN_SPAN_LENGTH)
        return {k: (accum, rows, length if k.startswith("inputs") else noise + spans + 1)
                for k in TRANSLATION_KEYS}
    if objective == "classification":
        return {"inputs": (accum, rows, length), "label": (accum, rows)}
    if objective is not None:
        raise ValueError(f"data.objective={objective!r} is not one of causal, prefix, masked, "
                         f"span_corruption, classification")
    if cfg.data.dataset == "synthetic":
        from transformer.data.synthetic import SyntheticTask

        task = SyntheticTask(cfg.data.task, int(cfg.data.vocab_size), int(cfg.data.min_length),
                             length, int(cfg.seed))
        return {"inputs": (accum, rows, task.source_length),
                "targets": (accum, rows, task.target_length)}
    return {k: (accum, rows, length) for k in TRANSLATION_KEYS}


def abstract_batch(cfg, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as `ShapeDtypeStruct`s sharded P(None, ("data", "fsdp")): int32, the
    images float32."""
    batch_sharding = NamedSharding(mesh, P(None, sharding.BATCH_AXES))
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "image" else jnp.int32,
                                    sharding=batch_sharding)
            for k, shape in batch_shapes(cfg).items()}


def batch_lengths(model: TransformerConfig,
                  shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int]:
    """(A, global rows per microbatch, source length S, target length T) of `batch_shapes`;
    the vision model's S = T = its tokens (`vit.num_tokens`); the text classifier's T = 1."""
    accum, rows = next(iter(shapes.values()))[:2]
    if model.architecture == "vision":
        from transformer.model import vit

        return accum, rows, vit.num_tokens(model), vit.num_tokens(model)
    if model.architecture == "classifier":
        return accum, rows, shapes["inputs"][2], 1
    target = shapes["targets"][2]
    return accum, rows, shapes.get("inputs", shapes["targets"])[2], target


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s: each leaf's shard shape
    times its itemsize (a replicated leaf counts in full on every device)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def _local(size: int, parts: int) -> int:
    """A dimension's share on one device: split if `parts` divides it, else replicated."""
    return size // parts if size % parts == 0 else size


def _materialises_weights(model: TransformerConfig, kv_len: int) -> bool:
    """Whether attention keeps the [B, N, T, S] weights ("xla"; "auto" below the chunked
    threshold as on a CPU compile, where it never picks cuDNN; not the "splash" kernel)."""
    if model.attention_implementation == "auto":
        return model.attention_dropout_rate > 0.0 or kv_len < attention.AUTO_CHUNKED_MIN_KEYS
    return model.attention_implementation == "xla"


def _attention_elements(model, tensor, q_len, kv_len, policy,
                        linear: bool = False) -> tuple[int, int]:
    """(compute-dtype, float32) elements one attention sublayer saves per sequence; `linear`:
    linear attention, whose scan keeps each chunk's [C, C] scores instead of the weights."""
    n, k = _local(model.num_heads, tensor), _local(model.num_kv_heads, tensor)
    d, h, hv = model.d_model, model.d_k, model.d_v
    projections = q_len * n * h + kv_len * k * (h + hv)  # q, k, v
    context = q_len * n * hv  # A V
    weights = n * q_len * kv_len if _materialises_weights(model, kv_len) else 0
    if linear:
        weights = n * q_len * min(linear_attention.DEFAULT_CHUNK_SIZE, q_len)
    if policy == "none":  # + input, out-projection, residual sum, norm output
        return projections + context + 4 * q_len * d, weights
    if policy == "dots":  # every matmul output: q, k, v, Q K^T (float32), A V, out-projection
        return projections + context + q_len * d, weights
    if policy == "dots_no_batch":  # matmuls without batch dims: q, k, v, out-projection
        return projections + q_len * d, 0
    return 0, 0  # full: nothing inside the layer


def _expert_rows(model, length: int) -> int:
    """Rows a routed layer's experts run for a sequence of `length` tokens: k per token
    (dropless), or E x capacity slots (capacity dispatch, the sequence its group)."""
    k, e, factor = model.experts_per_token, model.num_experts, model.moe_capacity_factor
    return e * moe.capacity(length, k, e, factor) if factor else length * k


def _ffn_elements(model, tensor, length, policy, routed: bool = False) -> int:
    """Compute-dtype elements one feed-forward sublayer saves per sequence; a routed one runs
    its experts over `_expert_rows`, keeps the dispatched tokens and the experts' outputs
    (rows x D each), and a shared expert's dense sublayer beside them."""
    f, d = _local(model.d_ff, tensor), model.d_model
    matmuls_in = 2 if model.activation == "swiglu" else 1  # ff_in (and ff_gate)
    rows = _expert_rows(model, length) if routed else length
    dispatched = 2 * rows * d if routed else 0
    shared = (_ffn_elements(model, tensor, length, policy)
              if routed and model.moe_shared_expert else 0)
    if policy == "none":  # hidden before/after the activation (and the gate), out, residual, norm
        return rows * f * (matmuls_in + 1) + dispatched + 3 * length * d + shared
    if policy in ("dots", "dots_no_batch"):  # ff_in (ff_gate) and ff_out outputs
        return rows * (f * matmuls_in + d) + shared
    return 0


def _layer_bytes(model, tensor, q_len, kv_len, cross_len, policy, routed: bool = False) -> int:
    """Bytes one layer saves per sequence: self-attention over `kv_len`, cross-attention to
    `cross_len` source tokens (0: none), feed-forward (`routed`: experts); plus the layer
    input (always kept)."""
    itemsize = jnp.dtype(model.dtype).itemsize
    compute, f32 = _attention_elements(model, tensor, q_len, kv_len, policy,
                                       linear=model.attention_kind == "linear")
    if cross_len:
        cross = _attention_elements(model, tensor, q_len, cross_len, policy)
        compute, f32 = compute + cross[0], f32 + cross[1]
    compute += _ffn_elements(model, tensor, q_len, policy, routed) + q_len * model.d_model
    return compute * itemsize + f32 * 4


def activation_bytes(model: TransformerConfig, *, rows: int, source_length: int,
                     target_length: int, tensor: int = 1, loss_chunk_tokens: int = 0) -> int:
    """Estimated bytes of activations one device keeps for the backward pass of one microbatch
    of `rows` sequences (B), under `model.remat_policy`; `tensor` splits heads, d_ff and vocab.

    Per sequence and layer, in the compute dtype unless marked float32 (attention over q_len
    queries and kv_len keys; FFN over q_len tokens):

        always      the layer input                                   q_len·D
        none        attention: q, k, v, A·V, input, out-proj, residual, norm
                        q_len·N·H + kv_len·K·(H + Hv) + q_len·N·Hv + 4·q_len·D
                    + softmax weights N·q_len·kv_len (float32, only where attention
                      materialises them: "xla", or "auto" below AUTO_CHUNKED_MIN_KEYS keys,
                      a local window included; linear self-attention: its chunks' scores
                      N·q_len·C, C = min(64, q_len))
                    FFN: hidden before and after the activation (SwiGLU: and the gate), out,
                    residual, norm            q_len·F·(2 | 3) + 3·q_len·D
        dots        matmul outputs only: q, k, v, Q·K^T (float32), A·V, out-proj; ff_in
                    (ff_gate), ff_out
        dots_no_batch   as dots without Q·K^T and A·V (they have batch dimensions)
        full        nothing but the layer input

    A routed layer (`model.num_experts`) runs its FFN over R rows instead of q_len: R = k·q_len
    (dropless) or E·C (capacity dispatch, C = ceil(factor·q_len·k / E)), and keeps the
    dispatched tokens and the experts' outputs, 2·R·D ("none"); its shared expert, if any, is a
    dense FFN beside them. Not counted: the router's logits, and under expert parallelism the
    tokens a device gathers from its expert group (dropless).
    An encoder layer attends S to S; a decoder layer T to T, then (encoder-decoder) T to S;
    the vision model is an encoder whose logits are one row of num_classes per image.
    With remat, the backward pass recomputes one layer at a time: one layer's "none" figure is
    added. Outside the layers: the embedded inputs of each stack (S·D, T·D) and the logits,
    counted as two float32 copies of T·V (S·V encoder-only): kept for the loss's backward and
    their gradient; with `loss_chunk_tokens` > 0 (`optim.projected_cross_entropy_loss`) two
    float32 copies of one chunk's logits, the hidden states' gradient (T·D) and the output
    kernel's (float32 D·V) instead. Not counted: masks, dropout masks, norm statistics, XLA's
    fusion buffers.
    """
    policy, s, t = model.remat_policy, source_length, target_length
    itemsize = jnp.dtype(model.dtype).itemsize
    stacks = []  # (layers, q_len, kv_len, cross_len)
    if model.architecture != "decoder":
        stacks.append((model.num_encoder_layers, s, s, 0))
    if model.architecture not in ("encoder", "vision", "classifier"):
        cross = s if model.architecture == "encoder_decoder" else 0
        stacks.append((model.num_decoder_layers, t, t, cross))
    per_sequence = sum(_layer_bytes(model, tensor, q, kv, c, policy, model.routed(layer))
                       for num, q, kv, c in stacks for layer in range(num))
    if policy != "none":
        per_sequence += max(_layer_bytes(model, tensor, q, kv, c, "none", model.routed(layer))
                            for num, q, kv, c in stacks for layer in range(num))
    per_sequence += sum(q * model.d_model * itemsize for _, q, _, _ in stacks)
    output_length = 1 if model.classifies else s if model.architecture == "encoder" else t
    vocab = _local(model.num_classes if model.classifies else model.vocab_size, tensor)
    if loss_chunk_tokens <= 0:
        return rows * (per_sequence + 2 * 4 * output_length * vocab)
    chunk_tokens = rows * min(output_length, max(1, loss_chunk_tokens // rows))
    return (rows * (per_sequence + output_length * model.d_model * itemsize)
            + 2 * 4 * chunk_tokens * vocab + 4 * model.d_model * vocab)


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
    analytic = {
        "params": params,
        "optimizer_state": device_bytes(trainer.abstract_state.opt_state),
        "gradients": params * (2 if accum > 1 else 1),
        "update": 2 * params,
        "activations": activation_bytes(model, rows=rows, source_length=source,
                                        target_length=target,
                                        loss_chunk_tokens=trainer.loss_chunk_tokens,
                                        tensor=mesh.shape["tensor"])
        // dict(mesh.shape).get(sharding.LENGTH_AXIS, 1),  # context splits every position
        "batch": device_bytes(batch),
    }
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
                      model.attention_implementation,
                      tuple(step_time.collectives(executable.as_text())))


def _human(num_bytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def _per_device(model: TransformerConfig, memory_plan: MemoryPlan, forward) -> float:
    """`forward(flops.forward_flops parts of one row)` over one update's rows, per device."""
    accum, rows, source, target = batch_lengths(model, memory_plan.batch)
    parts = flops.forward_flops(model, source_length=source, target_length=target)
    return forward(parts) * accum * rows / math.prod(memory_plan.mesh_shape.values())


def step_flops_per_device(model: TransformerConfig, memory_plan: MemoryPlan) -> float:
    """Training matmul FLOPs of one update per device (`flops.py`: 3 x forward, over all the
    batch's rows at their full lengths)."""
    return _per_device(model, memory_plan, lambda parts: 3.0 * parts["total"])


def remat_flops(model: TransformerConfig, memory_plan: MemoryPlan) -> float:
    """The forward matmul FLOPs remat recomputes in one update per device (`flops.py`'s).
    `full`: the layers' forward but the last matmul of each sublayer (the output projection,
    the feed-forward's output), whose result only a residual sum takes and the backward pass
    does not need (JAX recomputes what it needs). `dots` and `dots_no_batch`: the attention's
    scores and values (Q K^T and A V have batch dimensions, and the splash kernel is a Pallas
    call: no policy saves it; `dots` would save XLA's einsums, counted all the same). `none`:
    0."""
    policy, m = model.remat_policy, model
    if policy == "none":
        return 0.0
    if policy != "full":
        return _per_device(model, memory_plan, lambda parts: parts["attention_scores_values"])
    output = m.num_heads * m.d_v / (m.num_heads * (m.d_k + m.d_v)
                                    + m.num_kv_heads * (m.d_k + m.d_v))
    return _per_device(model, memory_plan, lambda parts: (
        parts["attention_scores_values"] + parts["attention_projections"] * (1 - output)
        + parts["ffn"] * (1 - 1 / flops.ffn_matmuls(model))))


def _compiler_lines(model: TransformerConfig, memory_plan: MemoryPlan,
                    accelerator: Accelerator, estimate: list[str] | None) -> list[str]:
    """Peak memory against HBM, the compiler's FLOPs, its time estimate and the MFU implied
    (`estimate`: the lines of `step_time.describe`, in place of the program's own)."""
    peak, hbm, cost = memory_plan.peak_bytes, accelerator.memory_bytes, memory_plan.cost
    analytic = step_flops_per_device(model, memory_plan)
    optimal = cost["optimal_seconds"]
    compute_bound = analytic / accelerator.peak_flops
    if optimal >= compute_bound:
        seconds, bound = optimal, ""
        source = "the compiler's cost model (optimal_seconds)"
    elif optimal > 0:  # the cost model counts a loop body (scanned layer, microbatch) once
        seconds, bound = compute_bound, "at least "
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


def format_report(model: TransformerConfig, memory_plan: MemoryPlan,
                  accelerator: Accelerator | None = None,
                  estimate: list[str] | None = None) -> str:
    """The table `--compile_only` prints; its last line, `per_device_bytes: key=value ...`, is
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
    a, c = memory_plan.analytic, memory_plan.compiled

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
        "",
        row("per device", "analytic", "compiled"),
        row("params", _human(a["params"]), ""),
        row("optimizer state", _human(a["optimizer_state"]), ""),
        row("gradients" + (" + accumulator" if accum > 1 else ""), _human(a["gradients"]), ""),
        row("optimizer update temporaries", _human(a["update"]), ""),
        row(f"activations (remat {model.remat_policy})", _human(a["activations"]), ""),
        row("batch", _human(a["batch"]), ""),
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
