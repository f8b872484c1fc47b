"""Positional encodings, normalisation and the position-wise feed-forward network, as pure
functions of arrays (no Flax). Shapes are written in the package's legend
(`transformer/__init__.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("relu", "gelu", "swiglu")


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout: zeroes each element with probability `rate`, scales the rest by
    1 / (1 - rate). The identity when rate is 0."""
    if rate == 0.0:
        return x
    if rng is None:
        raise ValueError(f"dropout rate {rate} > 0 needs a dropout rng")
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def sinusoidal_position_encoding(length: int, d_model: int) -> jax.Array:
    """[T, D] float32, the paper's section 3.5, interleaved as the formula writes it:

        PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
        PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))
    """
    position = jnp.arange(length, dtype=jnp.float32)[:, None]  # [T, 1]
    two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)  # [ceil(D/2)]
    angle = position / jnp.power(10000.0, two_i / d_model)  # [T, ceil(D/2)]
    pe = jnp.zeros((length, d_model), jnp.float32)
    pe = pe.at[:, 0::2].set(jnp.sin(angle))
    return pe.at[:, 1::2].set(jnp.cos(angle[:, : d_model // 2]))


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (Su et al.) of x [B, T, N, H] at positions [B, T].

    Rotates the pairs (i, i + H/2) (half-split, the Llama/NeoX convention) by the angle
    positions * base^(-2i/H), so that q_m . k_n depends on positions only through m - n.
    """
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"RoPE needs an even head dim, got H={h}")
    inv_freq = base ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *,
               eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last axis (Ba et al.), statistics in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis (Zhang & Sennrich), in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def feed_forward(
    x: jax.Array,
    ff_in: jax.Array,
    ff_out: jax.Array,
    *,
    ff_gate: jax.Array | None = None,
    bias_in: jax.Array | None = None,
    bias_out: jax.Array | None = None,
    activation: str = "relu",
    gelu_approximate: bool = True,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Position-wise FFN of x [B, T, D] with ff_in [D, F], ff_out [F, D] (paper eq. 2):

        relu:   FFN(x) = max(0, x W1 + b1) W2 + b2
        gelu:   GELU(x W1 + b1) W2 + b2   (tanh approximation, or exact erf when
                                           `gelu_approximate` is False)
        swiglu: (Swish(x W_gate) * x W1) W2   (Shazeer 2020; needs ff_gate [D, F])

    `dropout_rate` drops the hidden activations ("ReLU dropout"; 0 in the paper).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; choose one of {ACTIVATIONS}")
    if (activation == "swiglu") != (ff_gate is not None):
        raise ValueError("ff_gate is required by activation='swiglu' and only by it")
    hidden = jnp.einsum("...D,DF->...F", x, ff_in)
    if bias_in is not None:
        hidden = hidden + bias_in
    if activation == "relu":
        hidden = jax.nn.relu(hidden)
    elif activation == "gelu":
        hidden = jax.nn.gelu(hidden, approximate=gelu_approximate)
    else:
        hidden = jax.nn.silu(jnp.einsum("...D,DF->...F", x, ff_gate)) * hidden
    hidden = dropout(hidden, dropout_rate, dropout_rng)
    out = jnp.einsum("...F,FD->...D", hidden, ff_out)
    if bias_out is not None:
        out = out + bias_out
    return out
