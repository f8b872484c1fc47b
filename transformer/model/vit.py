"""The Vision Transformer (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021): an
image as a sequence of patch tokens through the Transformer's own encoder blocks.

    images [B, image_size, image_size, num_channels] float32 (normalised)
      -> patches [B, G*G, P*P*num_channels]       `patchify`: P = patch_size, G = image_size / P
      -> patch embedding [B, G*G, D]              `patch_embedding/kernel` [P*P*num_channels, D]
      -> class token prepended (pooling "cls")    `class_token` [D]: S = G*G + 1, else S = G*G
      -> + position embeddings, dropout           `position_embedding` [S, D] (learned, 1-D)
      -> num_encoder_layers `blocks.EncoderBlock` `encoder/layers_{i}` (or scanned `layers`;
         with mesh.stage > 1 the scanned stack runs through the pipeline, `model/pipelined.py`)
      -> final norm (pre-LN)                      `encoder/norm`
      -> the class token's state, or the mean over tokens (pooling "gap")   [B, D]
      -> head, zero-initialised as the paper      `head/kernel` [D, num_classes], `head/bias`
      -> logits [B, num_classes] float32

The paper's model is `norm_position="pre"`, `activation="gelu"`, `positional="learned"`
(configs/vit.py). The blocks read these from the config like the text models do, and the stack
is `model`'s (scan and remat as configured). The attention implementations (`auto`, chunked,
cuDNN) apply unchanged: there is no mask, every token attends to every token.

The patch embedding is a linear map of each flattened patch, the paper's eq. 1. Flattening a
patch in (row, column, channel) order makes it exactly a convolution with stride P and the
kernel `patch_embedding/kernel.reshape(P, P, num_channels, D)` (HWIO layout, VALID padding)
whose output grid is read row by row.

Logical axes are the rules table's: the patch vector's axis is unnamed (replicated), D is
`embed`, S is `length`, and the classes take `vocab` (a classifier's output vocabulary).
Shapes in the package's legend. Here G is the patch grid's side, P the patch size and
Q = P*P*num_channels the length of a flattened patch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.model.blocks import Weights
from transformer.model.config import TransformerConfig
from transformer.model.transformer import ClassifierHead, encoder_stack
from transformer.ops import attention


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
    """[B, height, width, channels] -> [B, (height/P)*(width/P), P*P*channels]: the patches in
    row-major grid order, each flattened in (row, column, channel) order."""
    b, h, w, c = images.shape
    p = patch_size
    x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def mirror_averaged_logits(logits_fn: Callable[[jax.Array], jax.Array],
                           images: jax.Array) -> jax.Array:
    """Test-time flip: the log of the mean class probabilities of `images` [B, H, W, C] and
    their mirror images (columns reversed), [B, num_classes] float32. `logits_fn` maps images
    to logits. It runs once on the 2B images. Usable as logits: their softmax is that mean."""
    logits = logits_fn(jnp.concatenate([images, images[:, :, ::-1]]))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    plain, mirrored = jnp.split(log_probs, 2)
    return jnp.logaddexp(plain, mirrored) - jnp.log(2.0)


def num_tokens(config: TransformerConfig) -> int:
    """S of the vision model: the patches, plus the class token with pooling "cls"."""
    return config.num_patches + (config.pooling == "cls")


def resize_position_embeddings(posemb: jax.Array, old_grid: int | tuple[int, int],
                               new_grid: int | tuple[int, int],
                               has_class_token: bool) -> jax.Array:
    """Position embeddings [S, D] of a `old_grid` patch grid resized to `new_grid` by bilinear
    interpolation over the 2-D grid (the paper's section 3.2, fine-tuning at a higher
    resolution). A class token's row (first) is kept as it is. Grids are a side or (rows,
    columns). Returns [S', D]."""
    old = (old_grid, old_grid) if isinstance(old_grid, int) else tuple(old_grid)
    new = (new_grid, new_grid) if isinstance(new_grid, int) else tuple(new_grid)
    head, grid = (posemb[:1], posemb[1:]) if has_class_token else (posemb[:0], posemb)
    if grid.shape[0] != old[0] * old[1]:
        raise ValueError(f"position embeddings of {grid.shape[0]} patches do not form the "
                         f"{old[0]}x{old[1]} grid given (has_class_token={has_class_token})")
    d = grid.shape[-1]
    resized = jax.image.resize(grid.reshape(*old, d), (*new, d), method="linear")
    return jnp.concatenate([head, resized.reshape(new[0] * new[1], d).astype(posemb.dtype)])


class VisionEncoder(nn.Module):
    """The token sequence [B, S, D] through `num_encoder_layers` encoder blocks (no mask), then
    the final norm of pre-LN: [B, S, D]."""

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array]

    @nn.compact
    def __call__(self, x, *, deterministic=True):
        return encoder_stack(self, x, None, None, None, deterministic)


class VisionTransformer(nn.Module):
    """`__call__(images [B, image_size, image_size, num_channels], deterministic=True) ->
    logits [B, num_classes]` float32 (module docstring). Applied with
    `mutable=["intermediates"]`, each layer's attention weights [B, N, S, S] are recorded as
    `intermediates/encoder/layers_{i}/self_attention/attention_weights`."""

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] | None = None  # default: dot_product_attention

    @nn.compact
    def __call__(self, images, *, deterministic=True):
        cfg = self.config
        expected = (cfg.image_size, cfg.image_size, cfg.num_channels)
        if tuple(images.shape[1:]) != expected:
            raise ValueError(f"images of shape {tuple(images.shape[1:])} given to a model of "
                             f"model.image_size={cfg.image_size}, num_channels="
                             f"{cfg.num_channels}: want {expected}")
        dtype = cfg.compute_dtype
        d = cfg.d_model
        patches = patchify(images.astype(dtype), cfg.patch_size)
        kernel, bias = Weights((patches.shape[-1], d), (None, "embed"), name="patch_embedding")()
        x = jnp.einsum("BSQ,QD->BSD", patches, kernel.astype(dtype)) + bias.astype(dtype)
        if cfg.pooling == "cls":
            token = self.param("class_token",
                               nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                               (d,))
            x = jnp.concatenate([jnp.broadcast_to(token.astype(dtype), (x.shape[0], 1, d)), x],
                                axis=1)
        if cfg.positional == "learned":
            table = self.param("position_embedding", nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("length", "embed")), (x.shape[1], d))
            x = x + table.astype(dtype)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", None))
        attention_fn = self.attention_fn or functools.partial(
            attention.dot_product_attention,
            implementation=cfg.dense_attention_implementation)
        x = VisionEncoder(cfg, attention_fn, name="encoder")(x, deterministic=deterministic)
        pooled = x[:, 0] if cfg.pooling == "cls" else jnp.mean(x, axis=1)
        return ClassifierHead(cfg, name="head")(pooled)

