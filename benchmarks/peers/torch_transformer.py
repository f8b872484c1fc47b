"""The PyTorch eager peer of our train step: the paper's encoder-decoder, written as a PyTorch
user would (`torch.nn` modules, `F.scaled_dot_product_attention`, `torch.optim.Adam`).

It is built from the same `TransformerConfig` and optimizer settings as ours, so the work per
step is the same: tied and scaled embeddings shared by source and target, sinusoidal positions,
dropout on embeddings and sublayer outputs (`dropout_rate`; attention and ReLU dropout as
configured), LayerNorm after each residual sum (`norm_position="post"`, the paper's) or before
each sublayer and after each stack (`"pre"`, `configs/default.py`'s), label-smoothed
cross-entropy over the tied output projection, gradient clipping by global norm, Adam with the
rsqrt schedule.

Rows are whole (no padding: the benchmark's copy task has none), so no padding mask is built.
`load_params` copies our parameters in, for checking that both compute the same function.

Shapes: B batch, S source length, T target length, D d_model, H heads, V vocabulary.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transformer.data.tokenizer import BOS_ID

PEER_BLOCK = dict(architecture="encoder_decoder", positional="sinusoidal", norm="layer_norm",
                  activation="relu", use_bias=True, share_embeddings=True,
                  tie_output_embedding=True, scale_embeddings=True, attention_kind="softmax",
                  attention_pattern="global")  # what the peer computes; norm_position: either


def sinusoids(length: int, d_model: int) -> torch.Tensor:
    """The paper's positional encodings [length, D] (section 3.5)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    rate = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                     * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)
    return table


