"""Training: the train state, sharded init, the train and eval steps, and the loop.

Shapes are written in the package's legend (`transformer/__init__.py`): A microbatches per
step, B global rows per microbatch, S source and T target length.

Batches are global arrays [A, B, length] sharded P(None, ("data", "fsdp")); each process builds
only its rows (a pure function of seed and global batch index) and
`jax.make_array_from_process_local_data` assembles the global batch. The step is one `jax.jit`
with in/out shardings and the state donated; nothing in it reads host randomness.
"""

from __future__ import annotations

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

from transformer import optim, sharding
from transformer.config import Resolved
from transformer.evaluation import perplexity
from transformer.model import Transformer, TransformerConfig

BATCH_KEYS = ("inputs", "targets", "inputs_positions", "targets_positions",
              "inputs_segmentation", "targets_segmentation", "targets_prefix")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # optimizer updates completed
    params: Any
    opt_state: Any


@flax.struct.dataclass
class Trainer:
    """What the jitted functions close over, built once from the config and mesh."""

    model: Transformer = flax.struct.field(pytree_node=False)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    schedule: Callable = flax.struct.field(pytree_node=False)
    mesh: jax.sharding.Mesh = flax.struct.field(pytree_node=False)
    state_shardings: Any = flax.struct.field(pytree_node=False)
    abstract_state: Any = flax.struct.field(pytree_node=False)
    loss_chunk_tokens: int = flax.struct.field(pytree_node=False, default=0)


def build_trainer(run: Resolved, mesh) -> Trainer:
    """Model, optimizer and the state's shardings (nothing allocated yet)."""
    cfg = run.config
    model = Transformer(run.model)
    tx, schedule = optim.make_optimizer(cfg.optimizer, d_model=run.model.d_model,
                                        total_steps=cfg.num_train_steps)
    boxed = jax.eval_shape(functools.partial(_init_boxed, model, tx), jax.random.key(0))
    shardings = sharding.tree_shardings(boxed, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            nn.unbox(boxed), shardings)
    return Trainer(model, tx, schedule, mesh, shardings, abstract,
                   loss_chunk_tokens=resolve_loss_chunk_tokens(cfg.loss_chunk_tokens))


# Target tokens per device whose logits the loss computes at once, by backend, for
# `loss_chunk_tokens=-1`: on a CPU a chunk's [tokens, V] logits should stay in cache (512 x 8,192
# float32 is 16 MiB; README, "Benchmarks"); on an accelerator chunks only bound memory and must
# stay large enough to keep the matmuls efficient.
AUTO_LOSS_CHUNK_TOKENS = {"cpu": 512}
AUTO_LOSS_CHUNK_TOKENS_ACCELERATOR = 8192


def resolve_loss_chunk_tokens(value: int) -> int:
    """The config's `loss_chunk_tokens` (-1: by backend) as tokens per device (0: unchunked)."""
    value = int(value)
    if value >= 0:
        return value
    return AUTO_LOSS_CHUNK_TOKENS.get(jax.default_backend(), AUTO_LOSS_CHUNK_TOKENS_ACCELERATOR)


def _init_boxed(model: Transformer, tx, rng) -> TrainState:
    """The initial state with logical-axis boxes (optimizer state inherits the params' boxes)."""
    tokens = jnp.ones((1, 1), jnp.int32)
    params = model.init({"params": rng}, tokens, tokens)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def init_state(trainer: Trainer, seed: int) -> TrainState:
    """Sharded init: each device computes only its own shards of params and optimizer state."""
    init = jax.jit(lambda rng: nn.unbox(_init_boxed(trainer.model, trainer.tx, rng)),
                   out_shardings=trainer.state_shardings)
    return init(jax.random.key(seed))


# --------------------------------------------------------------------------- steps


def _model_kwargs(batch: dict) -> dict:
    return {k: batch[k] for k in BATCH_KEYS[2:] if k in batch}


def loss_weights(batch: dict) -> jax.Array:
    """1.0 where a target token counts in the loss: not padding (0) and, for a prefix LM, not
    in the prefix. (A masked LM's targets are 0 except at the masked positions.)"""
    counted = batch["targets"] != 0
    if "targets_prefix" in batch:
        counted = counted & (batch["targets_prefix"] == 0)
    return counted.astype(jnp.float32)


def sequence_tokens(config: TransformerConfig, batch: dict) -> jax.Array:
    """Non-pad tokens of the sequence FLOPs are counted per (`flops.train_flops_per_token`):
    the inputs of an encoder-only model, else the targets, prefix included. For translation
    and causal LMs these are the loss's target tokens; a masked LM reads ~7x its 15%."""
    side = "inputs" if config.architecture == "encoder" else "targets"
    segments = batch.get(f"{side}_segmentation", batch[side])
    return (segments != 0).sum().astype(jnp.float32)


