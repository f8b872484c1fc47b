"""The Transformer's building blocks as Flax Linen modules: parameters with logical axis
names, arithmetic in the pure functions of `attention`, `layers` and `kv_cache`.

The sublayers (`MultiHeadAttention`, `FeedForward`), each wrapped in a residual connection and
a norm (post-LN as the paper, or pre-LN), make the encoder and decoder layers (`EncoderBlock`,
`DecoderBlock`) that `model` stacks; `RelativeBias` is T5's position bias that a stack's layers
share, `ClassifierHead` and `pool` a classifier's head. Shapes are written in the package's legend
(`transformer/__init__.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.model import lora, records
from transformer.model.config import TransformerConfig
from transformer.model.experts import MixtureOfExperts
from transformer.ops import (
    attention,
    kv_cache,
    layers,
    linear_attention,
    masks,
    relative_position,
    ring,
    splash,
)


class Weights(nn.Module):
    """A kernel (and optionally a bias) with logical axis names, returned as arrays.

    The pure functions do the arithmetic. This module only owns the parameters, so paths read
    `<name>/kernel` and `<name>/bias` as in Flax's Dense layers. With `lora_branch` it returns
    (kernel, bias, `lora.adapt`'s branch: the LoRA adapter beside the kernel, or None).
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    num_in_axes: int = 1
    use_bias: bool = True
    lora_branch: bool = False

    @nn.compact
    def __call__(self, deterministic: bool = True):
        in_axes = tuple(range(self.num_in_axes))
        out_axes = tuple(range(self.num_in_axes, len(self.shape)))
        init = nn.initializers.xavier_uniform(in_axis=in_axes, out_axis=out_axes)
        kernel = self.param("kernel", nn.with_logical_partitioning(init, self.axes), self.shape)
        kernel, branch = lora.adapt(self, kernel, self.num_in_axes, self.axes,  # lora_rank
                                    deterministic or not self.lora_branch)
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(
                nn.initializers.zeros, self.axes[self.num_in_axes:]), self.shape[self.num_in_axes:])
        return (kernel, bias, branch) if self.lora_branch else (kernel, bias)


class Norm(nn.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale) over D. The scale applied is
    scale + `norm_scale_offset` (Gemma's 1 + w), initialised to 1."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        d = x.shape[-1]
        init = nn.initializers.constant(1.0 - cfg.norm_scale_offset)
        scale = self.param("scale", nn.with_logical_partitioning(init, ("embed",)), (d,))
        if cfg.norm_scale_offset:
            scale = cfg.norm_scale_offset + scale
        if cfg.norm == "rms_norm":
            return layers.rms_norm(x, scale, eps=cfg.norm_eps)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                          (d,))
        return layers.layer_norm(x, scale, bias, eps=cfg.norm_eps)


