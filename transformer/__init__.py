"""The Transformer of "Attention Is All You Need" in JAX/Flax.

The pure functions (`attention`, `layers`) and the Linen modules (`model`) import no TensorFlow:

    from transformer import dot_product_attention, TransformerConfig, Transformer

`transformer.load(workdir)` loads a trained translation run (`translator.Translator`),
`transformer.load_generator(workdir)` a trained decoder-only language model
(`generator.Generator`).
"""

from transformer.attention import (
    attention_weights,
    combine_masks,
    dot_product_attention,
    make_causal_mask,
    make_padding_mask,
    make_prefix_lm_mask,
    make_segment_mask,
)
from transformer.layers import (
    apply_rope,
    feed_forward,
    layer_norm,
    rms_norm,
    sinusoidal_position_encoding,
)
from transformer.model import (
    Decoder,
    DecoderBlock,
    Encoder,
    EncoderBlock,
    MultiHeadAttention,
    OutputHead,
    Transformer,
    TransformerConfig,
    init_cache,
    shift_right,
)


def __getattr__(name):
    """`transformer.load` and `transformer.load_generator` without importing orbax up front."""
    if name == "load":
        from transformer.translator import load

        return load
    if name == "load_generator":
        from transformer.generator import load_generator

        return load_generator
    raise AttributeError(f"module 'transformer' has no attribute {name!r}")


__all__ = [
    "Decoder", "DecoderBlock", "Encoder", "EncoderBlock", "MultiHeadAttention", "OutputHead",
    "Transformer", "TransformerConfig", "apply_rope", "attention_weights", "combine_masks",
    "dot_product_attention", "feed_forward", "init_cache", "layer_norm", "load", "load_generator",
    "make_causal_mask", "make_padding_mask", "make_prefix_lm_mask", "make_segment_mask",
    "rms_norm", "shift_right", "sinusoidal_position_encoding",
]
