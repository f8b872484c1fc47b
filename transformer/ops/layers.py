"""Positional encodings, normalisation and the position-wise feed-forward network, as pure
functions of arrays (no Flax). Shapes are written in the package's legend
(`transformer/__init__.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ACTIVATIONS = ("relu", "gelu", "silu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")  # the activations with a gate projection (ff_gate)
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # rope_inverse_frequencies' `scaling`


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


def rope_inverse_frequencies(head_dim: int, *, base: float = 10000.0, scaling: str = "none",
                             factor: float = 1.0, original_max_len: int | None = None,
                             low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                             beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """RoPE's inverse frequencies [H/2] float32, base^(-2i/H), rescaled for a context longer
    than the one trained on (`scaling`, as `transformers`' rope_type names them):

        none    as they are
        linear  all divided by `factor` (position interpolation, Chen et al. 2023)
        llama3  wavelengths 2 pi / f above original_max_len / low_freq_factor divided by
                `factor`, below original_max_len / high_freq_factor kept, smoothly blended
                between (Llama 3.1)
        yarn    blended per dimension from interpolated (f / factor) to kept, over the
                dimensions that turn between beta_slow and beta_fast times within
                original_max_len (Peng et al. 2023). Pair with `yarn_attention_factor`
    Computed in float32 numpy in the order `transformers` computes them."""
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"RoPE scaling {scaling!r}; choose one of {ROPE_SCALINGS}")
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    powers = np.float32(base) ** exponents
    inv_freq = (np.float32(1.0) / powers).astype(np.float32)
    if scaling == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32)
    if scaling == "llama3":
        low_wavelen = original_max_len / low_freq_factor
        high_wavelen = original_max_len / high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = ((np.float32(original_max_len) / wavelen - np.float32(low_freq_factor))
                  / np.float32(high_freq_factor - low_freq_factor))
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if scaling == "yarn":
        def turning_dim(rotations):  # the dimension turning `rotations` times in the context
            return (head_dim * math.log(original_max_len / (rotations * 2 * math.pi))
                    / (2 * math.log(base)))
        low = max(math.floor(turning_dim(beta_fast)), 0)
        high = min(math.ceil(turning_dim(beta_slow)), head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        kept = np.float32(1) - ramp.astype(np.float32)
        interpolated = np.float32(1.0) / (np.float32(factor) * powers)
        return (interpolated * (1 - kept) + inv_freq * kept).astype(np.float32)
    return inv_freq


def yarn_attention_factor(factor: float) -> float:
    """YaRN's scale of cos and sin (so of the attention logits, squared): 0.1 ln(factor) + 1
    for factor > 1, else 1."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0,
               inv_freq: np.ndarray | jax.Array | None = None, scale: float = 1.0) -> jax.Array:
    """Rotary position embedding (Su et al.) of x [B, T, N, H] at positions [B, T].

    Rotates the pairs (i, i + H/2) (half-split, the Llama/NeoX convention) by the angle
    positions * base^(-2i/H), so that q_m . k_n depends on positions only through m - n.
    `inv_freq` [H/2] replaces base^(-2i/H) (a scaled RoPE: `rope_inverse_frequencies`);
    `scale` multiplies cos and sin (YaRN's attention factor).
    """
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"RoPE needs an even head dim, got H={h}")
    if inv_freq is None:
        inv_freq = base ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, H/2]
    sin = jnp.sin(angle)
    cos = jnp.cos(angle)
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *,
               eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last axis (Ba et al.), statistics in float32. Returns x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis (Zhang & Sennrich), in float32. Returns x's dtype."""
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
    branches: dict[str, Callable[[jax.Array], jax.Array] | None] | None = None,
) -> jax.Array:
    """Position-wise FFN of x [B, T, D] with ff_in [D, F], ff_out [F, D] (paper eq. 2):

        relu:   FFN(x) = max(0, x W1 + b1) W2 + b2
        gelu:   GELU(x W1 + b1) W2 + b2   (tanh approximation, or exact erf when
                                           `gelu_approximate` is False)
        silu:   Swish(x W1 + b1) W2 + b2  (Marian's "swish", ungated)
        swiglu: (Swish(x W_gate) * x W1) W2   (Shazeer 2020; needs ff_gate [D, F])
        geglu:  (GELU(x W_gate) * x W1) W2    (GELU as `gelu_approximate`; Gemma's)

    `dropout_rate` drops the hidden activations ("ReLU dropout"; 0 in the paper).
    `branches` maps a projection's name ("ff_in", "ff_gate", "ff_out") to None or a function of
    its input whose output is added to the projection's (a LoRA adapter beside the kernel).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; choose one of {ACTIVATIONS}")
    if (activation in GATED) != (ff_gate is not None):
        raise ValueError(f"ff_gate is required by activation in {GATED} and only by them")
    branches = branches or {}

    def project(name, inputs, kernel, spec):
        y = jnp.einsum(spec, inputs, kernel)
        return y if branches.get(name) is None else y + branches[name](inputs)

    hidden = project("ff_in", x, ff_in, "...D,DF->...F")
    if bias_in is not None:
        hidden = hidden + bias_in
    if activation == "relu":
        hidden = jax.nn.relu(hidden)
    elif activation == "gelu":
        hidden = jax.nn.gelu(hidden, approximate=gelu_approximate)
    elif activation == "silu":
        hidden = jax.nn.silu(hidden)
    elif activation == "swiglu":
        hidden = jax.nn.silu(project("ff_gate", x, ff_gate, "...D,DF->...F")) * hidden
    else:
        gate = project("ff_gate", x, ff_gate, "...D,DF->...F")
        hidden = jax.nn.gelu(gate, approximate=gelu_approximate) * hidden
    hidden = dropout(hidden, dropout_rate, dropout_rng)
    out = project("ff_out", hidden, ff_out, "...F,FD->...D")
    if bias_out is not None:
        out = out + bias_out
    return out