def _loss_sums(trainer: Trainer, params, batch, *, label_smoothing, z_loss, dropout_rng):
    deterministic = dropout_rng is None
    # The model's activation constraints (`nn.with_logical_constraint`) need the rules and the
    # mesh in scope; without them they do nothing and XLA may gather FSDP activations whole.
    chunked = trainer.loss_chunk_tokens > 0
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh):
        output = trainer.model.apply(
            {"params": params}, batch.get("inputs"), batch["targets"], **_model_kwargs(batch),
            deterministic=deterministic, method="output_head" if chunked else "__call__",
            rngs=None if deterministic else {"dropout": dropout_rng})
        if chunked:  # the kernel gathered over fsdp once, not in every chunk
            kernel = nn.with_logical_constraint(
                output.kernel, ("vocab", None) if output.vocab_axis == 0 else (None, "vocab"))
    weights = loss_weights(batch)
    if not chunked:
        return optim.cross_entropy_loss(output, batch["targets"], weights,
                                        label_smoothing=label_smoothing, z_loss=z_loss)
    rows = output.hidden.shape[0]
    rows_per_device = max(1, rows // sharding.batch_shards(trainer.mesh.shape))
    return optim.projected_cross_entropy_loss(
        output.hidden, kernel, batch["targets"], weights, vocab_axis=output.vocab_axis,
        label_smoothing=label_smoothing, z_loss=z_loss,
        chunk_length=max(1, trainer.loss_chunk_tokens // rows_per_device))


def make_train_step(trainer: Trainer, cfg) -> Callable:
    """`train_step(state, batch) -> (state, metrics)`, jitted with the state donated; `cfg` is
    a `Resolved.config`.

    The loss is the sum over all devices and accumulation steps divided by the global count of
    target tokens in the loss (`loss_weights`), so accumulating A microbatches equals one batch
    A times larger. An update whose loss, gradient or update is not finite is never applied
    (metric `nonfinite`).
    """
    label_smoothing, z_loss = float(cfg.label_smoothing), float(cfg.z_loss)
    seed = int(cfg.seed)

    def train_step(state: TrainState, batch: dict):
        total_weight = jnp.maximum(loss_weights(batch).sum(), 1.0)
        step_rng = jax.random.fold_in(jax.random.key(seed), state.step + 1)

        def microbatch(grads_and_sums, xs):
            micro, index = xs

            def loss_fn(params):
                sums = _loss_sums(trainer, params, micro, label_smoothing=label_smoothing,
                                  z_loss=z_loss, dropout_rng=jax.random.fold_in(step_rng, index))
                return sums.loss_sum / total_weight, sums

            (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            acc_grads, acc_loss, acc_z = grads_and_sums
            return (jax.tree.map(jnp.add, acc_grads, grads), acc_loss + sums.loss_sum,
                    acc_z + sums.z_loss_sum), None

        num_micro = batch["targets"].shape[0]
        zeros = (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros((), jnp.float32),
                 jnp.zeros((), jnp.float32))
        (grads, loss_sum, z_sum), _ = jax.lax.scan(microbatch, zeros,
                                                   (batch, jnp.arange(num_micro)))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = trainer.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss = loss_sum / total_weight
        finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
                  & jnp.isfinite(optax.tree.norm(updates)))
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "z_loss": z_sum / total_weight, "grad_norm": grad_norm,
                   # The rate this update used: the schedule at the optimizer's count of
                   # updates applied, which a skipped (non-finite) update leaves behind
                   # state.step (train steps taken, each with its batch and dropout key).
                   "learning_rate": trainer.schedule(
                       optax.tree.get(state.opt_state, "ScaleByScheduleState").count),
                   "target_tokens": total_weight,
                   "sequence_tokens": sequence_tokens(trainer.model.config, batch),
                   "source_tokens": (batch["inputs"] != 0).sum() if "inputs" in batch else 0,
                   "nonfinite": ~finite}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    batch_sharding = NamedSharding(trainer.mesh, P(None, sharding.BATCH_AXES))
    return jax.jit(train_step, in_shardings=(trainer.state_shardings, batch_sharding),
                   out_shardings=(trainer.state_shardings, sharding.replicated(trainer.mesh)),
                   donate_argnums=(0,))


def make_eval_step(trainer: Trainer) -> Callable:
    """`eval_step(params, batch [1, B, length]) -> {"nll_sum", "tokens"}`: unsmoothed NLL sums."""

    def eval_step(params, batch):
        batch = jax.tree.map(lambda x: x[0], batch)
        sums = _loss_sums(trainer, params, batch, label_smoothing=0.0, z_loss=0.0,
                          dropout_rng=None)
        return {"nll_sum": sums.loss_sum, "tokens": sums.weight_sum}

    batch_sharding = NamedSharding(trainer.mesh, P(None, sharding.BATCH_AXES))
    return jax.jit(eval_step, in_shardings=(trainer.state_shardings.params, batch_sharding),
                   out_shardings=sharding.replicated(trainer.mesh))


# --------------------------------------------------------------------------- batches


def process_rows(mesh, global_batch: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of a global batch that this process feeds."""
    index_map = NamedSharding(mesh, P(sharding.BATCH_AXES)).addressable_devices_indices_map(
        (global_batch,))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop or global_batch for idx in index_map.values()})
    start, stop = starts[0], stops[-1]
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
    """Eval `loss` (NLL per target token) and `perplexity` from summed figures."""
    loss = float(sums["nll_sum"]) / max(float(sums["tokens"]), 1.0)
    return {"loss": loss, "perplexity": perplexity(loss)}
