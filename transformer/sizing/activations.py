"""Estimated bytes of the activations one device keeps for the backward pass, under the
config's remat policy (`activation_bytes`).

Shape legend: B rows per microbatch on one device, S source length, T target length, N query
heads, K kv heads, H head dim (d_k), Hv value head dim (d_v), D d_model, F d_ff, V vocab.
"""

from __future__ import annotations

import jax.numpy as jnp

from transformer.model.config import TransformerConfig
from transformer.ops import attention, linear_attention, moe


def _local(size: int, parts: int) -> int:
    """A dimension's share on one device: split if `parts` divides it, else replicated."""
    return size // parts if size % parts == 0 else size


def _materialises_weights(model: TransformerConfig, kv_len: int) -> bool:
    """Whether attention keeps the [B, N, T, S] weights ("xla"; "auto" below the chunked
    threshold as on a CPU compile, where it never picks cuDNN; not the "splash" kernel)."""
    if model.attention_implementation == "auto":
        return model.attention_dropout_rate > 0.0 or kv_len < attention.AUTO_CHUNKED_MIN_KEYS
    return model.attention_implementation == "xla"


def _attention_elements(model, tensor, q_len, kv_len, policy,
                        linear: bool = False) -> tuple[int, int]:
    """(compute-dtype, float32) elements one attention sublayer saves per sequence; `linear`:
    linear attention, whose scan keeps each chunk's [C, C] scores instead of the weights."""
    n = _local(model.num_heads, tensor)
    k = _local(model.num_kv_heads, tensor)
    d = model.d_model
    h = model.d_k
    hv = model.d_v
    projections = q_len * n * h + kv_len * k * (h + hv)  # q, k, v
    context = q_len * n * hv  # A V
    weights = n * q_len * kv_len if _materialises_weights(model, kv_len) else 0
    if linear:
        weights = n * q_len * min(linear_attention.DEFAULT_CHUNK_SIZE, q_len)
    if policy == "none":  # + input, out-projection, residual sum, norm output
        return projections + context + 4 * q_len * d, weights
    if policy == "dots":  # every matmul output: q, k, v, Q K^T (float32), A V, out-projection
        return projections + context + q_len * d, weights
    if policy == "dots_no_batch":  # matmuls without batch dims: q, k, v, out-projection
        return projections + q_len * d, 0
    return 0, 0  # full: nothing inside the layer


def _expert_rows(model, length: int) -> int:
    """Rows a routed layer's experts run for a sequence of `length` tokens: k per token
    (dropless), or E x capacity slots (capacity dispatch, the sequence its group)."""
    k = model.experts_per_token
    e = model.num_experts
    factor = model.moe_capacity_factor
    return e * moe.capacity(length, k, e, factor) if factor else length * k


def _ffn_elements(model, tensor, length, policy, routed: bool = False) -> int:
    """Compute-dtype elements one feed-forward sublayer saves per sequence. A routed one runs
    its experts over `_expert_rows`, keeps the dispatched tokens and the experts' outputs
    (rows x D each), and a shared expert's dense sublayer beside them."""
    f = _local(model.d_ff, tensor)
    d = model.d_model
    matmuls_in = 2 if model.activation == "swiglu" else 1  # ff_in (and ff_gate)
    rows = _expert_rows(model, length) if routed else length
    dispatched = 2 * rows * d if routed else 0
    shared = (_ffn_elements(model, tensor, length, policy)
              if routed and model.moe_shared_expert else 0)
    if policy == "none":  # hidden before/after the activation (and the gate), out, residual, norm
        return rows * f * (matmuls_in + 1) + dispatched + 3 * length * d + shared
    if policy in ("dots", "dots_no_batch"):  # ff_in (ff_gate) and ff_out outputs
        return rows * (f * matmuls_in + d) + shared
    return 0


def _layer_bytes(model, tensor, q_len, kv_len, cross_len, policy, routed: bool = False) -> int:
    """Bytes one layer saves per sequence: self-attention over `kv_len`, cross-attention to
    `cross_len` source tokens (0: none), feed-forward (`routed`: experts). Plus the layer
    input (always kept)."""
    itemsize = jnp.dtype(model.dtype).itemsize
    compute, f32 = _attention_elements(model, tensor, q_len, kv_len, policy,
                                       linear=model.attention_kind == "linear")
    if cross_len:
        cross_compute, cross_f32 = _attention_elements(model, tensor, q_len, cross_len, policy)
        compute += cross_compute
        f32 += cross_f32
    compute += _ffn_elements(model, tensor, q_len, policy, routed) + q_len * model.d_model
    return compute * itemsize + f32 * 4


