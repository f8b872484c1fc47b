"""A classifier's loss sums and eval figures from its logits [B, C] and labels [B] (-1: padding),
pure functions of arrays (`train_state` computes the logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer.training import optim


def classification_sums(logits: jax.Array, labels: jax.Array, *, label_smoothing=0.0,
                        z_loss=0.0) -> tuple[optim.LossSums, jax.Array, jax.Array]:
    """logits [B, C], labels [B] int (-1: padding, left out) -> (the loss sums of
    `optim.cross_entropy_loss`, the count of rows whose top-1 class is the label, the count
    whose label is among the top 5)."""
    weights = (labels >= 0).astype(jnp.float32)
    targets = jnp.maximum(labels, 0)
    sums = optim.cross_entropy_loss(logits, targets, weights, label_smoothing=label_smoothing,
                                    z_loss=z_loss)
    logits = logits.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)
    # the label's rank as `jax.lax.top_k` orders: higher logits first, ties by lower class
    # index (so the uniform logits of the zero-initialised head rank class 0 first)
    classes = jnp.arange(logits.shape[-1])
    rank = jnp.sum((logits > target_logit)
                   | ((logits == target_logit) & (classes < targets[:, None])), axis=-1)
    correct = jnp.sum((rank == 0) * weights)
    top5 = jnp.sum((rank < 5) * weights)
    return sums, correct, top5


def classification_figures(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    """An eval step's sums for a classifier, logits [B, C] and labels [B] (-1: padding):
    "nll_sum", "tokens" (rows), "correct" and, with more than 10 classes, "top5_correct"."""
    sums, correct, top5 = classification_sums(logits, labels)
    figures = {"nll_sum": sums.loss_sum, "tokens": sums.weight_sum, "correct": correct}
    return figures | ({"top5_correct": top5} if logits.shape[-1] > 10 else {})
