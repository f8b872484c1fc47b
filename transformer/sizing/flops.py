"""Parameter and FLOPs accounting for a `TransformerConfig` (used by `--summary`, MFU, benchmarks).

Parameters are counted from `jax.eval_shape(Transformer(config).init, ...)`: shapes only, nothing
is allocated, so the count is whatever the model really builds (biases, norms, untied logits,
learned positions, SwiGLU gates included).

FLOPs count matrix multiplications only, 2 FLOPs per multiply-add. Embedding lookups, biases,
norms, activations, softmax and dropout are free. Shape legend as in transformer/__init__.py: S
source length, T target length, N query heads, K kv heads, H = d_k, Hv = d_v, D d_model, F d_ff,
V vocab, A = 2 for relu/gelu/silu and 3 for swiglu/geglu (FFN matmuls). Forward FLOPs of one
sequence pair:

    attention projections over L tokens (queries from L_q, keys/values from L_kv):
        proj(L_q, L_kv) = 2·L_q·D·N·H + 2·L_kv·D·K·(H + Hv) + 2·L_q·N·Hv·D
    scores and values:
        core(L_q, L_kv) = 2·L_q·L_kv·N·H   (Q K^T)   + 2·L_q·L_kv·N·Hv   (A V)
        causal self-attention over L: core(L, L) / 2
    feed-forward over L tokens:      ffn(L) = 2·L·D·F·A
    encoder layer (self-attention over S):
        proj(S, S) + core(S, S) + ffn(S)
    decoder layer (causal self-attention, then cross-attention to S):
        proj(T, T) + core(T, T) / 2 + proj(T, S) + core(T, S) + ffn(T)
    output projection:               logits(L) = 2·L·D·V

A routed layer (`model.num_experts` E > 0, `experts_per_token` k, docs/moe.md) replaces
ffn(L) by its router, 2·L·D·E, plus the experts each token goes through, k·ffn(L) (dropless;
capacity dispatch computes every slot, c·k·ffn(L) for capacity factor c), plus ffn(L) for a
shared expert. (On CPU, `jax.lax.ragged_dot` lowers to a masked product over all E experts: E
times the experts' figure is computed there; the count is the model's, not that lowering's.)

The decoder's causal self-attention counts half the T×T score matrix, the entries its mask keeps
(T²/2, the field's convention for MFU: MaxText's `calculate_tflops_training_per_device` and
Megatron-LM divide causal attention by 2; a prefix LM's bidirectional prefix is counted causal
too). Encoder and cross-attention count the whole matrix. The "xla" implementation computes the
masked entries as well (twice these FLOPs). A causal-aware kernel (splash, chunked) skips the
masked blocks.

Efficient self-attention (`attention_pattern`, `attention_kind`):
    a local layer of window w counts the (query, key) pairs its pattern allows, P, in place of
    L_q·L_kv: keys t - w .. t (decoder) or t - w .. t + w (encoder) clipped to the row, or
    global (the first `attention_global_tokens` positions, to and from everything; in a
    decoder only keys up to the query): core = 2·P·N·(H + Hv), P ≈ L·(w + 1) causal. (The
    chunked kernel computes whole key blocks, up to w + C keys a query; "xla" all L_q·L_kv.)
    a linear layer (elu/relu features, `linear_attention`) runs its chunked scan over L
    positions rounded up to Lc, a multiple of the chunk C = min(64, L), once causal and twice
    (both directions) in an encoder:
        scan(L) = 2·Lc·C·N·(H + Hv)      scores and values within each chunk
                + 2·Lc·N·H·(Hv + 1)      queries against the carried state and normaliser
                + 2·Lc·K·H·Hv            the state update
    the vision model's linear encoder (no packed rows) sums once: 2·S·K·H·Hv + 2·S·N·H·(Hv+1).

Training FLOPs = 3 × forward (the backward pass costs twice the forward).
`train_flops_per_token` divides the sequence-pair figure by T (the loss is per target token). An
encoder-only model divides by S (its loss is per input token) and applies the logits over S.
Decoder-only models have neither encoder nor cross-attention.

The vision model (`architecture="vision"`, `transformer.model.vit`) is an encoder over its S patch
tokens (plus the class token with pooling "cls"), whatever lengths are passed. Its forward adds
the patch embedding, 2·G²·Q·D (G² patches of Q = P²·C values), and one logits row,
2·D·num_classes; `train_flops_per_token` is per image (its loss is per image). The text
classifier (`architecture="classifier"`) is the encoder over S tokens with that logits row,
counted per row likewise.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.model import vit
from transformer.model.transformer import Transformer, TransformerConfig
from transformer.ops import layers, linear_attention

PARAM_GROUPS = ("embedding", "source_embedding", "position_embedding", "encoder", "decoder",
                "logits")


def abstract_params(config: TransformerConfig) -> dict[str, Any]:
    """The params pytree as `jax.ShapeDtypeStruct` leaves (logical-partitioning boxes removed)."""
    if config.architecture == "vision":
        images = jax.ShapeDtypeStruct((1, config.image_size, config.image_size,
                                       config.num_channels), jnp.float32)
        variables = jax.eval_shape(vit.VisionTransformer(config).init, jax.random.key(0), images)
        return nn.meta.unbox(variables["params"])
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    return nn.meta.unbox(variables["params"])


def _size(tree) -> int:
    return sum(int(leaf.size) for leaf in jax.tree.leaves(tree))


def param_counts(config: TransformerConfig) -> dict[str, int]:
    """Parameters per module group, plus `total`. Every key of PARAM_GROUPS is present.

    `embedding` is the (target, or shared) token embedding; `source_embedding` the encoder's own
    when `share_embeddings` is off; `position_embedding` learned position tables; `logits` the
    untied pre-softmax projection (0 when tied); `encoder`/`decoder` everything else below them.
    """
    params = abstract_params(config)
    counts = dict.fromkeys(PARAM_GROUPS, 0)
    for name, subtree in params.items():
        if name in ("encoder", "decoder"):
            subtree = dict(subtree)
            embedder = subtree.pop("embedder", None)
            counts["position_embedding"] += _size(embedder)
            if name == "decoder":
                counts["logits"] += _size(subtree.pop("logits", None))
            counts[name] += _size(subtree)
        elif name in counts:
            counts[name] += _size(subtree)
        else:  # a module this accounting does not know yet: still counted in total
            counts[name] = _size(subtree)
    counts["total"] = _size(params)
    return counts


def active_params(config: TransformerConfig) -> int:
    """Parameters a token goes through: the total less, in each routed layer, the
    num_experts - experts_per_token experts it skips (the router and shared expert count)."""
    params = abstract_params(config)
    skipped = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [getattr(key, "key", "") for key in path]
        if "moe" in names and names[-1] != "router":
            skipped += leaf.size * (1 - config.experts_per_token / config.num_experts)
    return _size(params) - round(skipped)


def ffn_matmuls(config: TransformerConfig) -> int:
    """The feed-forward's matmuls: 3 gated (in, gate, out), else 2."""
    return 3 if config.activation in layers.GATED else 2


