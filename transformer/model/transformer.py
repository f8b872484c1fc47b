"""The Transformer (encoder-decoder, encoder-only, decoder-only) as Flax Linen modules: the
embeddings, the stacks of `blocks` (scanned and rematerialised as configured), the output
projection and the decoding cache. Shapes are written in the package's legend
(`transformer/__init__.py`). The hyperparameters are a `TransformerConfig` (`model/config.py`).

Every parameter carries logical axis names (`parallel/sharding.py` maps them onto the mesh).
Its path is a contract (docs/architecture.md; with `scan_layers` one `layers` subtree, L first).

`Transformer(inputs, targets)` returns the logits; `Transformer.output_head` the final hidden
states and the output projection unapplied (`OutputHead`). Architecture "classifier" is the
encoder (the same parameter paths as "encoder", so a masked LM's weights load into it) plus
`head` (`ClassifierHead`): `Transformer.classify(inputs)` -> class logits [B, num_classes].
Runtime mode is the keyword `deterministic=`. `Transformer.decode(..., cache=)` returns
`(logits, cache)`: incremental decoding passes an explicit cache pytree (`init_cache`) and gets
the updated cache back.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.data.tokenizer import BOS_ID
from transformer.model import pipelined
from transformer.model.blocks import (
    ClassifierHead,
    DecoderBlock,
    EncoderBlock,
    Norm,
    Weights,
    pool,
    relative_bias,
)
from transformer.model.config import REMAT_POLICIES, TransformerConfig
from transformer.model.experts import COLLECTION
from transformer.model.records import HEALTH
from transformer.ops import attention, layers, linear_attention, masks, ring

Cache = dict[str, Any]


# --------------------------------------------------------------------------- stacks


def layer_stack(block: type[nn.Module], cfg: TransformerConfig, num_layers: int, *,
                per_layer_args: tuple[str, ...] = ()) -> type[nn.Module]:
    """The block class, rematerialised and/or scanned over a leading L axis as configured.

    Its call is `(x, *args) -> (x, per-layer output)` with every argument positional;
    `deterministic` is static under remat. Scanned, the arguments named in `per_layer_args`
    have a leading L axis (one slice per layer). The others are the same for every layer.
    """
    args = list(inspect.signature(block.__call__).parameters)[2:]  # after self and x
    if cfg.remat_policy != "none":
        block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy],
                         prevent_cse=not cfg.scan_layers,
                         static_argnums=(2 + args.index("deterministic"),))  # self is 0
    if cfg.scan_layers:
        in_axes = tuple(0 if arg in per_layer_args else nn.broadcast for arg in args)
        block = nn.scan(block, variable_axes={"params": 0, COLLECTION: 0, HEALTH: 0},
                        split_rngs={"params": True, "dropout": True}, in_axes=in_axes,
                        length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return block


def _layers(cfg: TransformerConfig, num_layers: int) -> list[tuple[str, int | None]]:
    """(subtree name, local window or None) of each layer: `layers` (scanned, all L at once,
    one window) or `layers_0` .. `layers_{L-1}`."""
    names = ["layers"] if cfg.scan_layers else [f"layers_{i}" for i in range(num_layers)]
    return [(name, cfg.layer_window(i)) for i, name in enumerate(names)]


def encoder_stack(module: nn.Module, x, mask, positions, segments, deterministic) -> jax.Array:
    """x [B, S, D] through the `num_encoder_layers` encoder blocks, then pre-LN's final norm,
    inside the compact call of `module` (the Encoder, the ViT's encoder), whose submodules they
    become. With mesh.stage > 1 the scanned layers run as one pipeline (`pipelined`)."""
    cfg = module.config
    block = layer_stack(EncoderBlock, cfg, cfg.num_encoder_layers)
    bias = relative_bias(cfg, positions, causal=False)
    stages = pipelined.applies(module, None)
    if stages:
        x = pipelined.stack_layers(module, functools.partial(layer_stack, EncoderBlock, cfg), x,
                                   (mask, positions, segments), deterministic, bias,
                                   layers=cfg.num_encoder_layers)
    for i, (name, window) in enumerate([] if stages else
                                       _layers(cfg, cfg.num_encoder_layers)):
        x, _ = block(cfg, module.attention_fn, window, cfg.routed(i), name=name)(
            x, mask, positions, segments, deterministic, bias)
    if cfg.norm_position != "post":
        x = Norm(cfg, name="norm")(x)
    return x


def _positions(tokens: jax.Array, positions: jax.Array | None, offset=0) -> jax.Array:
    """[B, T] positions: given (packed rows), or offset + 0..T-1."""
    if positions is not None:
        return positions
    b, t = tokens.shape
    return jnp.broadcast_to(offset + jnp.arange(t), (b, t))


class _Embedder(nn.Module):
    """Token embedding times sqrt(D) (unless `scale_embeddings` is off), plus positions, then
    dropout (paper section 3.4, 3.5)."""

    config: TransformerConfig
    embedding: nn.Module

    @nn.compact
    def __call__(self, tokens, positions, deterministic):
        cfg = self.config
        x = self.embedding(tokens).astype(cfg.compute_dtype)
        if cfg.scale_embeddings:
            x = x * jnp.sqrt(cfg.d_model).astype(cfg.compute_dtype)
        if cfg.positional == "sinusoidal":
            table = layers.sinusoidal_position_encoding(cfg.max_len, cfg.d_model)
            x = x + table[positions].astype(x.dtype)
        elif cfg.positional == "learned":
            x = x + nn.Embed(cfg.max_len, cfg.d_model, dtype=cfg.compute_dtype,
                             embedding_init=nn.with_logical_partitioning(
                                 nn.initializers.normal(0.02), ("length", "embed")),
                             name="position_embedding")(positions)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", None))


def _check_length(cfg: TransformerConfig, length: int, what: str):
    if cfg.positional in ("sinusoidal", "learned") and length > cfg.max_len:
        raise ValueError(f"{what} length {length} exceeds model.max_len={cfg.max_len}")


class Encoder(nn.Module):
    """The embedded source tokens through `num_encoder_layers` blocks: inputs [B, S] ->
    encoded [B, S, D]."""

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
        segments = (inputs != 0 if inputs_segmentation is None
                    else inputs_segmentation).astype(jnp.int32)
        mask = None  # linear attention reads the segments alone, context attention too
        if cfg.attention_kind == "softmax" and ring.context_shards() == 1:
            mask = masks.make_segment_mask(segments, segments)
        return encoder_stack(self, x, mask, positions, segments, deterministic)


class OutputHead(NamedTuple):
    """The final hidden states and the output projection, unapplied: for a loss that projects
    a chunk at a time (`optim.projected_cross_entropy_loss`) instead of holding [B, T, V]."""

    hidden: jax.Array  # [B, T, D], compute dtype
    kernel: jax.Array  # [V, D] (tied to the embedding, vocab_axis 0) or [D, V] (vocab_axis 1)
    vocab_axis: int
    bias: jax.Array | None = None  # [V] float32 (`model.logits_bias`)
    softcap: float | None = None  # c: logits capped as c * tanh(logits / c) (Gemma 2)

    def logits(self) -> jax.Array:
        """[B, T, V] float32: the products in the compute dtype accumulate in float32."""
        spec = "BTD,VD->BTV" if self.vocab_axis == 0 else "BTD,DV->BTV"
        logits = jnp.einsum(spec, self.hidden.astype(self.kernel.dtype), self.kernel,
                            preferred_element_type=jnp.float32)
        logits = attention.softcap(logits if self.bias is None else logits + self.bias,
                                   self.softcap)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def _tied_output_head(cfg: TransformerConfig, embedding: nn.Embed, x) -> OutputHead:
    """x [B, T, D] and the embedding [V, D] as the output projection (pre-softmax = target
    embedding), both in the compute dtype."""
    return OutputHead(x.astype(cfg.compute_dtype), embedding.embedding.astype(cfg.compute_dtype),
                      0)


class Decoder(nn.Module):
    """The embedded decoder input tokens [B, T] through `num_decoder_layers` blocks ->
    (`OutputHead`, cache or None). Masks, `segments` and `in_prefix` [B, T] (read by local and
    linear self-attention, `blocks.MultiHeadAttention`) come from `Transformer.decode_head`."""

    config: TransformerConfig
    embedding: nn.Module
    attention_fn: Callable[..., jax.Array] = attention.dot_product_attention

    @nn.compact
    def __call__(self, tokens, encoded, self_mask, cross_mask, positions, *, segments,
                 in_prefix=None, cache=None, deterministic=True):
        cfg = self.config
        x = _Embedder(cfg, self.embedding, name="embedder")(tokens, positions, deterministic)
        index = None if cache is None else cache["index"]
        new_cache = None if cache is None else {"index": index + tokens.shape[1]}
        block = layer_stack(DecoderBlock, cfg, cfg.num_decoder_layers, per_layer_args=("cache",))
        bias = relative_bias(cfg, positions, causal=True, key_length=None if cache is None
                             else _full_cache_length(cfg, cache))
        stages = pipelined.applies(self, cache)  # mesh.stage > 1: the stack as one pipeline
        if stages:
            x = pipelined.decoder_layers(
                self, functools.partial(layer_stack, DecoderBlock, cfg, per_layer_args=("cache",)),
                x, (encoded, self_mask, cross_mask, positions, segments, in_prefix),
                deterministic, bias)
        for i, (name, window) in enumerate([] if stages else
                                           _layers(cfg, cfg.num_decoder_layers)):
            x, layer_cache = block(cfg, self.attention_fn, window, cfg.routed(i), name=name)(
                x, encoded, self_mask, cross_mask, positions, segments, in_prefix,
                None if cache is None else cache[name], index, deterministic, bias)
            if cache is not None:
                new_cache[name] = layer_cache
        if cfg.norm_position != "post":
            x = Norm(cfg, name="norm")(x)
        bias = self.param("logits_bias", nn.with_logical_partitioning(
            nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,)) if cfg.logits_bias else None
        head = _tied_output_head(cfg, self.embedding, x)
        if not cfg.tie_output_embedding:  # the projection's own [D, V] kernel
            kernel, _ = Weights((cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                use_bias=False, name="logits")()
            head = OutputHead(x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype), 1)
        return head._replace(bias=bias, softcap=cfg.logits_softcap), new_cache


def shift_right(targets: jax.Array, segmentation: jax.Array | None = None, *,
                bos_id: int = BOS_ID) -> jax.Array:
    """Decoder inputs [B, T]: targets shifted right by one, `bos_id` first (and at every packed
    segment's start), so position t sees targets < t (teacher forcing)."""
    shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
    if segmentation is None:
        return shifted
    previous = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(segmentation != previous, bos_id, shifted)


def prefix_inputs(targets_prefix: jax.Array, segmentation: jax.Array | None = None) -> jax.Array:
    """[B, T] bool: the decoder inputs that belong to a prefix LM's prefix, from the targets
    that do (`targets_prefix` [B, T]): each segment's BOS and the inputs that are prefix
    targets shifted right. (`shift_right` puts BOS, nonzero, at every segment start.)"""
    return shift_right(targets_prefix.astype(jnp.int32), segmentation) != 0


# --------------------------------------------------------------------------- the model


class Transformer(nn.Module):
    """Encoder-decoder (the paper), encoder-only, decoder-only Transformer, or an encoder
    classifier.

    `__call__(inputs [B,S], targets [B,T]) -> logits [B,T,V]` (teacher forcing: the decoder
    reads `targets` shifted right); `output_head`, with the same arguments, returns the
    `OutputHead` (hidden states and output kernel) for a loss that projects by chunks.
    Encoder-only returns [B,S,V] from `inputs`. Decoder-only models `targets` (inputs may be
    None). The classifier returns `classify(inputs)` [B, num_classes] (targets unread).
    Token id 0 is padding. Packed rows pass positions and segment ids (0 = padding).
    """

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] | None = None  # default: dot_product_attention

    def setup(self):
        cfg = self.config
        attention_fn = self.attention_fn or functools.partial(
            attention.dot_product_attention,
            implementation=cfg.dense_attention_implementation)

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
        if cfg.architecture in ("encoder_decoder", "decoder"):
            self.decoder = Decoder(cfg, self.embedding, attention_fn)
        if cfg.architecture == "classifier":
            self.head = ClassifierHead(cfg)

    def __call__(self, inputs, targets, **kwargs) -> jax.Array:
        """Logits [B, T, V] ([B, S, V] encoder-only). The arguments of `output_head`. The
        classifier: `classify(inputs, **kwargs)`."""
        if self.config.architecture == "classifier":
            return self.classify(inputs, **kwargs)
        return self.output_head(inputs, targets, **kwargs).logits()

    def classify(self, inputs, *, inputs_positions=None, inputs_segmentation=None,
                 deterministic=True) -> jax.Array:
        """inputs [B, S] -> logits [B, num_classes] float32 (architecture "classifier"): the
        encoder's final states pooled as `model.pooling` (`pool`; padding, id 0 or segment 0,
        left out of "gap") through the zero-initialised `head`."""
        encoded = self.encode(inputs, inputs_positions=inputs_positions,
                              inputs_segmentation=inputs_segmentation,
                              deterministic=deterministic)
        valid = inputs != 0 if inputs_segmentation is None else inputs_segmentation != 0
        return self.head(pool(encoded, valid, self.config.pooling))

    def output_head(self, inputs, targets, *, inputs_positions=None, targets_positions=None,
                    inputs_segmentation=None, targets_segmentation=None, targets_prefix=None,
                    deterministic=True) -> OutputHead:
        """The final hidden states and the output projection of the teacher-forced pass."""
        cfg = self.config
        if cfg.architecture == "classifier":
            raise ValueError("model.architecture='classifier' outputs class logits "
                             "(Transformer.classify), not tokens")
        encoded = None
        if cfg.architecture != "decoder":
            encoded = self.encode(inputs, inputs_positions=inputs_positions,
                                  inputs_segmentation=inputs_segmentation,
                                  deterministic=deterministic)
        if cfg.architecture == "encoder":
            return _tied_output_head(cfg, self.embedding, encoded)
        head, _ = self.decode_head(encoded, inputs, targets, targets_positions=targets_positions,
                                   inputs_segmentation=inputs_segmentation,
                                   targets_segmentation=targets_segmentation,
                                   targets_prefix=targets_prefix, deterministic=deterministic)
        return head

    def encode(self, inputs, *, inputs_positions=None, inputs_segmentation=None,
               deterministic=True):
        """inputs [B, S] -> encoded [B, S, D]."""
        return self.encoder(inputs, inputs_positions=inputs_positions,
                            inputs_segmentation=inputs_segmentation, deterministic=deterministic)

    def decode(self, encoded, inputs, targets, **kwargs) -> tuple[jax.Array, Cache | None]:
        """`decode_head` (same arguments) with the output projection applied: (logits
        [B, T, V] of the next tokens, the updated cache or None)."""
        head, cache = self.decode_head(encoded, inputs, targets, **kwargs)
        return head.logits(), cache

    def decode_head(self, encoded, inputs, targets, *, targets_positions=None,
                    inputs_segmentation=None, targets_segmentation=None, targets_prefix=None,
                    cache=None, deterministic=True) -> tuple[OutputHead, Cache | None]:
        """The decoder's `OutputHead` and the updated cache (None when none was passed).

        Training (cache None): `targets` [B, T] are shifted right inside. Incremental decoding:
        `targets` [B, T] are the decoder's input tokens for positions index..index+T-1 (BOS
        first). `encoded` [B, S, D] and `inputs` [B, S] are None for decoder-only. With a
        cache they may hold one row per W rows of `targets` (a beam search's W beams of a
        sentence, adjacent): the cross-attention keys and values are then projected and
        kept once per sentence, not once per beam.

        Prefix LM (decoder-only): `targets_prefix` [B, T] marks the targets that belong to the
        prefix (nonzero). The decoder inputs of the prefix (BOS and the prefix tokens) attend to
        each other in both directions, the rest causally. With a cache it marks the decoder
        input tokens of this call that form the prefix (a prompt prefilled in one call).
        Incremental decoding keeps no padding (`targets_segmentation` 0, default id 0: the
        pads after a prompt) in a local layer's ring buffer or a linear layer's state.
        """
        cfg = self.config
        self_mask = None  # needed by global softmax layers only
        if cache is None:
            _check_length(cfg, targets.shape[1], "target")
            tokens = shift_right(targets, targets_segmentation, bos_id=cfg.bos_id)
            positions = _positions(targets, targets_positions)
            if targets_segmentation is not None:
                segments = targets_segmentation
            else:  # with no padding token (model.pad_id None) every target is one
                segments = (targets != 0) | (cfg.pad_id is None)
            in_prefix = (None if targets_prefix is None
                         else prefix_inputs(targets_prefix, targets_segmentation))
            self_segments = segments.astype(jnp.int32)
            if cfg.attention_kind == "softmax":
                self_mask = masks.make_decoder_mask(segments, in_prefix)
        else:
            tokens = targets
            positions = _positions(targets, None, offset=cache["index"])
            segments = jnp.ones_like(targets)
            in_prefix = targets_prefix
            self_segments = (targets if targets_segmentation is None
                             else targets_segmentation).astype(bool).astype(jnp.int32)
            full = _full_cache_length(cfg, cache)
            if full is not None:
                self_mask = masks.make_cache_mask(cache["index"], targets.shape[1], full,
                                                  targets_prefix)
        cross_mask = None
        if encoded is not None:
            if inputs_segmentation is not None and cache is None:
                cross_mask = masks.make_segment_mask(targets_segmentation,
                                                     inputs_segmentation)
            elif cache is not None:  # every query attends to the source's tokens
                cross_mask = (inputs != 0)[:, None, None, :]  # [B, 1, 1, S]
            else:
                cross_mask = masks.make_padding_mask(segments != 0, inputs != 0)
        shards = ring.context_shards() if cache is None else 1  # > 1: ops/ring.py's masks
        balance = shards if cfg.context_load_balanced else 1  # 1: the row's order
        tokens, positions, self_segments, in_prefix, cross_mask = jax.tree.map(
            lambda x: ring.to_load_balanced(x, balance, axis=x.ndim // 2),  # T of [B, 1, T, S]
            (tokens, positions, self_segments, in_prefix, cross_mask))
        head, cache = self.decoder(tokens, encoded, None if shards > 1 else self_mask,
                                   cross_mask, positions, segments=self_segments,
                                   in_prefix=in_prefix, cache=cache, deterministic=deterministic)
        return head._replace(hidden=ring.from_load_balanced(head.hidden, balance)), cache


def _full_cache_length(config: TransformerConfig, cache: Cache) -> int | None:
    """S, the positions the caches of global softmax layers hold (`init_cache`); None when
    every layer is local or linear."""
    if config.attention_kind != "softmax":
        return None
    for name, window in _layers(config, config.num_decoder_layers):
        if window is None:
            return cache[name]["self_attention"]["key"].shape[-2]
    return None


def init_cache(config: TransformerConfig, batch_size: int, max_length: int, *,
               int8: bool = False) -> Cache:
    """An empty decoding cache for up to `max_length` positions: per decoder layer the
    self-attention's, in the compute dtype: keys [B, K, S, H] and values [B, K, S, Hv], heads
    first (S = max_length) for a global layer. For a local layer of window w a ring buffer of the
    last min(w, max_length) positions (keys, values and their "position" [B, S], -1 = empty;
    with `attention_global_tokens` a second one, "global", of the first positions).
    For a linear layer the recurrent state [B, K, H, Hv] and normaliser [B, K, H] (float32).
    An empty cross-attention entry (filled with the projected encoder output by the first
    `decode` call), and `index`, the number of positions written. With `int8` the global
    layers' keys and values and the cross-attention's are int8 with a float32 scale per
    (row, head, position) beside them ("key_scale", "value_scale" [B, K, S, 1]:
    `ops/kv_cache.py`); ring buffers and linear states stay as they are."""
    _check_length(config, max_length, "decode")
    dtype = config.compute_dtype
    lead = (config.num_decoder_layers,) if config.scan_layers else ()
    k = config.num_kv_heads
    h = config.d_k
    hv = config.d_v

    def layer(window):
        if config.attention_kind == "linear":
            state = linear_attention.init_state(batch_size, k, h, hv)
            self_attention = {name: jnp.zeros(lead + x.shape, x.dtype)
                              for name, x in state.items()}
        else:
            length = max_length if window is None else min(window, max_length)
            kv_lead = lead + (batch_size, k, length)
            quantized = int8 and window is None
            self_attention = {"key": jnp.zeros(kv_lead + (h,), jnp.int8 if quantized else dtype),
                              "value": jnp.zeros(kv_lead + (hv,),
                                                 jnp.int8 if quantized else dtype)}
            if quantized:
                self_attention.update({f"{name}_scale": jnp.ones(kv_lead + (1,), jnp.float32)
                                       for name in ("key", "value")})
            if window is not None:
                self_attention["position"] = jnp.full(lead + (batch_size, length), -1,
                                                      jnp.int32)
            if window is not None and config.attention_global_tokens:
                held = min(config.attention_global_tokens, max_length)
                self_attention["global"] = {
                    "key": jnp.zeros(lead + (batch_size, k, held, h), dtype),
                    "value": jnp.zeros(lead + (batch_size, k, held, hv), dtype),
                    "position": jnp.full(lead + (batch_size, held), -1, jnp.int32)}
        entry = {"self_attention": self_attention}
        if config.architecture == "encoder_decoder":  # int8: marked by its empty scales
            entry["cross_attention"] = {"key_scale": None, "value_scale": None} if int8 else {}
        return entry

    layers_ = _layers(config, config.num_decoder_layers)
    return {"index": jnp.zeros((), jnp.int32), **{name: layer(w) for name, w in layers_}}


def cache_can_grow(config: TransformerConfig) -> bool:
    """Whether `grow_cache` applies: every decoder layer is a global softmax layer, whose
    cache is a plain list of positions."""
    return config.attention_kind == "softmax" and all(
        window is None for _, window in _layers(config, config.num_decoder_layers))


def grow_cache(config: TransformerConfig, cache: Cache, max_length: int) -> Cache:
    """`cache` (`init_cache`, every layer global softmax: `cache_can_grow`) with room for
    `max_length` positions: the self-attention keys and values padded with zeros after the
    ones held. A search can then start with a short cache and attend over, and reorder, only
    the positions it has reached (`decoding.beam_search`'s `cache_lengths`)."""
    if not cache_can_grow(config):
        raise ValueError("grow_cache needs every decoder layer global softmax attention "
                         "(no local windows, no linear attention)")
    _check_length(config, max_length, "decode")
    held = _full_cache_length(config, cache)
    if max_length < held:
        raise ValueError(f"grow_cache: the cache holds {held} positions, more than "
                         f"max_length={max_length}; it only grows")

    def pad(x):  # [.., B, K, S, H]
        widths = [(0, 0)] * x.ndim
        widths[-2] = (0, max_length - x.shape[-2])
        return jnp.pad(x, widths)

    grown = dict(cache)
    for name, _ in _layers(config, config.num_decoder_layers):
        grown[name] = {**cache[name], "self_attention": jax.tree.map(
            pad, cache[name]["self_attention"])}
    return grown
