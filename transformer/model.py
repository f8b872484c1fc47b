"""The Transformer as thin Flax Linen modules over the pure functions of `attention` and `layers`.

Shape legend: B batch, T target length, S source length, N query heads, K kv heads, H head dim
(d_k), Hv value head dim (d_v), D d_model, F d_ff, V vocab, L layers.

Every parameter carries logical axis names (`sharding.py` maps them onto the mesh). Parameter
paths are a contract (DESIGN.md): `embedding/embedding`, `encoder/layers_{i}/self_attention/
query/kernel`, ... With `scan_layers` the layers are one `layers` subtree with a leading L axis.

Runtime mode is the keyword `deterministic=`. Incremental decoding passes an explicit cache
pytree (`init_cache`) to `Transformer.decode(..., cache=)` and gets the updated cache back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import attention, layers

ARCHITECTURES = ("encoder_decoder", "encoder", "decoder")
POSITIONALS = ("sinusoidal", "learned", "rope", "none")
NORMS = ("layer_norm", "rms_norm")
NORM_POSITIONS = ("post", "pre")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
BOS_ID = 2  # the decoder's start token (DESIGN.md: pad 0, unk 1, bos 2, eos 3)

Cache = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters; the defaults are the paper's base model (Table 3, first row)."""

    architecture: str = "encoder_decoder"
    vocab_size: int = 37000
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    num_kv_heads: int | None = None  # None: num_heads (multi-head); 1: multi-query
    d_k: int | None = None  # None: d_model // num_heads
    d_v: int | None = None  # None: d_k
    dropout_rate: float = 0.1  # P_drop: residual and embedding dropout
    attention_dropout_rate: float = 0.0
    relu_dropout_rate: float = 0.0
    positional: str = "sinusoidal"
    norm: str = "layer_norm"
    norm_position: str = "post"  # post: LayerNorm(x + Dropout(Sublayer(x))), as the paper
    activation: str = "relu"
    use_bias: bool = True
    share_embeddings: bool = True  # source embedding = target embedding
    tie_output_embedding: bool = True  # pre-softmax projection = target embedding
    max_len: int = 512
    dtype: str = "float32"  # compute dtype; parameters are always float32
    scan_layers: bool = False
    remat_policy: str = "none"
    attention_implementation: str = "auto"
    norm_eps: float = 1e-6

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        if self.num_kv_heads is None:
            set_("num_kv_heads", self.num_heads)
        if self.d_k is None:
            if self.num_heads < 1 or self.d_model % self.num_heads:
                raise ValueError(f"model.num_heads={self.num_heads} does not divide "
                                 f"d_model={self.d_model}; change it or set model.d_k")
            set_("d_k", self.d_model // self.num_heads)
        if self.d_v is None:
            set_("d_v", self.d_k)
        for field, choices in (("architecture", ARCHITECTURES), ("positional", POSITIONALS),
                               ("norm", NORMS), ("norm_position", NORM_POSITIONS),
                               ("activation", layers.ACTIVATIONS),
                               ("remat_policy", tuple(REMAT_POLICIES)),
                               ("attention_implementation", attention.IMPLEMENTATIONS)):
            if getattr(self, field) not in choices:
                raise ValueError(f"model.{field}={getattr(self, field)!r} is not one of "
                                 f"{', '.join(choices)}")
        for field in ("vocab_size", "d_model", "d_ff", "num_heads", "num_kv_heads", "d_k",
                      "d_v", "max_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"model.{field}={getattr(self, field)} must be positive")
        for field in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"model.{field}={getattr(self, field)} must be in [0, 1)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} does not divide "
                             f"num_heads={self.num_heads}")
        if self.positional == "rope" and self.d_k % 2:
            raise ValueError(f"model.positional='rope' needs an even d_k, got {self.d_k}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"model.positional='sinusoidal' needs an even d_model, "
                             f"got {self.d_model}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype={self.dtype!r} is not one of float32, bfloat16, "
                             f"float16")
        if self.architecture == "encoder_decoder" and min(self.num_encoder_layers,
                                                         self.num_decoder_layers) < 1:
            raise ValueError("model.num_encoder_layers and num_decoder_layers must be >= 1")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_dict(cls, values) -> TransformerConfig:
        """From a mapping such as `config.model`; unknown keys are an error naming them."""
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**values)


