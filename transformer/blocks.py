"""The Transformer's building blocks as Flax Linen modules: parameters with logical axis
names, arithmetic in the pure functions of `attention`, `layers` and `decoding`.

The sublayers (`MultiHeadAttention`, `FeedForward`), each wrapped in a residual connection and
a norm (post-LN as the paper, or pre-LN), make the encoder and decoder layers (`EncoderBlock`,
`DecoderBlock`) that `model` stacks. Shapes are written in the package's legend
(`transformer/__init__.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import attention, decoding, layers
from transformer.model_config import TransformerConfig


class Weights(nn.Module):
    """A kernel (and optionally a bias) with logical axis names, returned as arrays.

    The pure functions do the arithmetic; this module only owns the parameters, so paths read
    `<name>/kernel` and `<name>/bias` as in Flax's Dense layers.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    num_in_axes: int = 1
    use_bias: bool = True

    @nn.compact
    def __call__(self):
        in_axes = tuple(range(self.num_in_axes))
        out_axes = tuple(range(self.num_in_axes, len(self.shape)))
        init = nn.initializers.xavier_uniform(in_axis=in_axes, out_axis=out_axes)
        kernel = self.param("kernel", nn.with_logical_partitioning(init, self.axes), self.shape)
        if not self.use_bias:
            return kernel, None
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros,
                                                 self.axes[self.num_in_axes:])
        bias = self.param("bias", bias_init, self.shape[self.num_in_axes:])
        return kernel, bias


class Norm(nn.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale) over D."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        d = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (d,))
        if cfg.norm == "rms_norm":
            return layers.rms_norm(x, scale, eps=cfg.norm_eps)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                          (d,))
        return layers.layer_norm(x, scale, bias, eps=cfg.norm_eps)


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query, multi-query) attention, self or cross (paper section 3.2.2).

    `__call__(x [B,T,D], kv_inputs [B,S,D] or None for self-attention, ...) -> (y [B,T,D],
    cache)`. With a cache, self-attention writes the new keys/values at `cache_index` and
    attends over the whole cache; cross-attention projects `kv_inputs` once and reuses them.
    Applied with `mutable=["intermediates"]`, it also records its attention weights [B,N,T,S]
    (`attention.attention_weights`, the softmax the "xla" implementation multiplies V with) as
    `intermediates/.../attention_weights` (the plots of `transformer.visualize`).
    """

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention
    use_rope: bool = False

    @nn.compact
    def __call__(self, x, kv_inputs=None, *, mask=None, q_positions=None, kv_positions=None,
                 cache=None, cache_index=None, deterministic=True):
        cfg = self.config
        dtype = cfg.compute_dtype
        d, n, kh, h, hv = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v
        is_cross = kv_inputs is not None

        def project(name, spec, inputs, shape, axes, num_in_axes=1):
            kernel, bias = Weights(shape, axes, num_in_axes=num_in_axes, use_bias=cfg.use_bias,
                                   name=name)()
            y = jnp.einsum(spec, inputs.astype(dtype), kernel.astype(dtype))
            return y if bias is None else y + bias.astype(dtype)

        q = project("query", "BTD,DNH->BTNH", x, (d, n, h), ("embed", "heads", "head_dim"))
        if is_cross and cache is not None and cache.get("key") is not None:
            k, v = cache["key"], cache["value"]  # encoder keys/values projected once
        else:
            source = kv_inputs if is_cross else x
            k = project("key", "BSD,DKH->BSKH", source, (d, kh, h),
                        ("embed", "kv_heads", "head_dim"))
            v = project("value", "BSD,DKE->BSKE", source, (d, kh, hv),
                        ("embed", "kv_heads", "head_dim"))
        if self.use_rope:
            q = layers.apply_rope(q, q_positions)
            k = layers.apply_rope(k, kv_positions)
        if cache is not None:
            cache = ({"key": k, "value": v} if is_cross
                     else decoding.write_cache(cache, k, v, cache_index))
            k, v = cache["key"], cache["value"]
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        dropout_rng = None
        if not deterministic and cfg.attention_dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        y = self.attention_fn(q, k, v, mask=mask,
                              dropout_rate=0.0 if deterministic else cfg.attention_dropout_rate,
                              dropout_rng=dropout_rng)
        if self.is_mutable_collection("intermediates"):  # asked for: apply(mutable=[...])
            self.sow("intermediates", "attention_weights",
                     attention.attention_weights(q, k, mask=mask))
        out = project("out", "BTNE,NED->BTD", y, (n, hv, d), ("heads", "head_dim", "embed"),
                      num_in_axes=2)
        return out, cache


class FeedForward(nn.Module):
    """The position-wise feed-forward network (paper eq. 2) over `layers.feed_forward`."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, *, deterministic=True):
        cfg = self.config
        dtype = cfg.compute_dtype
        d, f = cfg.d_model, cfg.d_ff
        ff_in, bias_in = Weights((d, f), ("embed", "mlp"), use_bias=cfg.use_bias, name="ff_in")()
        ff_gate = None
        if cfg.activation == "swiglu":
            ff_gate, _ = Weights((d, f), ("embed", "mlp"), use_bias=False, name="ff_gate")()
        ff_out, bias_out = Weights((f, d), ("mlp", "embed"), use_bias=cfg.use_bias,
                                   name="ff_out")()
        ff_in, ff_gate, ff_out, bias_in, bias_out = jax.tree.map(
            lambda a: a.astype(dtype), (ff_in, ff_gate, ff_out, bias_in, bias_out))
        relu_dropout = 0.0 if deterministic else cfg.relu_dropout_rate
        return layers.feed_forward(
            x.astype(dtype), ff_in, ff_out, ff_gate=ff_gate, bias_in=bias_in, bias_out=bias_out,
            activation=cfg.activation, dropout_rate=relu_dropout,
            dropout_rng=self.make_rng("dropout") if relu_dropout > 0.0 else None)