def activation_bytes(model: TransformerConfig, *, rows: int, source_length: int,
                     target_length: int, tensor: int = 1, loss_chunk_tokens: int = 0) -> int:
    """Estimated bytes of activations one device keeps for the backward pass of one microbatch
    of `rows` sequences (B), under `model.remat_policy`; `tensor` splits heads, d_ff and vocab.

    Per sequence and layer, in the compute dtype unless marked float32 (attention over q_len
    queries and kv_len keys; FFN over q_len tokens):

        always      the layer input                                   q_len·D
        none        attention: q, k, v, A·V, input, out-proj, residual, norm
                        q_len·N·H + kv_len·K·(H + Hv) + q_len·N·Hv + 4·q_len·D
                    + softmax weights N·q_len·kv_len (float32, only where attention
                      materialises them: "xla", or "auto" below AUTO_CHUNKED_MIN_KEYS keys,
                      a local window included; linear self-attention: its chunks' scores
                      N·q_len·C, C = min(64, q_len))
                    FFN: hidden before and after the activation (SwiGLU: and the gate), out,
                    residual, norm            q_len·F·(2 | 3) + 3·q_len·D
        dots        matmul outputs only: q, k, v, Q·K^T (float32), A·V, out-proj; ff_in
                    (ff_gate), ff_out
        dots_no_batch   as dots without Q·K^T and A·V (they have batch dimensions)
        full        nothing but the layer input

    A routed layer (`model.num_experts`) runs its FFN over R rows instead of q_len: R = k·q_len
    (dropless) or E·C (capacity dispatch, C = ceil(factor·q_len·k / E)), and keeps the
    dispatched tokens and the experts' outputs, 2·R·D ("none"). Its shared expert, if any, is a
    dense FFN beside them. Not counted: the router's logits, and under expert parallelism the
    tokens a device gathers from its expert group (dropless).
    An encoder layer attends S to S. A decoder layer T to T, then (encoder-decoder) T to S.
    The vision model is an encoder whose logits are one row of num_classes per image.
    With remat, the backward pass recomputes one layer at a time: one layer's "none" figure is
    added. Outside the layers: the embedded inputs of each stack (S·D, T·D) and the logits,
    counted as two float32 copies of T·V (S·V encoder-only): kept for the loss's backward and
    their gradient. With `loss_chunk_tokens` > 0 (`optim.projected_cross_entropy_loss`) two
    float32 copies of one chunk's logits, the hidden states' gradient (T·D) and the output
    kernel's (float32 D·V) instead. Not counted: masks, dropout masks, norm statistics, XLA's
    fusion buffers.
    """
    policy = model.remat_policy
    s = source_length
    t = target_length
    itemsize = jnp.dtype(model.dtype).itemsize
    stacks = []  # (layers, q_len, kv_len, cross_len)
    if model.architecture != "decoder":
        stacks.append((model.num_encoder_layers, s, s, 0))
    if model.architecture not in ("encoder", "vision", "classifier"):
        cross = s if model.architecture == "encoder_decoder" else 0
        stacks.append((model.num_decoder_layers, t, t, cross))
    per_sequence = sum(_layer_bytes(model, tensor, q, kv, c, policy, model.routed(layer))
                       for num, q, kv, c in stacks for layer in range(num))
    if policy != "none":
        per_sequence += max(_layer_bytes(model, tensor, q, kv, c, "none", model.routed(layer))
                            for num, q, kv, c in stacks for layer in range(num))
    per_sequence += sum(q * model.d_model * itemsize for _, q, _, _ in stacks)
    output_length = 1 if model.classifies else s if model.architecture == "encoder" else t
    vocab = _local(model.num_classes if model.classifies else model.vocab_size, tensor)
    if loss_chunk_tokens <= 0:
        return rows * (per_sequence + 2 * 4 * output_length * vocab)
    chunk_tokens = rows * min(output_length, max(1, loss_chunk_tokens // rows))
    return (rows * (per_sequence + output_length * model.d_model * itemsize)
            + 2 * 4 * chunk_tokens * vocab + 4 * model.d_model * vocab)