# --------------------------------------------------------------------------- building blocks

_dense_init = nn.initializers.xavier_uniform


class Weights(nn.Module):
    """A kernel (and optionally a bias) with logical axis names, returned as arrays.

    The pure functions do the arithmetic; this module only owns the parameters, so paths read
    `<name>/kernel` and `<name>/bias` as in Flax's Dense layers.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    num_in_axes: int = 1
    use_bias: bool = True
    bias_axes: tuple[str, ...] | None = None  # default: the output axes

    @nn.compact
    def __call__(self):
        in_axes = tuple(range(self.num_in_axes))
        out_axes = tuple(range(self.num_in_axes, len(self.shape)))
        init = _dense_init(in_axis=in_axes, out_axis=out_axes)
        kernel = self.param("kernel", nn.with_logical_partitioning(init, self.axes), self.shape)
        if not self.use_bias:
            return kernel, None
        bias_shape = self.shape[self.num_in_axes:]
        bias_axes = self.bias_axes or self.axes[self.num_in_axes:]
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, bias_axes),
                          bias_shape)
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


def _activation_constraint(x, names):
    return nn.with_logical_constraint(x, names)


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

        def project(name, inputs, shape, axes):
            kernel, bias = Weights(shape, axes, use_bias=cfg.use_bias, name=name)()
            y = jnp.einsum("bsd,dkh->bskh", inputs.astype(dtype), kernel.astype(dtype))
            return y if bias is None else y + bias.astype(dtype)

        q = project("query", x, (d, n, h), ("embed", "heads", "head_dim"))
        if is_cross and cache is not None and cache.get("key") is not None:
            k, v = cache["key"], cache["value"]  # encoder keys/values projected once
        else:
            source = kv_inputs if is_cross else x
            k = project("key", source, (d, kh, h), ("embed", "kv_heads", "head_dim"))
            v = project("value", source, (d, kh, hv), ("embed", "kv_heads", "head_dim"))
        if self.use_rope:
            q = layers.apply_rope(q, q_positions)
            k = layers.apply_rope(k, kv_positions)
        if cache is not None:
            if is_cross:
                cache = {"key": k, "value": v}
            else:
                start = (0, cache_index, 0, 0)
                k = jax.lax.dynamic_update_slice(cache["key"], k.astype(cache["key"].dtype),
                                                 start)
                v = jax.lax.dynamic_update_slice(cache["value"],
                                                 v.astype(cache["value"].dtype), start)
                cache = {"key": k, "value": v}
        q = _activation_constraint(q, ("batch", "length", "heads", "head_dim"))
        dropout_rng = None
        if not deterministic and cfg.attention_dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        y = self.attention_fn(q, k, v, mask=mask,
                              dropout_rate=0.0 if deterministic else cfg.attention_dropout_rate,
                              dropout_rng=dropout_rng)
        if self.is_mutable_collection("intermediates"):  # asked for: apply(mutable=[...])
            self.sow("intermediates", "attention_weights",
                     attention.attention_weights(q, k, mask=mask))
        kernel, bias = Weights((n, hv, d), ("heads", "head_dim", "embed"), num_in_axes=2,
                               use_bias=cfg.use_bias, name="out")()
        out = jnp.einsum("btnh,nhd->btd", y.astype(dtype), kernel.astype(dtype))
        if bias is not None:
            out = out + bias.astype(dtype)
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


def _residual(module: nn.Module, x, y, norm: Norm, deterministic: bool):
    """x + Dropout(y), normalised after (post-LN) or left as is (pre-LN normalised y's input)."""
    cfg = module.config
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    x = x + y.astype(x.dtype)
    return norm(x) if cfg.norm_position == "post" else x


def _pre_norm(module: nn.Module, x, norm: Norm):
    return norm(x) if module.config.norm_position == "pre" else x


class EncoderBlock(nn.Module):
    """Self-attention and feed-forward sublayers. `__call__(x [B,S,D], mask, positions,
    deterministic) -> x` (or `(x, None)` as an `nn.scan` body)."""

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention

    @nn.compact
    def __call__(self, x, mask, positions, deterministic=True):
        cfg = self.config
        attend = MultiHeadAttention(cfg, self.attention_fn, use_rope=cfg.positional == "rope",
                                    name="self_attention")
        norm_attention, norm_ffn = Norm(cfg, name="norm_attention"), Norm(cfg, name="norm_ffn")
        y, _ = attend(_pre_norm(self, x, norm_attention), mask=mask, q_positions=positions,
                      kv_positions=positions, deterministic=deterministic)
        x = _residual(self, x, y, norm_attention, deterministic)
        y = FeedForward(cfg, name="ffn")(_pre_norm(self, x, norm_ffn), deterministic=deterministic)
        x = _residual(self, x, y, norm_ffn, deterministic)
        x = _activation_constraint(x, ("batch", "length", None))
        return (x, None) if cfg.scan_layers else x


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
            _pre_norm(self, x, norm_attention), mask=self_mask, q_positions=positions,
            kv_positions=positions, cache=cache.get("self_attention"),
            cache_index=cache_index, deterministic=deterministic)
        x = _residual(self, x, y, norm_attention, deterministic)
        if encoded is not None:
            norm_cross = Norm(cfg, name="norm_cross")
            y, new_cache["cross_attention"] = MultiHeadAttention(
                cfg, self.attention_fn, name="cross_attention")(
                _pre_norm(self, x, norm_cross), encoded, mask=cross_mask,
                cache=cache.get("cross_attention", {} if cache else None),
                deterministic=deterministic)
            x = _residual(self, x, y, norm_cross, deterministic)
        norm_ffn = Norm(cfg, name="norm_ffn")
        y = FeedForward(cfg, name="ffn")(_pre_norm(self, x, norm_ffn), deterministic=deterministic)
        x = _residual(self, x, y, norm_ffn, deterministic)
        x = _activation_constraint(x, ("batch", "length", None))
        return x, (new_cache if cache else None)