def ffn_flops_per_token(config: TransformerConfig, layer: int) -> float:
    """The feed-forward sublayer's forward FLOPs per token in layer `layer` (module
    docstring): dense, or routed (router, the k experts, the shared one)."""
    dense = 2.0 * config.d_model * config.d_ff * ffn_matmuls(config)
    if not config.routed(layer):
        return dense
    active = config.experts_per_token * (config.moe_capacity_factor or 1.0)
    return (2.0 * config.d_model * config.num_experts + active * dense
            + (dense if config.moe_shared_expert else 0.0))


def _attention_flops(config: TransformerConfig, q_len: int, kv_len: int) -> dict[str, float]:
    d, n, kh, h, hv = (config.d_model, config.num_heads, config.num_kv_heads, config.d_k,
                       config.d_v)
    return {
        "projections": 2.0 * q_len * d * n * h + 2.0 * kv_len * d * kh * (h + hv)
        + 2.0 * q_len * n * hv * d,
        "scores_values": 2.0 * q_len * kv_len * n * (h + hv),
    }


def window_pairs(length: int, window: tuple[int, int], global_tokens: int = 0,
                 causal: bool = False) -> int:
    """P, the (query, key) pairs of a `length`-long self-attention that a local window
    (left, right) with `global_tokens` allows (`masks.make_local_mask`), causal: and-ed with
    keys <= query."""
    left, right = window
    q = np.arange(length)
    lo = np.maximum(q - left, 0)
    hi = np.minimum(q + right, length - 1)
    held = min(global_tokens, length)
    overlap = np.maximum(np.minimum(hi, held - 1) - lo + 1, 0)  # window keys that are global
    keys = hi - lo + 1 + held - overlap
    keys = np.where(q < held, q + 1 if causal else length, keys)
    return int(keys.sum())


