"""The train state and its steps (after flax.training.train_state): `TrainState`, `Trainer`
and `build_trainer`, sharded init, the jitted train and eval steps, global batches.

Shapes are written in the package's legend (`transformer/__init__.py`): A microbatches per
step, B global rows per microbatch, S source and T target length.

Batches are global arrays [A, B, ...] sharded P(None, ("data", "fsdp")). Each process builds
only its rows (a pure function of seed and global batch index) and
`jax.make_array_from_process_local_data` assembles the global batch. The step is one `jax.jit`
with in/out shardings and the state donated. Nothing in it reads host randomness.

Sequence batches ("targets", and "inputs" where there is a source) train the token loss. A
batch with "label" [A, B] (an image classifier's "image" [A, B, H, W, C], a text classifier's
"inputs" [A, B, S]) trains the classification loss over the logits [B, num_classes], rows
labelled -1 (eval padding) left out: every "token" counted is one labelled row.

With `model.dtype=float16` the state is a `ScaledTrainState`, its dynamic loss scale
(`optim.LossScaleState`) checkpointed with it. With `optimizer.skip_spikes` the state
(`SpikeTrainState`, `ScaledSpikeTrainState`) adds the spike window (`spikes.SpikeWindow`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.checkpoint import faults
from transformer.config import Resolved, SpikeConfig, spike_config
from transformer.model import experts, quantization, records
from transformer.model.transformer import Transformer, TransformerConfig
from transformer.model.vit import VisionTransformer, mirror_averaged_logits
from transformer.parallel import sharding
from transformer.training import dpo, health, lora, moments, optim, spikes
from transformer.training.classification import classification_figures, classification_sums
from transformer.training.scores import perplexity

BATCH_KEYS = ("inputs", "targets", "inputs_positions", "targets_positions",
              "inputs_segmentation", "targets_segmentation", "targets_prefix")
# The train-line metrics of a float16 run (docs/architecture.md): the scale in force, the
# running count.
LOSS_SCALE_METRICS = ("loss_scale", "skipped_overflow_steps")
# The train-line metrics of a run with optimizer.skip_spikes: whether this step's update was
# skipped as a spike, the running count of such steps.
SPIKE_METRICS = ("spike_skipped", "skipped_updates")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # train steps taken (updates applied or skipped), each with its own batch
    params: Any
    opt_state: Any


@flax.struct.dataclass
class ScaledTrainState(TrainState):
    """A float16 run's state: the train state and its dynamic loss scale."""
    loss_scale: optim.LossScaleState


@flax.struct.dataclass
class SpikeTrainState(TrainState):
    """A run's state with `optimizer.skip_spikes`: the train state and its spike window."""
    spikes: spikes.SpikeWindow


@flax.struct.dataclass
class ScaledSpikeTrainState(ScaledTrainState):
    """A float16 run's state with `optimizer.skip_spikes`."""
    spikes: spikes.SpikeWindow


@flax.struct.dataclass
class Trainer:
    """What the jitted functions close over, built once from the config and mesh."""

    model: Transformer | VisionTransformer = flax.struct.field(pytree_node=False)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    schedule: Callable = flax.struct.field(pytree_node=False)
    mesh: jax.sharding.Mesh = flax.struct.field(pytree_node=False)
    state_shardings: Any = flax.struct.field(pytree_node=False)
    abstract_state: Any = flax.struct.field(pytree_node=False)
    loss_chunk_tokens: int = flax.struct.field(pytree_node=False, default=0)
    # Float16 only (else None): the dynamic loss scale's settings.
    loss_scale: optim.LossScaleConfig | None = flax.struct.field(pytree_node=False,
                                                                 default=None)
    # Images: evaluation averages each image's class probabilities with its mirror's.
    test_time_flip: bool = flax.struct.field(pytree_node=False, default=False)
    # optimizer.skip_spikes (else None): the spike window's settings.
    spikes: SpikeConfig | None = flax.struct.field(pytree_node=False, default=None)
    # data.objective="dpo" (else 0): beta of dpo.py's loss over preference pairs
    dpo_beta: float = flax.struct.field(pytree_node=False, default=0.0)


