"""The Transformer of "Attention Is All You Need" in JAX/Flax.

The pure functions (`ops/`: attention, masks, layers; `inference/decoding.py`), the Linen modules
(`model/`) and their `TransformerConfig` import no TensorFlow:

    from transformer import dot_product_attention, TransformerConfig, Transformer
    from transformer import attention, masks, layers, decoding   # the pure-function modules

`transformer.load(workdir)` loads a trained translation run (`inference.translator.Translator`),
`transformer.load_generator(workdir)` a trained decoder-only language model
(`inference.generator.Generator`), `transformer.load_classifier(workdir)` a trained image
classifier (`inference.classifier.Classifier`). The layout: docs/architecture.md.

Shape legend, for the einsums, comments and docstrings of every module (one meaning a letter):

    B   batch                              D  d_model
    T   query / target length              F  d_ff
    S   key / value / source length        V  vocab
    N   query heads                        L  layers (the scan axis)
    K   kv heads                           W  beam size
    G   query heads per kv head (N / K)    R  rows of a decoding step (B, or B*W in beam search)
    H   head dim d_k                       A  microbatches per step (gradient accumulation)
    Hv  value head dim d_v (E in einsums)  C  chunk length (keys per block of chunked attention,
                                              positions per chunk of the projected loss)
"""

from transformer.inference import decoding  # noqa: F401 (a pure-function module, as named)
from transformer.model.blocks import DecoderBlock, EncoderBlock, MultiHeadAttention
from transformer.model.config import TransformerConfig
from transformer.model.transformer import (
    Decoder,
    Encoder,
    OutputHead,
    Transformer,
    grow_cache,
    init_cache,
    shift_right,
)
from transformer.ops import attention, layers, masks  # noqa: F401 (the pure-function modules)
from transformer.ops.attention import attention_weights, dot_product_attention
from transformer.ops.layers import (
    apply_rope,
    feed_forward,
    layer_norm,
    rms_norm,
    sinusoidal_position_encoding,
)
from transformer.ops.masks import (
    combine_masks,
    make_cache_mask,
    make_causal_mask,
    make_decoder_mask,
    make_global_mask,
    make_local_mask,
    make_padding_mask,
    make_prefix_lm_mask,
    make_segment_mask,
)


def __getattr__(name):
    """`transformer.load`, `load_generator` and `load_classifier` without importing orbax up
    front."""
    if name == "load":
        from transformer.inference.translator import load

        return load
    if name == "load_generator":
        from transformer.inference.generator import load_generator

        return load_generator
    if name == "load_classifier":
        from transformer.inference.classifier import load

        return load
    raise AttributeError(f"module 'transformer' has no attribute {name!r}")


__all__ = [
    "Decoder", "DecoderBlock", "Encoder", "EncoderBlock", "MultiHeadAttention", "OutputHead",
    "Transformer", "TransformerConfig", "apply_rope", "attention_weights", "combine_masks",
    "dot_product_attention", "feed_forward", "grow_cache", "init_cache", "layer_norm", "load",
    "load_classifier", "load_generator", "make_cache_mask", "make_causal_mask", "make_decoder_mask",
    "make_global_mask", "make_local_mask", "make_padding_mask",
    "make_prefix_lm_mask", "make_segment_mask",
    "rms_norm", "shift_right", "sinusoidal_position_encoding",
]