# --------------------------------------------------------------------------- stacks


def _stack(block: type[nn.Module], cfg: TransformerConfig, num_layers: int,
           deterministic_argnum: int, scan_in_axes: tuple):
    """The block class, rematerialised and/or scanned over a leading L axis as configured.

    Returns a function `(name_or_index) -> module`; with `scan_layers` there is one module
    named `layers` whose call runs all L blocks.
    """
    if cfg.remat_policy != "none":
        block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy],
                         prevent_cse=not cfg.scan_layers,
                         static_argnums=(deterministic_argnum,))
    if cfg.scan_layers:
        block = nn.scan(block, variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, in_axes=scan_in_axes,
                        length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return block


def _positions(tokens: jax.Array, positions: jax.Array | None, offset=0) -> jax.Array:
    """[B, T] positions: given (packed rows), or offset + 0..T-1."""
    if positions is not None:
        return positions
    b, t = tokens.shape
    return jnp.broadcast_to(offset + jnp.arange(t), (b, t))


class _Embedder(nn.Module):
    """Token embedding times sqrt(D), plus positions, then dropout (paper section 3.4, 3.5)."""

    config: TransformerConfig
    embedding: nn.Module

    @nn.compact
    def __call__(self, tokens, positions, deterministic):
        cfg = self.config
        x = self.embedding(tokens).astype(cfg.compute_dtype) * jnp.sqrt(cfg.d_model).astype(
            cfg.compute_dtype)
        if cfg.positional == "sinusoidal":
            table = layers.sinusoidal_position_encoding(cfg.max_len, cfg.d_model)
            x = x + table[positions].astype(x.dtype)
        elif cfg.positional == "learned":
            x = x + nn.Embed(cfg.max_len, cfg.d_model, dtype=cfg.compute_dtype,
                             embedding_init=nn.with_logical_partitioning(
                                 nn.initializers.normal(0.02), ("length", "embed")),
                             name="position_embedding")(positions)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        return _activation_constraint(x, ("batch", "length", None))


def _check_length(cfg: TransformerConfig, length: int, what: str):
    if cfg.positional in ("sinusoidal", "learned") and length > cfg.max_len:
        raise ValueError(f"{what} length {length} exceeds model.max_len={cfg.max_len}")


class Encoder(nn.Module):
    """N encoder blocks over embedded source tokens: inputs [B, S] -> encoded [B, S, D]."""

    config: TransformerConfig
    embedding: nn.Module
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention

    @nn.compact
    def __call__(self, inputs, *, inputs_positions=None, inputs_segmentation=None,
                 deterministic=True):
        cfg = self.config
        _check_length(cfg, inputs.shape[1], "source")
        positions = _positions(inputs, inputs_positions)
        x = _Embedder(cfg, self.embedding, name="embedder")(inputs, positions, deterministic)
        if inputs_segmentation is not None:
            mask = attention.make_segment_mask(inputs_segmentation, inputs_segmentation)
        else:
            mask = attention.make_padding_mask(inputs != 0, inputs != 0)
        block = _stack(EncoderBlock, cfg, cfg.num_encoder_layers, 4,
                       (nn.broadcast, nn.broadcast, nn.broadcast))
        if cfg.scan_layers:
            x, _ = block(cfg, self.attention_fn, name="layers")(x, mask, positions, deterministic)
        else:
            for i in range(cfg.num_encoder_layers):
                x = block(cfg, self.attention_fn, name=f"layers_{i}")(x, mask, positions,
                                                                        deterministic)
        if cfg.norm_position == "pre":
            x = Norm(cfg, name="norm")(x)
        return x


class OutputHead(NamedTuple):
    """The final hidden states and the output projection, unapplied: for a loss that projects
    a chunk at a time (`optim.projected_cross_entropy_loss`) instead of holding [B, T, V]."""

    hidden: jax.Array  # [B, T, D], compute dtype
    kernel: jax.Array  # [V, D] (tied to the embedding, vocab_axis 0) or [D, V] (vocab_axis 1)
    vocab_axis: int

    def logits(self) -> jax.Array:
        """[B, T, V] in the compute dtype."""
        spec = "btd,vd->btv" if self.vocab_axis == 0 else "btd,dv->btv"
        logits = jnp.einsum(spec, self.hidden.astype(self.kernel.dtype), self.kernel)
        return _activation_constraint(logits, ("batch", "length", "vocab"))


def _tied_output_head(cfg: TransformerConfig, embedding: nn.Embed, x) -> OutputHead:
    """x [B, T, D] and the embedding [V, D] as the output projection (pre-softmax = target
    embedding), both in the compute dtype."""
    return OutputHead(x.astype(cfg.compute_dtype), embedding.embedding.astype(cfg.compute_dtype),
                      0)


class Decoder(nn.Module):
    """N decoder blocks and the output projection: decoder input tokens [B, T] -> logits
    [B, T, V] (`project=False`: an `OutputHead`). Masks come from `Transformer.decode`."""

    config: TransformerConfig
    embedding: nn.Module
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention

    @nn.compact
    def __call__(self, tokens, encoded, self_mask, cross_mask, positions, *, cache=None,
                 deterministic=True, project=True):
        cfg = self.config
        x = _Embedder(cfg, self.embedding, name="embedder")(tokens, positions, deterministic)
        index = None if cache is None else cache["index"]
        block = _stack(DecoderBlock, cfg, cfg.num_decoder_layers, 8,
                       (nn.broadcast,) * 4 + (0, nn.broadcast, nn.broadcast))
        new_cache = None if cache is None else {"index": index + tokens.shape[1]}
        if cfg.scan_layers:
            x, layer_cache = block(cfg, self.attention_fn, name="layers")(
                x, encoded, self_mask, cross_mask, positions,
                None if cache is None else cache["layers"], index, deterministic)
            if cache is not None:
                new_cache["layers"] = layer_cache
        else:
            for i in range(cfg.num_decoder_layers):
                name = f"layers_{i}"
                x, layer_cache = block(cfg, self.attention_fn, name=name)(
                    x, encoded, self_mask, cross_mask, positions,
                    None if cache is None else cache[name], index, deterministic)
                if cache is not None:
                    new_cache[name] = layer_cache
        if cfg.norm_position == "pre":
            x = Norm(cfg, name="norm")(x)
        if cfg.tie_output_embedding:
            head = _tied_output_head(cfg, self.embedding, x)
        else:
            kernel, _ = Weights((cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                use_bias=False, name="logits")()
            head = OutputHead(x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype), 1)
        return (head if not project else head.logits()), new_cache


def shift_right(targets: jax.Array, segmentation: jax.Array | None = None) -> jax.Array:
    """Decoder inputs [B, T]: targets shifted right by one, BOS first (and at every packed
    segment's start), so position t sees targets < t (teacher forcing)."""
    shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=BOS_ID)[:, :-1]
    if segmentation is None:
        return shifted
    previous = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(segmentation != previous, BOS_ID, shifted)


