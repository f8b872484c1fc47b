"""Attention maps of a trained model: a translation's encoder self-, decoder self- and
cross-attention per layer and head, and a Vision Transformer's class-token attention over the
patches, per head and rolled out over the layers (Abnar & Zuidema, 2020). The weights are the ones
the forward pass used: `MultiHeadAttention` records `attention.attention_weights` when applied
with `mutable=["intermediates"]`.

Shape legend: L layers, N heads, T target length, S source length (an image's tokens), G the
patch grid's side.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("encoder_self_attention", "decoder_self_attention", "cross_attention")


@dataclasses.dataclass
class AttentionMaps:
    """Attention weights of one sentence pair, per kind [L, N, queries, keys], and the pieces
    labelling the axes: source (+ EOS), decoder inputs (BOS + target) and outputs (target + EOS).
    """

    weights: dict[str, np.ndarray]
    source_pieces: list[str]
    decoder_input_pieces: list[str]
    target_pieces: list[str]

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """(query labels, key labels) of `kind`."""
        return {"encoder_self_attention": (self.source_pieces, self.source_pieces),
                "decoder_self_attention": (self.target_pieces, self.decoder_input_pieces),
                "cross_attention": (self.target_pieces, self.source_pieces)}[kind]


def attention_maps(translator, source: str, target: str | None = None) -> AttentionMaps:
    """Runs `translator`'s model on (source, target) with teacher forcing and returns the
    attention weights of every layer and head. `target` defaults to the model's translation."""
    import jax.numpy as jnp

    from transformer.checkpoint.checkpointer import unstack_layers
    from transformer.data.tokenizer import BOS_ID, EOS_ID
    from transformer.model.transformer import Transformer

    if not source.strip():
        raise ValueError("--source is empty: give a sentence to translate")
    if target is None:
        target = translator.translate([source])[0]
    if not target.strip():
        raise ValueError("the target is empty (the model translated the source to nothing): "
                         "pass --target")
    cfg = dataclasses.replace(translator.model_config, scan_layers=False)
    params = translator.params
    if translator.model_config.scan_layers:
        params = unstack_layers(params)
    source_ids = translator.encode([source])[0]
    target_ids = translator.tokenizer.encode([target])[0][: cfg.max_len - 1] + [EOS_ID]
    _, state = Transformer(cfg).apply(
        {"params": params}, jnp.asarray([source_ids]), jnp.asarray([target_ids]),
        mutable=["intermediates"])
    found = state["intermediates"]

    def stacked(stack: str, num_layers: int, sublayer: str) -> np.ndarray:
        return np.stack([np.asarray(found[stack][f"layers_{i}"][sublayer]
                                    ["attention_weights"][0][0]) for i in range(num_layers)])

    weights = {"encoder_self_attention": stacked("encoder", cfg.num_encoder_layers,
                                                 "self_attention"),
               "decoder_self_attention": stacked("decoder", cfg.num_decoder_layers,
                                                 "self_attention"),
               "cross_attention": stacked("decoder", cfg.num_decoder_layers, "cross_attention")}
    pieces = translator.tokenizer.id_to_piece
    target_pieces = [pieces(i) for i in target_ids]
    return AttentionMaps(weights, [pieces(i) for i in source_ids],
                         [pieces(BOS_ID)] + target_pieces[:-1], target_pieces)


def attention_rollout(weights: np.ndarray) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers")
    of one image's weights [L, N, S, S]: each layer's heads averaged, the residual connection
    added as the identity, Â_l = (mean_N A_l + I) / 2 with rows re-normalised to sum to 1, and
    the layers multiplied from the first: R = Â_L ... Â_1, [S, S]. Row t of R: how much of
    token t's final state flows from each input token (each row sums to 1)."""
    s = weights.shape[-1]
    rollout = np.eye(s)
    for layer in np.asarray(weights, np.float64):
        mixed = 0.5 * layer.mean(0) + 0.5 * np.eye(s)
        rollout = (mixed / mixed.sum(-1, keepdims=True)) @ rollout
    return rollout


@dataclasses.dataclass
class ImageAttention:
    """One image through a Vision Transformer: the pixels it saw [H, W, ch] uint8, every
    layer's attention [L, N, S, S], its patch grid's side G and whether token 0 is a class
    token, and its top class."""

    image: np.ndarray
    weights: np.ndarray
    grid: int
    has_class_token: bool
    predicted: str
    probability: float

    def _pooled_row(self, matrix: np.ndarray) -> np.ndarray:
        """[..., S, S] -> [..., G, G]: the class token's row over the patches. Without one
        (pooling "gap"), the mean of the patches' rows, what the pooled state draws on."""
        row = matrix[..., 0, 1:] if self.has_class_token else matrix.mean(-2)
        return row.reshape(*row.shape[:-1], self.grid, self.grid)

    def per_head(self) -> np.ndarray:
        """[L, N, G, G]: each layer's and head's attention of the class token over the
        patches."""
        return self._pooled_row(self.weights)

    def rollout(self) -> np.ndarray:
        """[G, G]: the class token's row of `attention_rollout` over the patches."""
        return self._pooled_row(attention_rollout(self.weights))


def image_attention(classifier, image_path: str) -> ImageAttention:
    """Runs `classifier` (`classifier.load`) on the image file and keeps every layer's attention
    weights (recorded with `mutable=["intermediates"]`)."""
    import jax

    from transformer.checkpoint.checkpointer import unstack_layers
    from transformer.inference.classifier import read_image
    from transformer.model.vit import VisionTransformer

    cfg = dataclasses.replace(classifier.model_config, scan_layers=False)
    params = classifier.params
    if classifier.model_config.scan_layers:
        params = unstack_layers(params)
    pixels = read_image(image_path, cfg.image_size, cfg.num_channels)
    logits, state = VisionTransformer(cfg).apply(
        {"params": params}, classifier.normalise(pixels[None]), mutable=["intermediates"])
    found = state["intermediates"]["encoder"]
    weights = np.stack([np.asarray(found[f"layers_{i}"]["self_attention"]
                                   ["attention_weights"][0][0])
                        for i in range(cfg.num_encoder_layers)])
    probabilities = np.asarray(jax.nn.softmax(logits[0]))
    best = int(probabilities.argmax())
    return ImageAttention(pixels, weights, cfg.image_size // cfg.patch_size,
                          cfg.pooling == "cls", classifier.class_names[best],
                          float(probabilities[best]))
