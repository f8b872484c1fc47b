"""Direct preference optimisation (Rafailov et al. 2023) as trl's `DPOTrainer` computes it with
`loss_type="sigmoid"`: `data.objective="dpo"` on (prompt, chosen, rejected) pairs
(`data/preference.py`), `finetune.dpo_beta` (default 0.1).

A batch row holds whole pairs: pair k of a row is segments 2k + 1 (prompt + chosen) and
2k + 2 (prompt + rejected), `targets_loss_mask` 1 on the responses' tokens. A side's log-prob is
the sum of its response tokens' log-probs (`pair_logps`). With log-ratios
c = log pi(chosen) - log ref(chosen) and r likewise, the loss of a pair is
-log sigmoid(beta (c - r)), averaged over the update's pairs; the figures are trl's means
over the pairs: `rewards/chosen` (beta c), `rewards/rejected` (beta r), `rewards/accuracies`
(beta c > beta r), `rewards/margins`, `logps/chosen`, `logps/rejected`.

The frozen reference is the params the run's first step starts from (the `init_from`
checkpoint). Full fine-tuning keeps a copy in the optimizer state (`with_reference`: sharded as
the params, checkpointed and resumed with them, filled by the first step); with LoRA
(`finetune.lora_rank` > 0) it is the same params with the adapters off (`lora_b` zero), no copy.
The logits are computed whole (`loss_chunk_tokens` does not apply). A step is 4 forward
passes' FLOPs, not training's 3: the policy's forward and backward, and the reference's
forward (`flops_factor` scales training's count by 4/3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformer.config import DPO_BETA
from transformer.model import lora
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding
from transformer.training.scores import perplexity

# The train and eval lines' figures, named as trl logs them
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
MODEL_KEYS = ("targets_positions", "targets_segmentation")


def beta(cfg) -> float:
    """`finetune.dpo_beta` where `data.objective="dpo"` (default 0.1, checked by
    `config.resolve`), else 0.0: no DPO."""
    if cfg.data.get("objective") != "dpo":
        return 0.0
    return float((cfg.get("finetune") or {}).get("dpo_beta", DPO_BETA))


def flops_factor(cfg) -> float:
    """A train step's FLOPs over training's count (`sizing.flops.train_flops_per_token`:
    forward and backward, 3 forwards' worth): 4/3 with DPO (`beta(cfg)` > 0), the frozen
    reference's forward added; else 1."""
    return 4.0 / 3.0 if beta(cfg) else 1.0


# --------------------------------------------------------------------------- the loss

def pair_logps(token_logps: jax.Array, segmentation: jax.Array,
               loss_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """token_logps, segmentation, loss_mask [B, T] -> (chosen, rejected) [B, T // 2], the sums
    of each pair's response-token log-probs, and `valid` [B, T // 2]: pair k is in the row
    (both sides hold a response token)."""
    length = token_logps.shape[1]
    pairs = length // 2
    counted = (loss_mask != 0) & (segmentation != 0)
    ids = jnp.where(counted, segmentation, 0)

    def sums(values):
        return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=2 * pairs + 1))(
            values, ids)

    logps = sums(jnp.where(counted, token_logps.astype(jnp.float32), 0.0))
    counts = sums(counted.astype(jnp.float32))
    valid = (counts[:, 1::2] > 0) & (counts[:, 2::2] > 0)
    return logps[:, 1::2], logps[:, 2::2], valid


def sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta_: float,
                 valid=None) -> dict[str, jax.Array]:
    """Sums over the valid pairs (all where `valid` is None) of trl's sigmoid loss and
    figures: {"loss", "pairs", *METRICS}. Divide by "pairs" for trl's means."""
    valid = jnp.ones(chosen.shape, bool) if valid is None else valid
    chosen_ratios = chosen - ref_chosen
    rejected_ratios = rejected - ref_rejected
    losses = -jax.nn.log_sigmoid(beta_ * (chosen_ratios - rejected_ratios))
    chosen_rewards = beta_ * chosen_ratios
    rejected_rewards = beta_ * rejected_ratios
    per_pair = {"loss": losses, "pairs": jnp.ones_like(losses),
                "rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32),
                "rewards/margins": chosen_rewards - rejected_rewards,
                "logps/chosen": chosen, "logps/rejected": rejected}
    return {k: jnp.sum(jnp.where(valid, v, 0.0)) for k, v in per_pair.items()}


def pair_count(batch: dict) -> jax.Array:
    """The pairs of a batch: the first tokens of its chosen sides (odd segments)."""
    segments = batch["targets_segmentation"]
    return jnp.sum((segments % 2 == 1) & (batch["targets_positions"] == 0)).astype(jnp.float32)


