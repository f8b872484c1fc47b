"""Evaluation's per-layer health records, sown by the blocks into the `HEALTH` collection only
when an apply makes it mutable (the eval step; `training/health.py` reads them): each softmax
attention's largest logit, where its scores exist, and each block output's sum of squares and
count of values."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.ops import attention, masks
from transformer.ops.grouping import as_5d, group_queries

HEALTH = "health"


def logit_max(q, k, mask, scale, window, global_tokens) -> jax.Array:
    """The largest scaled attention logit q.k * scale (1/sqrt(d_k) unless `scale`) over the
    unmasked (query, key) pairs of every head, float32: the same einsum as
    `attention.attention_weights` (XLA computes it once), before any bias or soft cap."""
    num_kv_heads = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", group_queries(q, num_kv_heads), k,
                        preferred_element_type=jnp.float32) * scale
    if window is not None:
        mask = masks.combine_masks(mask, masks.make_local_mask(
            jnp.arange(q.shape[1]), jnp.arange(k.shape[1]), window, global_tokens))
    if mask is not None:
        logits = jnp.where(as_5d(mask, num_kv_heads), logits, -jnp.inf)
    return jnp.max(logits)


def _materialises_scores(module: nn.Module, q, k, window, kwargs) -> bool:
    """Whether the module's `attention_fn` runs as "xla" (the [B, N, T, S] scores exist, so
    their maximum costs a reduction): not "chunked" or "cudnn", nor a caller's own function."""
    cfg = module.config
    fn = module.attention_fn
    if (fn.func if isinstance(fn, functools.partial) else fn) is not (
            attention.dot_product_attention):
        return False
    if cfg.attention_logit_softcap is not None:
        return True
    implementation = cfg.dense_attention_implementation
    if implementation == "auto":
        implementation = attention.choose_implementation(
            q, k, k, local_window_size=window, global_tokens=kwargs.get("global_tokens", 0))
    return implementation == "xla"


def _asked(module: nn.Module) -> bool:
    """Whether this apply asked for `HEALTH`: `init` makes every collection mutable, so the
    records would otherwise land in the initial variables beside the parameters."""
    return module.is_mutable_collection(HEALTH) and not module.is_initializing()


def sow_logit_max(module: nn.Module, q, k, mask, window, kwargs) -> None:
    """After `module.attention_fn` ran (not a cache, ring or splash): records `logit_max` as
    `attention_logit_max` where the scores exist. Nothing unless the apply asked for
    `HEALTH`."""
    if _asked(module) and _materialises_scores(module, q, k, window, kwargs):
        module.sow(HEALTH, "attention_logit_max", logit_max(
            q, k, mask, kwargs.get("scale"), window, kwargs.get("global_tokens", 0)))


def sow_residual(module: nn.Module, x, segments) -> None:
    """Records the block output's sum of squares and its count of values (the positions of
    real tokens where `segments` is given, all positions otherwise, times D), for evaluation's
    `activation_rms`. Nothing unless the apply asked for `HEALTH`."""
    if not _asked(module):
        return
    squares = jnp.square(x.astype(jnp.float32))
    if segments is None:
        count = jnp.asarray(x.size, jnp.float32)
    else:
        real = (segments != 0).astype(jnp.float32)[..., None]
        squares = squares * real
        count = real.sum() * x.shape[-1]
    module.sow(HEALTH, "residual_squares", squares.sum())
    module.sow(HEALTH, "residual_count", count)
