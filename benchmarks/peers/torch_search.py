"""The PyTorch eager peer of our decoding: greedy and beam search over `torch_transformer`'s
model, written as a PyTorch user would (keys and values cached per layer and grown with
`torch.cat`, `torch.topk`), with the rules of `transformer/inference/decoding.py`: padding is never
chosen, a row's last allowed position may only be EOS, beam search keeps the best W finished
hypotheses among the best W candidates of each step (scored with GNMT's length penalty) and the
best W alive ones, and stops when no alive hypothesis can beat a sentence's best finished one.

Sources are padded with 0 at the end (keys at padding are masked in the encoder and in
cross-attention), as `Translator.translate_ids` pads them. Residuals and norms are the model's
(`Layer.residual`: post-LN or pre-LN). With our parameters copied in
(`torch_transformer.load_params`) both give the same tokens (tests/inference/test_peers.py).

Shapes: B sentences, W beams, S source length, T output length, D d_model, H heads, V vocab.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.inference.decoding import NEG_INF


def _heads(module, t):  # [B, L, D] -> [B, H, L, D/H]
    return t.unflatten(-1, (module.num_heads, -1)).transpose(1, 2)


def _attend(module, query, keys, values, mask=None):
    """`module`'s output projection of attention from `query` [B, Lq, D] over cached `keys`
    and `values` [B, H, Lk, D/H]; `mask` [B, 1, 1, Lk] True where a key may be seen."""
    attended = F.scaled_dot_product_attention(_heads(module, module.query(query)), keys, values,
                                              attn_mask=mask)
    return module.out(attended.transpose(1, 2).flatten(2))


def _self_attend(module, x, cache=None, mask=None):
    """`module`'s self-attention of `x` [B, L, D] over its own keys and values, appended first
    to `cache`'s (a decoder layer's entry; None in the encoder)."""
    keys = _heads(module, module.key(x))
    values = _heads(module, module.value(x))
    if cache is not None:
        if cache["keys"] is not None:
            keys, values = (torch.cat([cache["keys"], keys], 2),
                            torch.cat([cache["values"], values], 2))
        cache["keys"], cache["values"] = keys, values
    return _attend(module, x, keys, values, mask)


def encode(model, inputs):
    """(encoded [B, S, D], key mask [B, 1, 1, S]) of `inputs` [B, S] padded with 0."""
    mask = (inputs != PAD_ID)[:, None, None, :]
    x = model._embed(inputs)
    for layer in model.encoder:
        attention = partial(_self_attend, layer.self_attention, mask=mask)
        x = layer.residual(x, attention, layer.norms[0])
        x = layer.residual(x, layer.ffn, layer.norms[1])
    return model.encoder_norm(x), mask


def start_cache(model, encoded):
    """Per decoder layer: the cross-attention keys and values of `encoded`, no self ones yet."""
    cache = []
    for layer in model.decoder:
        cross = layer.cross_attention
        cache.append({"cross_keys": _heads(cross, cross.key(encoded)),
                      "cross_values": _heads(cross, cross.value(encoded)),
                      "keys": None, "values": None})
    return cache


def decode_step(model, tokens, position: int, cache, mask):
    """Logits [B, V] after `tokens` [B] at `position`. Appends their keys and values."""
    x = model.embedding(tokens)[:, None] * math.sqrt(model.cfg.d_model)
    x = x + model.positions[position]
    for layer, entry in zip(model.decoder, cache, strict=True):
        x = layer.residual(x, partial(_self_attend, layer.self_attention, cache=entry),
                           layer.norms[0])
        x = layer.residual(x, partial(_attend, layer.cross_attention, keys=entry["cross_keys"],
                                      values=entry["cross_values"], mask=mask), layer.norms[1])
        x = layer.residual(x, layer.ffn, layer.norms[2])
    return (model.decoder_norm(x) @ model.embedding.weight.T)[:, 0]


def _next_logprobs(logits, step: int, max_lengths, rows_per_sentence: int):
    """log P(next) [B, r, V] from logits [B*r, V]: padding banned, and only EOS at a row's last
    allowed position (`max_lengths` [B])."""
    logprobs = F.log_softmax(logits.float(), -1).unflatten(0, (max_lengths.shape[0],
                                                              rows_per_sentence))
    ids = torch.arange(logprobs.shape[-1])
    last = (step + 1 >= max_lengths)[:, None, None]
    banned = (ids == PAD_ID) | (last & (ids != EOS_ID))
    return logprobs.masked_fill(banned, NEG_INF)


@torch.no_grad()
def greedy_search(model, inputs, max_lengths, max_length: int):
    """Tokens [B, T] (T = max_length), each row ending at its first EOS, zeros after."""
    encoded, mask = encode(model, inputs)
    cache = start_cache(model, encoded)
    batch = inputs.shape[0]
    tokens = torch.zeros(batch, max_length, dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool)
    token = torch.full((batch,), BOS_ID)
    for step in range(max_length):
        logits = decode_step(model, token, step, cache, mask)
        token = _next_logprobs(logits, step, max_lengths, 1)[:, 0].argmax(-1)
        token = token.masked_fill(finished, 0)
        tokens[:, step] = token
        finished |= token == EOS_ID
        if finished.all():
            break
    return tokens


def _length_penalty(length, alpha: float):
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model, inputs, max_lengths, max_length: int, beam_size: int, alpha: float):
    """The best finished hypothesis [B, T] of each sentence (EOS forced at `max_lengths`)."""
    batch = inputs.shape[0]
    width = beam_size
    encoded, mask = encode(model, inputs)
    cache = start_cache(model, encoded.repeat_interleave(width, 0))
    mask = mask.repeat_interleave(width, 0)
    alive_seqs = torch.zeros(batch, width, max_length, dtype=torch.long)
    alive_logprobs = torch.tensor([0.0] + [NEG_INF] * (width - 1)).repeat(batch, 1)
    finished_seqs = torch.zeros(batch, width, max_length, dtype=torch.long)
    finished_scores = torch.full((batch, width), NEG_INF)
    offsets = width * torch.arange(batch)[:, None]
    logits = decode_step(model, torch.full((batch * width,), BOS_ID), 0, cache, mask)
    for step in range(max_length):
        logprobs = _next_logprobs(logits, step, max_lengths, width)
        vocab = logprobs.shape[-1]
        candidates = (alive_logprobs[..., None] + logprobs).flatten(1)
        top_logprobs, top_ids = candidates.topk(2 * width)
        origin = top_ids // vocab
        token = top_ids % vocab
        seqs = alive_seqs.gather(1, origin[..., None].expand(-1, -1, max_length))
        seqs[:, :, step] = token
        is_eos = token == EOS_ID
        in_beam = torch.arange(2 * width) < width
        scores = top_logprobs / _length_penalty(step + 1, alpha)
        scores = scores.masked_fill(~(is_eos & in_beam & (top_logprobs > NEG_INF / 2)), NEG_INF)
        finished_scores, keep = torch.cat([finished_scores, scores], 1).topk(width)
        finished_seqs = torch.cat([finished_seqs, seqs], 1).gather(
            1, keep[..., None].expand(-1, -1, max_length))
        alive_logprobs, keep = top_logprobs.masked_fill(is_eos, NEG_INF).topk(width)
        alive_seqs = seqs.gather(1, keep[..., None].expand(-1, -1, max_length))
        # Go on while some sentence's best alive hypothesis could still win (its
        # log-probability only falls; the penalty is largest at the maximum length).
        best_possible = alive_logprobs[:, 0] / _length_penalty(max_lengths.float(), alpha)
        if step + 1 == max_length or not ((best_possible > finished_scores[:, 0])
                                          & (step + 1 < max_lengths)).any():
            break
        rows = (origin.gather(1, keep) + offsets).flatten()
        for entry in cache:
            entry["keys"], entry["values"] = entry["keys"][rows], entry["values"][rows]
        logits = decode_step(model, token.gather(1, keep).flatten(), step + 1, cache, mask)
    return finished_seqs[:, 0]


def search(model, sources: list[list[int]], *, beam_size: int, alpha: float,
           max_extra_length: int):
    """Tokens [B, T] for id lists `sources` (EOS included), padded with 0 at the end as
    `Translator.translate_ids` pads them, each allowed `max_extra_length` more tokens than its
    source (at most the model's max_len): greedy for a beam of 1, else beam search."""
    inputs = torch.zeros(len(sources), max(map(len, sources)), dtype=torch.long)
    for row, ids in enumerate(sources):
        inputs[row, :len(ids)] = torch.tensor(ids)
    max_lengths = torch.tensor([min(len(ids) + max_extra_length, model.cfg.max_len)
                                for ids in sources])
    max_length = int(max_lengths.max())
    if beam_size == 1:
        return greedy_search(model, inputs, max_lengths, max_length)
    return beam_search(model, inputs, max_lengths, max_length, beam_size, alpha)