def _pre_norm(x, norm: Norm):
    """A sublayer's input: norm(x) for pre-LN, x for post-LN."""
    return norm(x) if norm.config.norm_position == "pre" else x


def _residual(x, y, norm: Norm, deterministic: bool):
    """x + Dropout(y), normalised after (post-LN) or left as is (pre-LN normalised y's input)."""
    y = nn.Dropout(norm.config.dropout_rate)(y, deterministic=deterministic)
    x = x + y.astype(x.dtype)
    return norm(x) if norm.config.norm_position == "post" else x


class EncoderBlock(nn.Module):
    """Self-attention and feed-forward sublayers. `__call__(x [B,S,D], mask, positions,
    deterministic) -> (x, None)`, the shape of an `nn.scan` body (as `DecoderBlock`'s)."""

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention

    @nn.compact
    def __call__(self, x, mask, positions, deterministic=True):
        cfg = self.config
        attend = MultiHeadAttention(cfg, self.attention_fn, use_rope=cfg.positional == "rope",
                                    name="self_attention")
        norm_attention, norm_ffn = Norm(cfg, name="norm_attention"), Norm(cfg, name="norm_ffn")
        y, _ = attend(_pre_norm(x, norm_attention), mask=mask, q_positions=positions,
                      kv_positions=positions, deterministic=deterministic)
        x = _residual(x, y, norm_attention, deterministic)
        y = FeedForward(cfg, name="ffn")(_pre_norm(x, norm_ffn), deterministic=deterministic)
        x = _residual(x, y, norm_ffn, deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", None)), None


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention (encoder-decoder only) and feed-forward sublayers.

    `__call__(x [B,T,D], encoded [B,S,D] or None, self_mask, cross_mask, positions, cache,
    cache_index, deterministic) -> (x, cache)`.
    """

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention

    @nn.compact
    def __call__(self, x, encoded, self_mask, cross_mask, positions, cache=None,
                 cache_index=None, deterministic=True):
        cfg = self.config
        cache = cache or {}
        new_cache = {}
        norm_attention = Norm(cfg, name="norm_attention")
        y, new_cache["self_attention"] = MultiHeadAttention(
            cfg, self.attention_fn, use_rope=cfg.positional == "rope", name="self_attention")(
            _pre_norm(x, norm_attention), mask=self_mask, q_positions=positions,
            kv_positions=positions, cache=cache.get("self_attention"),
            cache_index=cache_index, deterministic=deterministic)
        x = _residual(x, y, norm_attention, deterministic)
        if encoded is not None:
            norm_cross = Norm(cfg, name="norm_cross")
            y, new_cache["cross_attention"] = MultiHeadAttention(
                cfg, self.attention_fn, name="cross_attention")(
                _pre_norm(x, norm_cross), encoded, mask=cross_mask,
                cache=cache.get("cross_attention", {} if cache else None),
                deterministic=deterministic)
            x = _residual(x, y, norm_cross, deterministic)
        norm_ffn = Norm(cfg, name="norm_ffn")
        y = FeedForward(cfg, name="ffn")(_pre_norm(x, norm_ffn), deterministic=deterministic)
        x = _residual(x, y, norm_ffn, deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", None))
        return x, (new_cache if cache else None)