def prefix_inputs(targets_prefix: jax.Array, segmentation: jax.Array | None = None) -> jax.Array:
    """[B, T] bool: the decoder inputs that belong to a prefix LM's prefix, from the targets
    that do (`targets_prefix` [B, T]): each segment's BOS and the inputs that are prefix
    targets shifted right. (`shift_right` puts BOS, nonzero, at every segment start.)"""
    return shift_right(targets_prefix.astype(jnp.int32), segmentation) != 0


# --------------------------------------------------------------------------- the model


class Transformer(nn.Module):
    """Encoder-decoder (the paper), encoder-only or decoder-only Transformer.

    `__call__(inputs [B,S], targets [B,T]) -> logits [B,T,V]` (teacher forcing: the decoder
    reads `targets` shifted right). Encoder-only returns [B,S,V] from `inputs`; decoder-only
    models `targets` (inputs may be None). `project=False` returns an `OutputHead` (hidden
    states and output kernel) instead of the logits, for a loss that projects by chunks.
    Token id 0 is padding; packed rows pass positions and segment ids (0 = padding).
    """

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] | None = None  # default: dot_product_attention

    def setup(self):
        cfg = self.config
        attention_fn = self.attention_fn or functools.partial(
            attention.dot_product_attention, implementation=cfg.attention_implementation)

        def embed():
            init = nn.initializers.normal(stddev=cfg.d_model ** -0.5)
            return nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
                            embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))

        self.embedding = embed()
        source_embedding = self.embedding
        if cfg.architecture == "encoder_decoder" and not cfg.share_embeddings:
            self.source_embedding = source_embedding = embed()
        if cfg.architecture != "decoder":
            self.encoder = Encoder(cfg, source_embedding, attention_fn)
        if cfg.architecture != "encoder":
            self.decoder = Decoder(cfg, self.embedding, attention_fn)

    def encode(self, inputs, *, inputs_positions=None, inputs_segmentation=None,
               deterministic=True):
        """inputs [B, S] -> encoded [B, S, D]."""
        return self.encoder(inputs, inputs_positions=inputs_positions,
                            inputs_segmentation=inputs_segmentation, deterministic=deterministic)

    def decode(self, encoded, inputs, targets, *, targets_positions=None,
               inputs_segmentation=None, targets_segmentation=None, targets_prefix=None,
               cache=None, deterministic=True, project=True):
        """Logits [B, T, V] of the next tokens (`project=False`: an `OutputHead`).

        Training (cache None): `targets` [B, T] are shifted right inside. Incremental decoding:
        `targets` [B, t] are the decoder's input tokens for positions index..index+t-1 (BOS
        first); returns (logits, updated cache). `encoded`/`inputs` are None for decoder-only.

        Prefix LM (decoder-only): `targets_prefix` [B, T] marks the targets that belong to the
        prefix (nonzero); the decoder inputs of the prefix (BOS and the prefix tokens) attend to
        each other in both directions, the rest causally. With a cache it marks the decoder
        input tokens of this call that form the prefix (a prompt prefilled in one call).
        """
        cfg = self.config
        if cache is None:
            _check_length(cfg, targets.shape[1], "target")
            tokens = shift_right(targets, targets_segmentation)
            positions = _positions(targets, targets_positions)
            causal = (attention.make_causal_mask(targets.shape[1]) if targets_prefix is None
                      else attention.make_prefix_lm_mask(
                          prefix_inputs(targets_prefix, targets_segmentation)))
            self_mask = attention.combine_masks(
                causal,
                attention.make_segment_mask(targets_segmentation, targets_segmentation)
                if targets_segmentation is not None
                else attention.make_padding_mask(targets != 0, targets != 0))
            q_valid = targets_segmentation if targets_segmentation is not None else targets
        else:
            tokens = targets
            positions = _positions(targets, None, offset=cache["index"])
            max_length = jax.tree.leaves(cache["layers" if cfg.scan_layers else "layers_0"]
                                         ["self_attention"])[0].shape[-3]
            self_mask = (jnp.arange(max_length)[None, :] <= positions[0][:, None])[None, None]
            if targets_prefix is not None:
                in_prefix = targets_prefix.astype(jnp.bool_)
                key_in_prefix = jax.lax.dynamic_update_slice(
                    jnp.zeros((targets.shape[0], max_length), jnp.bool_), in_prefix,
                    (0, cache["index"]))
                self_mask = self_mask | (in_prefix[:, None, :, None]
                                         & key_in_prefix[:, None, None, :])
            q_valid = jnp.ones_like(targets)
        cross_mask = None
        if encoded is not None:
            if inputs_segmentation is not None and cache is None:
                cross_mask = attention.make_segment_mask(targets_segmentation,
                                                         inputs_segmentation)
            else:
                cross_mask = attention.make_padding_mask(q_valid != 0, inputs != 0)
        logits, new_cache = self.decoder(tokens, encoded, self_mask, cross_mask, positions,
                                         cache=cache, deterministic=deterministic,
                                         project=project)
        return logits if cache is None else (logits, new_cache)

    def __call__(self, inputs, targets, *, inputs_positions=None, targets_positions=None,
                 inputs_segmentation=None, targets_segmentation=None, targets_prefix=None,
                 deterministic=True, project=True):
        cfg = self.config
        if cfg.architecture == "encoder":
            encoded = self.encode(inputs, inputs_positions=inputs_positions,
                                  inputs_segmentation=inputs_segmentation,
                                  deterministic=deterministic)
            head = _tied_output_head(cfg, self.embedding, encoded)
            return head.logits() if project else head
        encoded = None
        if cfg.architecture == "encoder_decoder":
            encoded = self.encode(inputs, inputs_positions=inputs_positions,
                                  inputs_segmentation=inputs_segmentation,
                                  deterministic=deterministic)
        return self.decode(encoded, inputs, targets, targets_positions=targets_positions,
                           inputs_segmentation=inputs_segmentation,
                           targets_segmentation=targets_segmentation,
                           targets_prefix=targets_prefix, deterministic=deterministic,
                           project=project)