def build_trainer(run: Resolved, mesh) -> Trainer:
    """Model, optimizer and the state's shardings (nothing allocated yet)."""
    cfg = run.config
    model_config = attention_for_mesh(run.model, mesh)
    model = (VisionTransformer(model_config) if model_config.architecture == "vision"
             else Transformer(model_config))
    model = quantization.quantize(model, model_config.quantization,  # "none": unchanged
                                  model_config.quantized_matmuls, mesh.devices.flat[0].platform)
    tx, schedule = make_optimizer(run)
    loss_scale = (optim.loss_scale_config(cfg.optimizer) if run.model.dtype == "float16"
                  else None)
    spiking = spike_config(cfg.optimizer)
    boxed = jax.eval_shape(functools.partial(_init_boxed, model, tx, loss_scale, spiking),
                           jax.random.key(0))
    shardings = sharding.tree_shardings(boxed, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            nn.unbox(boxed), shardings)
    return Trainer(model, tx, schedule, mesh, shardings, abstract,
                   loss_chunk_tokens=resolve_loss_chunk_tokens(cfg.loss_chunk_tokens),
                   loss_scale=loss_scale,
                   test_time_flip=bool(cfg.data.get("test_time_flip")), spikes=spiking,
                   dpo_beta=dpo.beta(cfg))


def make_optimizer(run: Resolved) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The run's optimizer as the trainer applies it, and its learning-rate schedule."""
    cfg = run.config
    tx, schedule = optim.make_optimizer(cfg.optimizer, d_model=run.model.d_model,
                                        total_steps=cfg.num_train_steps)
    tx = lora.freeze_base(tx, run.model)  # finetune.lora_rank > 0: the adapters alone
    tx = dpo.with_reference(tx, run.model) if dpo.beta(cfg) else tx  # its frozen copy
    return tx, schedule


def attention_for_mesh(model: TransformerConfig, mesh) -> TransformerConfig:
    """`model.attention_implementation="auto"` on a mesh of TPUs (compile-only ones included)
    becomes "splash": the Pallas kernel in the self-attention layers it fits."""
    if model.attention_implementation == "auto" and mesh.devices.flat[0].platform == "tpu":
        return dataclasses.replace(model, attention_implementation="splash")
    return model


# Target tokens per device whose logits the loss computes at once, by backend, for
# `loss_chunk_tokens=-1`: on a CPU a chunk's [tokens, V] logits should stay in cache (512 x 8,192
# float32 is 16 MiB; docs/results/2026-11-29-cpu-workloads-chunked-loss.md); on an accelerator
# chunks only bound memory and must stay large enough to keep the matmuls efficient.
AUTO_LOSS_CHUNK_TOKENS = {"cpu": 512}
AUTO_LOSS_CHUNK_TOKENS_ACCELERATOR = 8192


def resolve_loss_chunk_tokens(value: int) -> int:
    """The config's `loss_chunk_tokens` (-1: by backend) as tokens per device (0: unchunked)."""
    value = int(value)
    if value >= 0:
        return value
    return AUTO_LOSS_CHUNK_TOKENS.get(jax.default_backend(), AUTO_LOSS_CHUNK_TOKENS_ACCELERATOR)


def _init_boxed(model: Transformer | VisionTransformer, tx,
                loss_scale: optim.LossScaleConfig | None, spiking: SpikeConfig | None,
                rng) -> TrainState:
    """The initial state with logical-axis boxes (optimizer state inherits the params' boxes).
    A `ScaledTrainState` when `loss_scale` is set; with `spiking` set, its spike-window kind."""
    if isinstance(model, VisionTransformer):
        cfg = model.config
        images = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float32)
        params = model.init({"params": rng}, images)["params"]
    else:
        tokens = jnp.ones((1, 1), jnp.int32)
        params = model.init({"params": rng}, tokens, tokens)["params"]
    fields = {"step": jnp.zeros((), jnp.int32), "params": params,
              "opt_state": moments.unbox_masked(tx.init(params))}
    if loss_scale is not None:
        fields["loss_scale"] = optim.init_loss_scale(loss_scale)
    if spiking is not None:
        fields["spikes"] = spikes.init_window(spiking)
    kind = {(False, False): TrainState, (True, False): ScaledTrainState,
            (False, True): SpikeTrainState, (True, True): ScaledSpikeTrainState}
    return kind[loss_scale is not None, spiking is not None](**fields)