class QKNorm(nn.Module):
    """RMSNorm of queries or keys [B, T, heads, H] (`model.qk_norm`): over each head's H
    ("head": Qwen3, Gemma 3; scale [H]) or over all heads' heads*H together ("full": OLMo 2;
    scale [heads, H], the checkpoint's [heads*H]). The scale applied is scale +
    `norm_scale_offset`, as `Norm`'s."""

    config: TransformerConfig
    heads_axis: str = "heads"

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        full = cfg.qk_norm == "full"
        shape, axes = (x.shape[-2:], (self.heads_axis, "head_dim")) if full else (
            x.shape[-1:], ("head_dim",))
        init = nn.initializers.constant(1.0 - cfg.norm_scale_offset)
        scale = self.param("scale", nn.with_logical_partitioning(init, axes), shape)
        if cfg.norm_scale_offset:
            scale = cfg.norm_scale_offset + scale
        if not full:
            return layers.rms_norm(x, scale, eps=cfg.norm_eps)
        flat = x.reshape(*x.shape[:-2], -1)
        return layers.rms_norm(flat, scale.reshape(-1), eps=cfg.norm_eps).reshape(x.shape)


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query, multi-query) attention, self or cross (paper section 3.2.2).

    `__call__(x [B,T,D], kv_inputs [B,S,D] or None for self-attention, ...) -> (y [B,T,D],
    cache)`. With a cache, self-attention writes the new keys/values at `cache_index` and
    attends over the whole cache. Cross-attention projects `kv_inputs` once and reuses them
    (with a cache, `kv_inputs` may hold one row per W rows of x: beams sharing a sentence).
    A cache holds keys and values heads first ([B, K, S, H]), and attention over it is
    `attention.cache_attention` (not `attention_fn`: a decoding step's layout, see there).
    Applied with `mutable=["intermediates"]`, it also records its softmax attention weights
    [B,N,T,S] (`attention.attention_weights`, what the "xla" implementation multiplies V with)
    as `intermediates/.../attention_weights` (the plots of `transformer.visualize`).

    Self-attention beyond the paper (`config.attention_kind`, `window`): a local layer attends
    to the `window` previous positions (`causal`) or `window` on each side, and decodes from a
    ring buffer of the last `window` keys (`kv_cache.write_ring`; the first
    `attention_global_tokens` positions, attended from everywhere, in a second one). A linear
    layer runs `linear_attention` and decodes from its recurrent state. Both read `segments` [B, T]
    (packed sequence ids, 0 = padding; decoding: 0 = a token not to remember; None: one
    sequence of real tokens) and a prefix LM's `in_prefix` [B, T].
    """

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention
    use_rope: bool = False
    window: int | None = None
    causal: bool = False

    @nn.compact
    def __call__(self, x, kv_inputs=None, *, mask=None, q_positions=None, kv_positions=None,
                 cache=None, cache_index=None, segments=None, in_prefix=None,
                 deterministic=True, bias=None):
        cfg = self.config
        dtype = cfg.compute_dtype
        d, n, kh, h, hv = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
        is_cross = kv_inputs is not None

        def project(name, spec, inputs, shape, axes, num_in_axes=1):
            use_bias = cfg.use_bias or (cfg.qkv_bias and name != "out")
            kernel, bias, branch = Weights(shape, axes, num_in_axes=num_in_axes, use_bias=use_bias,
                                           lora_branch=True, name=name)(deterministic)
            y = jnp.einsum(spec, inputs.astype(dtype), kernel.astype(dtype))
            y = y if branch is None else y + branch(inputs.astype(dtype))
            return y if bias is None else y + bias.astype(dtype)

        q = project("query", "BTD,DNH->BTNH", x, (d, n, h), ("embed", "heads", "head_dim"))
        if cfg.qk_norm != "none":
            q = QKNorm(cfg, name="query_norm")(q)
        if is_cross and cache is not None and cache.get("key") is not None:
            k = cache["key"]  # encoder keys/values projected once
            v = cache["value"]
        else:  # [B, S, K, H]; a cross-attention cache keeps them heads first
            source = kv_inputs if is_cross else x
            k = project("key", "BSD,DKH->BSKH", source, (d, kh, h),
                        ("embed", "kv_heads", "head_dim"))
            if cfg.qk_norm != "none":
                k = QKNorm(cfg, "kv_heads", name="key_norm")(k)
            v = project("value", "BSD,DKE->BSKE", source, (d, kh, hv),
                        ("embed", "kv_heads", "head_dim"))
        if self.use_rope:
            rope = cfg.rope_arguments(local=self.window is not None)
            q = layers.apply_rope(q, q_positions, **rope)
            k = layers.apply_rope(k, kv_positions, **rope)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        if not is_cross and cfg.attention_kind == "linear":
            y, cache = self._linear(q, k, v, cache, segments, in_prefix)
        else:
            y, cache = self._softmax(q, k, v, mask, cache, cache_index, segments, in_prefix,
                                     is_cross, deterministic, bias)
        out = project("out", "BTNE,NED->BTD", y, (n, hv, d), ("heads", "head_dim", "embed"),
                      num_in_axes=2)
        return out, cache

    def _linear(self, q, k, v, cache, segments, in_prefix):
        """Linear self-attention. With a cache, from and into its recurrent state."""
        feature_map = self.config.linear_feature_map
        if cache is None:
            return linear_attention.linear_attention(
                q, k, v, causal=self.causal, feature_map=feature_map, segment_ids=segments,
                in_prefix=in_prefix), None
        return linear_attention.decode_step(
            q, k, v, cache, feature_map=feature_map,
            valid=None if segments is None else segments != 0, in_prefix=in_prefix)

    def _softmax(self, q, k, v, mask, cache, cache_index, segments, in_prefix, is_cross,
                 deterministic, bias=None):
        """Softmax attention over all keys, a window of them, or a decoding cache; `bias`
        [B, N, T, S] (`RelativeBias`) added to the logits."""
        cfg = self.config
        window = None
        if self.window is not None and not is_cross:  # a causal window looks back only
            window = (self.window, 0 if self.causal and in_prefix is None else self.window)
        kwargs = {}
        if is_cross and cache is not None:
            if cache.get("key") is None:  # projected just now (int8 in an int8 cache)
                cache = kv_cache.store(cache, kv_cache.heads_first(k), kv_cache.heads_first(v))
            k, v = kv_cache.read(cache, q.dtype)
        elif cache is not None and window is not None:
            new_positions = jnp.broadcast_to(cache_index + jnp.arange(q.shape[1]), q.shape[:2])
            if segments is not None:  # tokens not to remember (padding) get no position
                new_positions = jnp.where(segments != 0, new_positions, -1)
            parts = [cache]  # the ring buffer, then
            positions = [cache["position"]]
            if "global" in cache:  # the global tokens that have left it, then the new tokens
                held = cache["global"]
                seen = (held["position"][:, :, None] == cache["position"][:, None]).any(-1)
                parts.append(held)
                positions.append(jnp.where(seen, -1, held["position"]))
            mask = masks.make_window_cache_mask(
                cache_index, q.shape[1], jnp.concatenate(positions + [new_positions], axis=1),
                window, in_prefix, global_tokens=cfg.attention_global_tokens)
            k_all, v_all = (jnp.concatenate(
                [part[name] for part in parts]
                + [kv_cache.heads_first(new).astype(cache[name].dtype)], axis=2)
                for name, new in (("key", k), ("value", v)))
            buffer = kv_cache.write_ring(cache, k, v, new_positions)
            if "global" in cache:  # keeps the first attention_global_tokens positions
                buffer["global"] = kv_cache.write_ring(cache["global"], k, v, jnp.where(
                    new_positions < cfg.attention_global_tokens, new_positions, -1))
            cache = buffer
            k = k_all
            v = v_all
        elif cache is not None:
            cache = kv_cache.write_cache(cache, k, v, cache_index)
            k, v = kv_cache.read(cache, q.dtype)
        elif window is not None:
            kwargs["local_window_size"] = window
            if cfg.attention_global_tokens:
                kwargs["global_tokens"] = cfg.attention_global_tokens
        dropout_rng = None
        if not deterministic and cfg.attention_dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        if cfg.attention_scale is not None:
            kwargs["scale"] = cfg.attention_scale
        if cfg.attention_logit_softcap is not None:
            kwargs["logit_softcap"] = cfg.attention_logit_softcap
        if bias is not None:
            kwargs["bias"] = bias
        if cache is not None:  # k, v [B, K, S, H]
            y = attention.cache_attention(q, k, v, mask=mask, **kwargs)
        elif cache is None and not is_cross and ring.context_shards() > 1:
            if bias is not None:
                raise ValueError("model.positional='relative' with mesh.context > 1: context "
                                 "parallelism's attention takes no bias; set mesh.context=1")
            y = self._context_attention(q, k, v, window, segments, in_prefix, deterministic)
        elif bias is None and self._runs_splash(q, k, is_cross, cache, in_prefix,
                                                deterministic):
            y = splash.self_attention(q, k, v, causal=self.causal, local_window_size=window,
                                      segment_ids=segments)
        else:
            y = self.attention_fn(
                q, k, v, mask=mask, dropout_rate=0.0 if deterministic
                else cfg.attention_dropout_rate, dropout_rng=dropout_rng, **kwargs)
            records.sow_logit_max(self, q, k, mask, window, kwargs)  # eval's, where asked
        if self.is_mutable_collection("intermediates"):  # asked for: apply(mutable=[...])
            keys = k if cache is None else jnp.swapaxes(k, 1, 2)
            rows = q.shape[0] // keys.shape[0]  # W beams sharing their sentence's keys
            if rows > 1:
                keys = jnp.repeat(keys, rows, axis=0)
                mask = mask if mask is None or mask.shape[0] == 1 else jnp.repeat(
                    mask, rows, axis=0)
            self.sow("intermediates", "attention_weights",
                     attention.attention_weights(q, keys, mask=mask, **kwargs))
        return y, cache

    def _context_attention(self, q, k, v, window, segments, in_prefix, deterministic):
        """Training's self-attention with the positions split over the mesh's "context" axis
        (`ops/ring.py`), under the mask that `causal`, the window, the global tokens,
        `segments` and `in_prefix` imply (as Encoder and Decoder build it). A decoder's rows
        are in `ops/ring.py`'s load-balanced order where `context_load_balanced` says so."""
        cfg = self.config
        if not deterministic and cfg.attention_dropout_rate > 0.0:
            raise ValueError(f"model.attention_dropout_rate={cfg.attention_dropout_rate} with "
                             f"mesh.context > 1: context parallelism's attention has no "
                             f"dropout; set it to 0 or mesh.context=1")
        return ring.self_attention(
            q, k, v, causal=self.causal, strategy=cfg.context_parallel_strategy,
            local_window_size=window,
            global_tokens=cfg.attention_global_tokens if window is not None else 0,
            segment_ids=segments, in_prefix=in_prefix,
            load_balanced=self.causal and cfg.context_load_balanced)

    def _runs_splash(self, q, k, is_cross, cache, in_prefix, deterministic) -> bool:
        """Whether `model.attention_implementation="splash"` runs the kernel here: training's
        self-attention (no cache), whose mask is the one `causal`, the window and `segments`
        imply (as Encoder and Decoder build it), without a prefix, global tokens or attention
        dropout, in shapes the kernel takes (`splash.fits`). Elsewhere "auto" runs."""
        cfg = self.config
        return (cfg.attention_implementation == "splash" and not is_cross and cache is None
                and in_prefix is None and not cfg.attention_global_tokens
                and cfg.attention_logit_softcap is None and cfg.attention_scale is None
                and (deterministic or cfg.attention_dropout_rate == 0.0)
                and splash.fits(q, k))


class FeedForward(nn.Module):
    """The position-wise feed-forward network (paper eq. 2) over `layers.feed_forward`."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, *, deterministic=True):
        cfg = self.config
        dtype, d, f = cfg.compute_dtype, cfg.d_model, cfg.d_ff

        def weights(name, shape, axes, use_bias=False):
            return Weights(shape, axes, use_bias=use_bias, lora_branch=True,
                           name=name)(deterministic)

        ff_in, bias_in, in_branch = weights("ff_in", (d, f), ("embed", "mlp"), cfg.use_bias)
        ff_gate = gate_branch = None
        if cfg.activation in layers.GATED:
            ff_gate, _, gate_branch = weights("ff_gate", (d, f), ("embed", "mlp"))
        ff_out, bias_out, out_branch = weights("ff_out", (f, d), ("mlp", "embed"), cfg.use_bias)
        ff_in, ff_gate, ff_out, bias_in, bias_out = jax.tree.map(
            lambda a: a.astype(dtype), (ff_in, ff_gate, ff_out, bias_in, bias_out))
        relu_dropout = 0.0 if deterministic else cfg.relu_dropout_rate
        return layers.feed_forward(
            x.astype(dtype), ff_in, ff_out, ff_gate=ff_gate, bias_in=bias_in, bias_out=bias_out,
            activation=cfg.activation, gelu_approximate=cfg.gelu_approximate,
            dropout_rate=relu_dropout,
            dropout_rng=self.make_rng("dropout") if relu_dropout > 0.0 else None,
            branches=dict(ff_in=in_branch, ff_gate=gate_branch, ff_out=out_branch))


def _feed_forward(cfg: TransformerConfig, routed: bool, x, segments, deterministic: bool):
    """The feed-forward sublayer: `ffn`, or where `routed` the experts (`moe`) plus, with
    `moe_shared_expert`, `ffn` as the expert every token also goes through."""
    if not routed:
        return FeedForward(cfg, name="ffn")(x, deterministic=deterministic)
    y = MixtureOfExperts(cfg, name="moe")(x, segments=segments, deterministic=deterministic)
    if cfg.moe_shared_expert:
        y = y + FeedForward(cfg, name="ffn")(x, deterministic=deterministic).astype(y.dtype)
    return y


def _post_norm(cfg: TransformerConfig, sublayer: str) -> Norm | None:
    """`post_norm_<sublayer>`, the norm of a sublayer's output, where `post_sublayer_norm`."""
    return Norm(cfg, name=f"post_norm_{sublayer}") if cfg.post_sublayer_norm else None


def _pre_norm(x, norm: Norm):
    """A sublayer's input: norm(x) for pre-LN, x otherwise."""
    return norm(x) if norm.config.norm_position == "pre" else x


def _residual(x, y, norm: Norm, deterministic: bool, post: Norm | None = None):
    """x + Dropout(y), normalised after (post-LN) or left as is (pre-LN normalised y's input).
    Y normalised first by `post` where `post_sublayer_norm` (Gemma 2), or by `norm` where
    `norm_position="output"` (OLMo 2)."""
    y = y if post is None else post(y)
    y = norm(y) if norm.config.norm_position == "output" else y
    y = nn.Dropout(norm.config.dropout_rate)(y, deterministic=deterministic)
    x = x + y.astype(x.dtype)
    return norm(x) if norm.config.norm_position == "post" else x


class EncoderBlock(nn.Module):
    """Self-attention and feed-forward sublayers. `__call__(x [B,S,D], mask, positions,
    segments, deterministic, bias) -> (x, None)`, the shape of an `nn.scan` body (as
    `DecoderBlock`'s); `bias` [B, N, S, S]: the self-attention's (`relative_bias`) or None.
    `window`: this layer's local window (None: global); `routed`: its feed-forward is a
    mixture of experts."""

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention
    window: int | None = None
    routed: bool = False

    @nn.compact
    def __call__(self, x, mask, positions, segments=None, deterministic=True, bias=None):
        cfg = self.config
        attend = MultiHeadAttention(cfg, self.attention_fn, use_rope=cfg.positional == "rope",
                                    window=self.window, name="self_attention")
        norm_attention = Norm(cfg, name="norm_attention")
        norm_ffn = Norm(cfg, name="norm_ffn")
        y, _ = attend(_pre_norm(x, norm_attention), mask=mask, q_positions=positions,
                      kv_positions=positions, segments=segments, deterministic=deterministic,
                      bias=bias)
        x = _residual(x, y, norm_attention, deterministic, _post_norm(cfg, "attention"))
        y = _feed_forward(cfg, self.routed, _pre_norm(x, norm_ffn), segments, deterministic)
        x = _residual(x, y, norm_ffn, deterministic, _post_norm(cfg, "ffn"))
        records.sow_residual(self, x, segments)
        return nn.with_logical_constraint(x, ("batch", "length", None)), None


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention (encoder-decoder only) and feed-forward sublayers.

    `__call__(x [B,T,D], encoded [B,S,D] or None, self_mask, cross_mask, positions, segments,
    in_prefix, cache, cache_index, deterministic, bias) -> (x, cache)`; `bias` as
    `EncoderBlock`'s, over the cache's positions when decoding. `window`: this layer's local
    window (None: global); `routed`: its feed-forward is a mixture of experts.
    """

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention
    window: int | None = None
    routed: bool = False

    @nn.compact
    def __call__(self, x, encoded, self_mask, cross_mask, positions, segments=None,
                 in_prefix=None, cache=None, cache_index=None, deterministic=True, bias=None):
        cfg = self.config
        cache = cache or {}
        new_cache = {}
        norm_attention = Norm(cfg, name="norm_attention")
        y, new_cache["self_attention"] = MultiHeadAttention(
            cfg, self.attention_fn, use_rope=cfg.positional == "rope", window=self.window,
            causal=True, name="self_attention")(
            _pre_norm(x, norm_attention), mask=self_mask, q_positions=positions,
            kv_positions=positions, cache=cache.get("self_attention"),
            cache_index=cache_index, segments=segments, in_prefix=in_prefix,
            deterministic=deterministic, bias=bias)
        x = _residual(x, y, norm_attention, deterministic, _post_norm(cfg, "attention"))
        if encoded is not None:
            norm_cross = Norm(cfg, name="norm_cross")
            y, new_cache["cross_attention"] = MultiHeadAttention(
                cfg, self.attention_fn, name="cross_attention")(
                _pre_norm(x, norm_cross), encoded, mask=cross_mask,
                cache=cache.get("cross_attention", {} if cache else None),
                deterministic=deterministic)
            x = _residual(x, y, norm_cross, deterministic, _post_norm(cfg, "cross"))
        norm_ffn = Norm(cfg, name="norm_ffn")
        y = _feed_forward(cfg, self.routed, _pre_norm(x, norm_ffn), segments, deterministic)
        x = _residual(x, y, norm_ffn, deterministic, _post_norm(cfg, "ffn"))
        records.sow_residual(self, x, segments)
        x = nn.with_logical_constraint(x, ("batch", "length", None))
        return x, (new_cache if cache else None)


class RelativeBias(nn.Module):
    """T5's relative position bias (`ops/relative_position.py`): its table `embedding`
    [relative_buckets, N], one per stack, read for every pair of query and key positions."""

    config: TransformerConfig
    bidirectional: bool

    @nn.compact
    def __call__(self, q_positions, k_positions):
        cfg = self.config
        table = self.param("embedding", nn.with_logical_partitioning(
            nn.initializers.normal(cfg.d_model ** -0.5), (None, "heads")),
            (cfg.relative_buckets, cfg.num_heads))
        return relative_position.relative_position_bias(
            table, q_positions, k_positions, bidirectional=self.bidirectional,
            max_distance=cfg.relative_max_distance)


def relative_bias(cfg: TransformerConfig, positions, *, causal: bool,
                  key_length: int | None = None) -> jax.Array | None:
    """The self-attention bias [B, N, T, S] that a stack's layers share, where
    `model.positional="relative"` (else None), as its submodule `relative_bias`: for queries
    at `positions` [B, T] and keys at the same positions, or, decoding, at the cache's
    0..key_length-1. Call it inside the stack's compact module."""
    if cfg.positional != "relative":
        return None
    keys = positions if key_length is None else jnp.arange(key_length)[None]
    return RelativeBias(cfg, bidirectional=not causal, name="relative_bias")(positions, keys)


def pool(encoded: jax.Array, valid: jax.Array, pooling: str) -> jax.Array:
    """encoded [B, S, D], valid [B, S] (False at padding) -> [B, D] float32: the first
    token's state ("cls") or the mean of the valid tokens' states ("gap"; zeros for a row
    with none)."""
    encoded = encoded.astype(jnp.float32)
    if pooling == "cls":
        return encoded[:, 0]
    weights = valid.astype(jnp.float32)
    total = jnp.einsum("BSD,BS->BD", encoded, weights)
    return total / jnp.maximum(weights.sum(axis=1, keepdims=True), 1.0)


class ClassifierHead(nn.Module):
    """pooled [B, D] -> logits [B, num_classes] float32. Kernel and bias start at zero (the
    ViT paper's zero-initialised head), so the first logits are uniform."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, pooled):
        cfg = self.config
        zeros = nn.initializers.zeros
        kernel = self.param("kernel", nn.with_logical_partitioning(zeros, ("embed", "vocab")),
                            (cfg.d_model, cfg.num_classes))
        bias = self.param("bias", nn.with_logical_partitioning(zeros, ("vocab",)),
                          (cfg.num_classes,))
        logits = jnp.einsum("BD,DV->BV", pooled.astype(cfg.compute_dtype),
                            kernel.astype(cfg.compute_dtype),
                            preferred_element_type=jnp.float32)
        return nn.with_logical_constraint(logits + bias, ("batch", None))