def init_cache(config: TransformerConfig, batch_size: int, max_length: int) -> Cache:
    """An empty decoding cache: per decoder layer the self-attention keys [B, max_length, K, H]
    and values [B, max_length, K, Hv] in the compute dtype, an empty cross-attention entry
    (filled with the projected encoder output by the first `decode` call), and `index`, the
    number of positions written."""
    if config.positional in ("sinusoidal", "learned") and max_length > config.max_len:
        raise ValueError(f"decode length {max_length} exceeds model.max_len={config.max_len}")
    dtype = config.compute_dtype
    lead = (config.num_decoder_layers,) if config.scan_layers else ()

    def layer():
        entry = {"self_attention": {
            "key": jnp.zeros(lead + (batch_size, max_length, config.num_kv_heads, config.d_k),
                             dtype),
            "value": jnp.zeros(lead + (batch_size, max_length, config.num_kv_heads,
                                       config.d_v), dtype)}}
        if config.architecture == "encoder_decoder":
            entry["cross_attention"] = {}
        return entry

    cache: Cache = {"index": jnp.zeros((), jnp.int32)}
    if config.scan_layers:
        cache["layers"] = layer()
    else:
        cache.update({f"layers_{i}": layer() for i in range(config.num_decoder_layers)})
    return cache