def without_spikes(state: TrainState) -> TrainState:
    """`state` (arrays or abstract) as the state of a run without `optimizer.skip_spikes`."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    fields.pop("spikes", None)
    return (ScaledTrainState if "loss_scale" in fields else TrainState)(**fields)


def with_spikes(state: TrainState, window: spikes.SpikeWindow) -> TrainState:
    """`state` of a run without `optimizer.skip_spikes` with the spike window `window`."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    kind = ScaledSpikeTrainState if "loss_scale" in fields else SpikeTrainState
    return kind(**fields, spikes=window)


def init_state(trainer: Trainer, seed: int) -> TrainState:
    """Sharded init: each device computes only its own shards of params and optimizer state."""
    init = jax.jit(lambda rng: nn.unbox(_init_boxed(trainer.model, trainer.tx,
                                                    trainer.loss_scale, trainer.spikes, rng)),
                   out_shardings=trainer.state_shardings)
    return init(jax.random.key(seed))


# --------------------------------------------------------------------------- steps


def _model_kwargs(batch: dict) -> dict:
    return {k: batch[k] for k in BATCH_KEYS[2:] if k in batch}


def loss_weights(batch: dict) -> jax.Array:
    """1.0 where a target token counts in the loss: not padding (segment 0 where the batch has
    segment ids, so that id 0 may be an ordinary token; else token 0) and, for a prefix LM, not
    in the prefix. (A masked LM's targets are 0 except at the masked positions.) For a
    classification batch, 1.0 on each row whose label is not -1 (padding)."""
    if "label" in batch:
        return (batch["label"] >= 0).astype(jnp.float32)
    counted = batch.get("targets_segmentation", batch["targets"]) != 0
    if "targets_prefix" in batch:
        counted = counted & (batch["targets_prefix"] == 0)
    if "targets_loss_mask" in batch:  # supervised fine-tuning: the assistant's tokens (chat.py)
        counted = counted & (batch["targets_loss_mask"] != 0)
    return counted.astype(jnp.float32)


def sequence_tokens(config: TransformerConfig, batch: dict) -> jax.Array:
    """Non-pad tokens of the sequence FLOPs are counted per (`flops.train_flops_per_token`):
    the inputs of an encoder-only model, else the targets, prefix included. For translation
    and causal LMs these are the loss's target tokens. A masked LM reads ~7x its 15%.
    A classifier counts its labelled rows (FLOPs are per image)."""
    if "label" in batch:
        return loss_weights(batch).sum()
    side = "inputs" if config.architecture == "encoder" else "targets"
    segments = batch.get(f"{side}_segmentation", batch[side])
    return (segments != 0).sum().astype(jnp.float32)


def classifier_logits(trainer: Trainer, params, batch: dict, dropout_rng) -> jax.Array:
    """The classifier's logits [B, num_classes] float32 for a batch with "label": the vision
    model reads "image" [B, H, W, C], the text classifier (`Transformer.classify`) "inputs"
    [B, S]. Dropout when `dropout_rng` is given. Without it, `trainer.test_time_flip` gives the
    log of the mean probabilities of each image and its mirror (`mirror_averaged_logits`)."""
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh):
        if "image" in batch:
            def image_logits(images):
                return trainer.model.apply({"params": params}, images,
                                           deterministic=deterministic, rngs=rngs)

            if deterministic and trainer.test_time_flip:
                return mirror_averaged_logits(image_logits, batch["image"])
            return image_logits(batch["image"])
        if "inputs" in batch:
            return trainer.model.apply({"params": params}, batch["inputs"],
                                       **_model_kwargs(batch), deterministic=deterministic,
                                       rngs=rngs, method="classify")
    raise ValueError(f"a classification batch needs 'image' or 'inputs' (keys: {sorted(batch)})")