def _self_attention_flops(config: TransformerConfig, length: int, layer: int,
                          causal: bool) -> dict[str, float]:
    """`_attention_flops` of self-attention layer `layer` over `length` positions, with its
    window or linear attention (module docstring)."""
    flops_ = _attention_flops(config, length, length)
    n = config.num_heads
    kh = config.num_kv_heads
    h = config.d_k
    hv = config.d_v
    window = config.layer_window(layer)
    if config.attention_kind == "linear" and config.architecture == "vision":
        flops_["scores_values"] = 2.0 * length * (kh * h * hv + n * h * (hv + 1))
    elif config.attention_kind == "linear":
        chunk = max(1, min(linear_attention.DEFAULT_CHUNK_SIZE, length))
        padded = -(-length // chunk) * chunk
        scan = 2.0 * padded * (chunk * n * (h + hv) + n * h * (hv + 1) + kh * h * hv)
        flops_["scores_values"] = scan * (1 if causal else 2)
    elif window is not None:
        pairs = window_pairs(length, (window, 0 if causal else window),
                             config.attention_global_tokens, causal=causal)
        flops_["scores_values"] = 2.0 * pairs * n * (h + hv)
    elif causal:
        flops_["scores_values"] /= 2
    return flops_


def forward_flops(config: TransformerConfig, *, source_length: int,
                  target_length: int) -> dict[str, float]:
    """Forward matmul FLOPs of one sequence pair by component (module docstring), and `total`.

    Keys: `attention_projections`, `attention_scores_values` (Q K^T and A V), `ffn`, `logits`,
    `total`. Encoder-only models ignore `target_length`. Decoder-only ones `source_length`.
    """
    s = source_length
    t = target_length
    if config.architecture == "vision":
        s = vit.num_tokens(config)
    parts = {"attention_projections": 0.0, "attention_scores_values": 0.0, "ffn": 0.0}

    def add(attn: dict[str, float], layers: int = 1):
        parts["attention_projections"] += layers * attn["projections"]
        parts["attention_scores_values"] += layers * attn["scores_values"]

    if config.architecture != "decoder":
        for layer in range(config.num_encoder_layers):
            add(_self_attention_flops(config, s, layer, causal=False))
        parts["ffn"] += s * sum(ffn_flops_per_token(config, layer)
                                for layer in range(config.num_encoder_layers))
    if config.architecture in ("decoder", "encoder_decoder"):
        for layer in range(config.num_decoder_layers):
            add(_self_attention_flops(config, t, layer, causal=True))
        if config.architecture == "encoder_decoder":
            add(_attention_flops(config, t, s), config.num_decoder_layers)
        parts["ffn"] += t * sum(ffn_flops_per_token(config, layer)
                                for layer in range(config.num_decoder_layers))
    output_length = s if config.architecture == "encoder" else t
    parts["logits"] = 2.0 * output_length * config.d_model * config.vocab_size
    if config.classifies:  # one row of class logits
        parts["logits"] = 2.0 * config.d_model * config.num_classes
    if config.architecture == "vision":
        parts["patch_embedding"] = 2.0 * config.num_patches * config.patch_size ** 2 * (
            config.num_channels * config.d_model)
    parts["total"] = sum(parts.values())
    return parts


def train_flops_per_token(config: TransformerConfig, *, source_length: int,
                          target_length: int) -> float:
    """Training (forward + backward = 3 × forward) matmul FLOPs per target token (per input
    token for encoder-only models), for sequences of the given lengths."""
    total = forward_flops(config, source_length=source_length,
                          target_length=target_length)["total"]
    tokens = (1 if config.classifies else source_length if config.architecture == "encoder"
              else target_length)
    return 3.0 * total / tokens