class Attention(nn.Module):
    """Multi-head attention with biased Q, K, V and output projections."""

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.query, self.key, self.value, self.out = (nn.Linear(d_model, d_model)
                                                      for _ in range(4))

    def forward(self, x, memory, causal: bool):
        def heads(t):  # [B, L, D] -> [B, H, L, D/H]
            return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

        attended = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(memory)), heads(self.value(memory)),
            dropout_p=self.dropout if self.training else 0.0, is_causal=causal)
        return self.out(attended.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.inner, self.outer, self.dropout = nn.Linear(d_model, d_ff), nn.Linear(d_ff,
                                                                                  d_model), dropout

    def forward(self, x):
        return self.outer(F.dropout(F.relu(self.inner(x)), self.dropout, self.training))


class Layer(nn.Module):
    """An encoder layer (self-attention, FFN) or, with `cross`, a decoder layer (causal
    self-attention, attention over the encoder output, FFN). Post-LN or pre-LN residuals."""

    def __init__(self, cfg, cross: bool):
        super().__init__()
        d = cfg.d_model
        self.self_attention = Attention(d, cfg.num_heads, cfg.attention_dropout_rate)
        self.cross_attention = Attention(d, cfg.num_heads, cfg.attention_dropout_rate) \
            if cross else None
        self.ffn = FeedForward(d, cfg.d_ff, cfg.relu_dropout_rate)
        self.norms = nn.ModuleList(nn.LayerNorm(d, eps=cfg.norm_eps)
                                   for _ in range(3 if cross else 2))
        self.dropout, self.pre_norm = cfg.dropout_rate, cfg.norm_position == "pre"

    def residual(self, x, sublayer, norm):
        """x + Dropout(sublayer(norm(x))) for pre-LN, norm(x + Dropout(sublayer(x))) for post."""
        if self.pre_norm:
            return x + F.dropout(sublayer(norm(x)), self.dropout, self.training)
        return norm(x + F.dropout(sublayer(x), self.dropout, self.training))

    def forward(self, x, encoded=None):
        norms = iter(self.norms)
        x = self.residual(x, lambda h: self.self_attention(h, h, causal=encoded is not None),
                          next(norms))
        if self.cross_attention is not None:
            x = self.residual(x, lambda h: self.cross_attention(h, encoded, causal=False),
                              next(norms))
        return self.residual(x, self.ffn, next(norms))


class Transformer(nn.Module):
    """The encoder-decoder; `loss` is the label-smoothed cross-entropy per target token."""

    def __init__(self, cfg):
        super().__init__()
        unsupported = [f"model.{key}={getattr(cfg, key)!r}" for key, value in PEER_BLOCK.items()
                       if getattr(cfg, key) != value]
        heads = (cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.d_model // cfg.num_heads)
        if (cfg.num_kv_heads, cfg.d_k, cfg.d_v) != heads:
            unsupported.append(f"model.num_kv_heads/d_k/d_v={cfg.num_kv_heads}/{cfg.d_k}/"
                               f"{cfg.d_v} (not {'/'.join(map(str, heads))})")
        if unsupported:
            raise ValueError(f"the PyTorch peer computes the paper's block only, not "
                             f"{', '.join(unsupported)}")
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embedding.weight, std=cfg.d_model ** -0.5)
        self.register_buffer("positions", sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        self.encoder = nn.ModuleList(Layer(cfg, cross=False)
                                     for _ in range(cfg.num_encoder_layers))
        self.decoder = nn.ModuleList(Layer(cfg, cross=True)
                                     for _ in range(cfg.num_decoder_layers))
        final_norm = (lambda: nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)) \
            if cfg.norm_position == "pre" else nn.Identity  # pre-LN normalises each stack's end
        self.encoder_norm, self.decoder_norm = final_norm(), final_norm()

    def _embed(self, tokens):
        x = self.embedding(tokens) * math.sqrt(self.cfg.d_model)
        x = x + self.positions[: tokens.shape[1]]
        return F.dropout(x, self.cfg.dropout_rate, self.training)

    def forward(self, inputs, decoder_inputs):
        """Logits [B, T, V] for source [B, S] and shifted targets [B, T]."""
        encoded = self._embed(inputs)
        for layer in self.encoder:
            encoded = layer(encoded)
        encoded = self.encoder_norm(encoded)
        x = self._embed(decoder_inputs)
        for layer in self.decoder:
            x = layer(x, encoded)
        return self.decoder_norm(x) @ self.embedding.weight.T

    def loss(self, inputs, targets, label_smoothing: float):
        decoder_inputs = F.pad(targets[:, :-1], (1, 0), value=BOS_ID)  # teacher forcing
        logits = self(inputs, decoder_inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                               label_smoothing=label_smoothing)


def load_params(model: Transformer, params: dict) -> None:
    """Copies our parameter tree (`params["params"]`'s content: embedding, encoder/layers_i,
    decoder/layers_i, pre-LN's encoder/norm and decoder/norm) into `model`: kernels [in, ...]
    become Linear weights [out, in]."""
    def linear(module: nn.Linear, ours: dict, heads_in: bool = False):
        kernel = np.asarray(ours["kernel"])
        kernel = kernel.reshape(-1, kernel.shape[-1]) if heads_in else kernel.reshape(
            kernel.shape[0], -1)  # out [H, d, D] -> [H*d, D]; q/k/v [D, H, d] -> [D, H*d]
        module.weight.data = torch.from_numpy(kernel.T.copy())
        module.bias.data = torch.from_numpy(np.asarray(ours["bias"]).reshape(-1).copy())

    def norm(module: nn.LayerNorm, ours: dict):
        module.weight.data = torch.from_numpy(np.asarray(ours["scale"]).copy())
        module.bias.data = torch.from_numpy(np.asarray(ours["bias"]).copy())

    def attention(module: Attention, ours: dict):
        for name in ("query", "key", "value"):
            linear(getattr(module, name), ours[name])
        linear(module.out, ours["out"], heads_in=True)

    embedding = np.asarray(params["embedding"]["embedding"])
    model.embedding.weight.data = torch.from_numpy(embedding.copy())
    for stack, layers, final_norm in (("encoder", model.encoder, model.encoder_norm),
                                      ("decoder", model.decoder, model.decoder_norm)):
        if model.cfg.norm_position == "pre":
            norm(final_norm, params[stack]["norm"])
        for i, layer in enumerate(layers):
            ours = params[stack][f"layers_{i}"]
            attention(layer.self_attention, ours["self_attention"])
            if layer.cross_attention is not None:
                attention(layer.cross_attention, ours["cross_attention"])
            linear(layer.ffn.inner, ours["ffn"]["ff_in"])
            linear(layer.ffn.outer, ours["ffn"]["ff_out"])
            names = ["norm_attention"] + (["norm_cross"] if layer.cross_attention else []) + [
                "norm_ffn"]
            for module, name in zip(layer.norms, names, strict=True):
                norm(module, ours[name])


def make_train_step(cfg, model_cfg):
    """(model, step): `step(inputs, targets)` runs one update and returns the loss. The
    optimizer is Adam with `cfg.optimizer`'s betas, eps, clipping and rsqrt warmup schedule."""
    model = Transformer(model_cfg).train()
    opt = cfg.optimizer
    adam = torch.optim.Adam(model.parameters(), lr=float(opt.learning_rate),
                            betas=(float(opt.b1), float(opt.b2)), eps=float(opt.eps))
    warmup = int(opt.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        adam, lambda step: min((step + 1) / warmup, (warmup / (step + 1)) ** 0.5))

    def step(inputs, targets):
        adam.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets, float(cfg.label_smoothing))
        loss.backward()
        if opt.clip_norm:
            nn.utils.clip_grad_norm_(model.parameters(), float(opt.clip_norm))
        adam.step()
        schedule.step()
        return loss.detach()

    return model, step