def _loss_sums(trainer: Trainer, params, batch, *, label_smoothing, z_loss, dropout_rng,
               grad_scale=1.0, with_health=False, reference=None):
    """(optim.LossSums, routed layers' `experts.statistics` or {}[, `health.eval_sums`]).
    DPO: (its loss summed over the pairs, the pairs), `dpo.figure_sums`."""
    if trainer.dpo_beta:
        sums = dpo.figure_sums(trainer, params, reference, batch, dropout_rng)
        return optim.LossSums(sums.pop("loss"), sums.pop("pairs"), jnp.zeros(())), sums
    if "label" in batch:
        logits = classifier_logits(trainer, params, batch, dropout_rng)
        return classification_sums(logits, batch["label"], label_smoothing=label_smoothing,
                                   z_loss=z_loss)[0], {}
    routed = trainer.model.config.num_experts > 0
    deterministic = dropout_rng is None
    # The model's activation constraints (`nn.with_logical_constraint`) need the rules and the
    # mesh in scope; without them they do nothing and XLA may gather FSDP activations whole.
    chunked = trainer.loss_chunk_tokens > 0
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh):
        output = trainer.model.apply(
            {"params": params}, batch.get("inputs"), batch["targets"], **_model_kwargs(batch),
            deterministic=deterministic, method="output_head" if chunked else "__call__",
            rngs=None if deterministic else {"dropout": dropout_rng},
            mutable=[experts.COLLECTION] * routed + [records.HEALTH] * with_health)
        output, variables = output
        moe = experts.statistics(variables[experts.COLLECTION]) if routed else {}
        extra = (moe, health.eval_sums(variables)) if with_health else (moe,)
        if chunked:  # the kernel gathered over fsdp once, not in every chunk
            kernel = nn.with_logical_constraint(
                output.kernel, ("vocab", None) if output.vocab_axis == 0 else (None, "vocab"))
    weights = loss_weights(batch)
    if not chunked:
        return optim.cross_entropy_loss(output, batch["targets"], weights,
                                        label_smoothing=label_smoothing, z_loss=z_loss), *extra
    rows = output.hidden.shape[0]
    rows_per_device = max(1, rows // sharding.batch_shards(trainer.mesh.shape))
    return optim.projected_cross_entropy_loss(
        output.hidden, kernel, batch["targets"], weights, vocab_axis=output.vocab_axis,
        label_smoothing=label_smoothing, z_loss=z_loss,
        chunk_length=max(1, trainer.loss_chunk_tokens // rows_per_device),
        grad_scale=grad_scale), *extra


# A routed model's train-line metrics (`experts.statistics`), means over the microbatches
MOE_METRICS = ("moe_aux_loss", "router_z_loss", "expert_load_max", "expert_load_min",
               "moe_dropped")


def make_train_step(trainer: Trainer, cfg, injected: faults.Spikes | None = None) -> Callable:
    """`train_step(state, batch) -> (state, metrics)`, jitted with the state donated; `cfg` is
    a `Resolved.config`. `injected`: spikes put into the loss (`faults.spike_factor`).

    The loss is the sum over all devices and accumulation steps divided by the global count of
    target tokens in the loss (`loss_weights`), so accumulating A microbatches equals one batch
    A times larger. An update whose loss, gradient or update is not finite is never applied
    (metric `nonfinite`). The step still counts (its batch and dropout key are used up).

    Float16 (`trainer.loss_scale` set): the loss is multiplied by the state's loss scale before
    differentiation and the float32 gradients divided by it. Non-finite gradients are then an
    overflow: the update is skipped, the scale halves (`optim.update_loss_scale`), and the step
    is not `nonfinite` unless the loss itself is not finite or the scale was already at its
    minimum (scaling cannot help then). Metrics `loss_scale` (the scale this step used) and
    `skipped_overflow_steps` (the running count, this step included).

    With `optimizer.skip_spikes` (`trainer.spikes`) a finite update that `spikes.judge` calls a
    spike is not applied either (metrics `spike_skipped`, `skipped_updates`, `spikes_in_a_row`
    and `spike_stop`: `max_skipped_in_a_row` reached). A skipped update of either kind leaves
    params and optimizer state bit-identical.

    Metric "health" holds `health.group_norms` (per-layer parameter, gradient and update
    norms) on the steps that write a train line (every `log_every_steps`, the last) and on a
    non-finite step, where the loop names the first layer that went wrong; elsewhere it is
    zeros, not computed (`health_logged` false).
    """
    label_smoothing = float(cfg.label_smoothing)
    z_loss = float(cfg.z_loss)
    model = trainer.model.config
    seed = int(cfg.seed)
    scaled = trainer.loss_scale is not None
    log_every, total_steps = int(cfg.log_every_steps), int(cfg.num_train_steps)

    def train_step(state: TrainState, batch: dict):
        num_micro = batch["label" if "label" in batch else "targets"].shape[0]
        total_weight = jnp.maximum((dpo.pair_count(batch) if trainer.dpo_beta
                                    else loss_weights(batch)).sum(), 1.0)
        reference = dpo.reference(trainer, state.opt_state, state.params
                                  ) if trainer.dpo_beta else None
        step_rng = jax.random.fold_in(jax.random.key(seed), state.step + 1)
        scale = state.loss_scale.scale if scaled else 1.0
        spiked = faults.spike_factor(injected, state.step + 1)  # None: nothing injected

        def microbatch(grads_and_sums, xs):
            micro, index = xs

            def loss_fn(params):
                sums, moe = _loss_sums(trainer, params, micro, label_smoothing=label_smoothing,
                                       z_loss=z_loss,
                                       dropout_rng=jax.random.fold_in(step_rng, index),
                                       grad_scale=scale / total_weight if scaled else 1.0,
                                       reference=reference)
                loss = sums.loss_sum / total_weight
                if trainer.dpo_beta:  # the pairs' figures, means over the update's pairs
                    # once the scan below has divided each microbatch's by num_micro
                    moe = {k: v / total_weight * num_micro for k, v in moe.items()}
                elif moe:  # the routers' losses, each microbatch's mean over its routed tokens
                    loss += (model.moe_aux_loss_coef * moe["moe_aux_loss"]
                             + model.moe_z_loss_coef * moe["router_z_loss"]) / num_micro
                if spiked is not None:
                    loss = loss * spiked
                return (loss * scale if scaled else loss), (sums, moe)

            (_, (sums, moe)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            acc_grads, acc_loss, acc_z, acc_moe = grads_and_sums
            return (jax.tree.map(jnp.add, acc_grads, grads), acc_loss + sums.loss_sum,
                    acc_z + sums.z_loss_sum,
                    jax.tree.map(lambda a, m: a + m / num_micro, acc_moe, moe)), None

        moe_zeros = {name: jnp.zeros((), jnp.float32) for name in (
            dpo.METRICS if trainer.dpo_beta else MOE_METRICS if model.num_experts else ())}
        zeros = (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros((), jnp.float32),
                 jnp.zeros((), jnp.float32), moe_zeros)
        (grads, loss_sum, z_sum, moe_sums), _ = jax.lax.scan(microbatch, zeros,
                                                             (batch, jnp.arange(num_micro)))
        if scaled:  # exact: the scale is a power of two
            grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = trainer.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss = loss_sum / total_weight
        if spiked is not None:
            loss = loss * spiked
        finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
                  & jnp.isfinite(optax.tree.norm(updates)))
        applied = finite
        if trainer.spikes is not None:
            spike, window = spikes.judge(state.spikes, trainer.spikes, loss, grad_norm, finite)
            applied = finite & ~spike
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        logged = ((state.step + 1) % log_every == 0) | (state.step + 1 == total_steps) | ~finite
        norms = functools.partial(health.group_norms, state.params, grads, updates)
        group_norms = jax.lax.cond(logged, norms, lambda: jax.tree.map(
            lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(norms)))
        metrics = {"loss": loss, "z_loss": z_sum / total_weight, "grad_norm": grad_norm,
                   # The rate this update used: the schedule at the optimizer's count of
                   # applied updates, which a skipped update leaves behind state.step.
                   "learning_rate": trainer.schedule(moments.applied_updates(state.opt_state)),
                   "target_tokens": jnp.maximum(loss_weights(batch).sum(), 1.0),
                   "sequence_tokens": sequence_tokens(trainer.model.config, batch),
                   "source_tokens": (batch["inputs"] != 0).sum() if "inputs" in batch else 0,
                   "nonfinite": ~finite, "health": group_norms, "health_logged": logged,
                   } | moe_sums
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if trainer.spikes is not None:
            metrics |= {"spike_skipped": spike, "skipped_updates": window.skipped,
                        "spikes_in_a_row": window.in_a_row,
                        "spike_stop": window.in_a_row >= trainer.spikes.max_in_a_row}
            new_state = new_state.replace(spikes=window)
        if scaled:
            overflow = ~jnp.isfinite(grad_norm)
            loss_scale = optim.update_loss_scale(state.loss_scale, ~overflow,
                                                 trainer.loss_scale.period)
            rescaled = overflow & jnp.isfinite(loss) & (scale > optim.MIN_LOSS_SCALE)
            metrics |= {"nonfinite": ~finite & ~rescaled, "loss_scale": scale,
                        "skipped_overflow_steps": loss_scale.overflow_steps}
            new_state = new_state.replace(loss_scale=loss_scale)
        return new_state, metrics

    batch_sharding = NamedSharding(trainer.mesh, P(None, sharding.BATCH_AXES))
    return jax.jit(train_step, in_shardings=(trainer.state_shardings, batch_sharding),
                   out_shardings=(trainer.state_shardings, sharding.replicated(trainer.mesh)),
                   donate_argnums=(0,))


def make_eval_step(trainer: Trainer) -> Callable:
    """`eval_step(params, batch [1, B, ...]) -> {"nll_sum", "tokens"}`: unsmoothed NLL sums.
    A classification batch adds "correct" and, with more than 10 classes, "top5_correct" (its
    "tokens" are rows); a text model's its `health.eval_sums` (`health.add_eval_sums` adds)."""

    def eval_step(params, batch):
        batch = jax.tree.map(lambda x: x[0], batch)
        if trainer.dpo_beta:  # params: dpo.eval_params
            return dpo.eval_sums(trainer, *params, batch)
        if "label" in batch:
            return classification_figures(classifier_logits(trainer, params, batch, None),
                                          batch["label"])
        sums, _, layers = _loss_sums(trainer, params, batch, label_smoothing=0.0, z_loss=0.0,
                                     dropout_rng=None, with_health=True)
        return {"nll_sum": sums.loss_sum, "tokens": sums.weight_sum} | layers

    batch_sharding = NamedSharding(trainer.mesh, P(None, sharding.BATCH_AXES))
    return jax.jit(eval_step, in_shardings=(dpo.eval_shardings(trainer), batch_sharding),
                   out_shardings=sharding.replicated(trainer.mesh))


# --------------------------------------------------------------------------- batches


def process_rows(mesh, global_batch: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of a global batch that this process feeds."""
    index_map = NamedSharding(mesh, P(sharding.BATCH_AXES)).addressable_devices_indices_map(
        (global_batch,))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop or global_batch for idx in index_map.values()})
    start = starts[0]
    stop = stops[-1]
    per_device = global_batch // sharding.batch_shards(mesh.shape)
    if (stop - start) != per_device * len(starts):
        raise ValueError(f"process {jax.process_index()} feeds non-contiguous batch rows")
    return start, stop


def global_batch(mesh, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Per-process rows [A, rows, length] -> global arrays [A, B, length] sharded over data x
    fsdp."""
    batch_sharding = NamedSharding(mesh, P(None, sharding.BATCH_AXES))
    return {k: jax.make_array_from_process_local_data(batch_sharding, v)
            for k, v in local.items()}


def eval_metrics(sums: dict) -> dict:
    """Eval `loss` (NLL per target token), `perplexity` and `health.eval_figures`. A classifier's
    sums (with "correct") give `loss` (NLL per row), `accuracy` (top-1 fraction) and, where
    summed (more than 10 classes), `top5_accuracy`. Perplexity means nothing there."""
    if "pairs" in sums:  # DPO
        return dpo.eval_figures(sums)
    count = max(float(sums["tokens"]), 1.0)
    loss = float(sums["nll_sum"]) / count
    if "correct" not in sums:
        return {"loss": loss, "perplexity": perplexity(loss)} | health.eval_figures(sums)
    figures = {"loss": loss, "accuracy": float(sums["correct"]) / count}
    if "top5_correct" in sums:
        figures["top5_accuracy"] = float(sums["top5_correct"]) / count
    return figures