def token_logps(trainer, params, batch: dict, dropout_rng) -> jax.Array:
    """log p(targets[t] | the row's earlier tokens of its segment) [B, T], float32."""
    deterministic = dropout_rng is None
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh):
        logits = trainer.model.apply(
            {"params": params}, None, batch["targets"],
            **{k: batch[k] for k in MODEL_KEYS if k in batch}, deterministic=deterministic,
            rngs=None if deterministic else {"dropout": dropout_rng})
    logps = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logps, batch["targets"][..., None], axis=-1)[..., 0]


def figure_sums(trainer, params, reference, batch: dict, dropout_rng) -> dict[str, jax.Array]:
    """`sigmoid_loss`'s sums for a microbatch [B, T]: the policy `params` (dropout when
    `dropout_rng` is given) against `reference` (never differentiated, no dropout), `reference`
    's (params, whether they hold the reference: else `params` are it)."""
    masks = batch["targets_segmentation"], batch["targets_loss_mask"]
    policy = pair_logps(token_logps(trainer, params, batch, dropout_rng), *masks)
    stored, filled = jax.lax.stop_gradient(reference)
    frozen = jax.lax.stop_gradient(params)
    ref_tokens = jax.lax.cond(filled, lambda: token_logps(trainer, stored, batch, None),
                              lambda: token_logps(trainer, frozen, batch, None))
    ref = pair_logps(ref_tokens, *masks)
    return sigmoid_loss(policy[0], policy[1], ref[0], ref[1], trainer.dpo_beta, policy[2])


def eval_figures(sums: dict) -> dict[str, float]:
    """An eval line from summed `eval_sums`: `loss` and METRICS, means over the pairs, and
    `perplexity`, the policy's on the chosen responses' tokens."""
    count = max(float(sums["pairs"]), 1.0)
    nll = -float(sums["logps/chosen"]) / max(float(sums.get("chosen_tokens", 0.0)), 1.0)
    return {k: float(sums[k]) / count for k in ("loss", *METRICS)} | {
        "perplexity": perplexity(nll)}


# --------------------------------------------------------------------------- the reference

class ReferenceState(NamedTuple):
    """The optimizer state of a full fine-tuning DPO run: the wrapped optimizer's and the
    frozen reference params, `filled` 1 once the first step has copied them in (an int32:
    the checkpoint's checksums read no bool)."""
    inner: Any
    reference: Any
    filled: jax.Array


def with_reference(tx: optax.GradientTransformation,
                   model: TransformerConfig) -> optax.GradientTransformation:
    """`tx` whose state also holds the reference params (zeros until the first update, which
    stores the params it is given); `tx` itself with LoRA, whose reference is the base."""
    if model.lora_rank:
        return tx

    def init(params):
        return ReferenceState(tx.init(params), jax.tree.map(jnp.zeros_like, params),
                              jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        updates, inner = tx.update(updates, state.inner, params)
        return updates, ReferenceState(inner, _stored(state, params), jnp.ones((), jnp.int32))

    return optax.GradientTransformation(init, update)


def _stored(state: ReferenceState, params):
    return jax.tree.map(lambda r, p: jnp.where(state.filled > 0, r, p), state.reference, params)


def reference(trainer, opt_state, params) -> tuple[Any, jax.Array]:
    """(reference params, whether they are it) for `figure_sums` in a step from `params`: the
    stored copy, which holds it once filled (before, the reference is `params` themselves: a
    `lax.cond` in `figure_sums` picks the forward pass, so no params-sized select is made); with
    LoRA, `params` with every `lora_b` zero."""
    if trainer.model.config.lora_rank:
        return jax.tree_util.tree_map_with_path(
            lambda path, p: jnp.zeros_like(p) if getattr(path[-1], "key", None) == lora.B
            else p, params), jnp.ones((), bool)
    return opt_state.reference, opt_state.filled > 0


def eval_params(trainer, state):
    """What a DPO run's eval step reads, (params, (stored reference, filled) or None); else
    the params."""
    if not trainer.dpo_beta:
        return state.params
    if trainer.model.config.lora_rank:
        return state.params, None
    return state.params, (state.opt_state.reference, state.opt_state.filled)


def eval_shardings(trainer):
    """The shardings of `eval_params`."""
    shardings = trainer.state_shardings
    if not trainer.dpo_beta:
        return shardings.params
    return shardings.params, (None if trainer.model.config.lora_rank else
                              (shardings.opt_state.reference, shardings.opt_state.filled))


def eval_sums(trainer, params, stored, batch: dict) -> dict[str, jax.Array]:
    """An eval step's `figure_sums` from `eval_params`, and "chosen_tokens"."""
    ref = (reference(trainer, None, params) if stored is None
           else (stored[0], stored[1] > 0))
    chosen = (batch["targets_loss_mask"] != 0) & (batch["targets_segmentation"] % 2 == 1)
    return figure_sums(trainer, params, ref, batch, None) | {"chosen_tokens": chosen.sum()}
