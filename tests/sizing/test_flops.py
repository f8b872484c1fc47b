"""Parameter and FLOPs accounting against formulas written out by hand; the paper configs and
the summary built on them."""

import dataclasses

import jax.numpy as jnp
import pytest

from transformer.config import LORA_KEYS, resolve
from transformer.model.config import VISION_FIELDS
from transformer.model.transformer import TransformerConfig
from transformer.ops import masks
from transformer.parallel import sharding
from transformer.sizing import activations, flops, summary

BASE = TransformerConfig(vocab_size=37000)
BIG = TransformerConfig(vocab_size=37000, d_model=1024, d_ff=4096, num_heads=16)


def paper_param_count(v, d, f, n_layers=6):
    """The paper's encoder-decoder with shared embeddings and tied logits, biases included."""
    attention = 4 * (d * d + d)  # q, k, v, out kernels and biases
    ffn = d * f + f + f * d + d
    norm = 2 * d  # scale and bias
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = encoder_layer + attention + norm  # cross-attention and its norm
    return v * d + n_layers * (encoder_layer + decoder_layer)


def test_base_params_match_paper_count():
    counts = flops.param_counts(BASE)
    assert counts["total"] == 63_082_496 == paper_param_count(37000, 512, 2048)
    assert counts["embedding"] == 37000 * 512
    assert counts["logits"] == counts["source_embedding"] == counts["position_embedding"] == 0
    assert sum(v for k, v in counts.items() if k != "total") == counts["total"]


def test_big_params_match_paper_count():
    total = flops.param_counts(BIG)["total"]
    assert total == paper_param_count(37000, 1024, 4096) == 214_245_376


def test_untied_learned_decoder_only_groups():
    cfg = TransformerConfig(architecture="decoder", vocab_size=100, d_model=16, d_ff=32,
                            num_heads=2, num_decoder_layers=2, max_len=10,
                            positional="learned", tie_output_embedding=False,
                            norm_position="pre", scan_layers=True)
    counts = flops.param_counts(cfg)
    d = 16
    f = 32
    layer = 4 * (d * d + d) + (2 * d * f + f + d) + 2 * 2 * d
    assert counts["encoder"] == 0
    assert counts["position_embedding"] == 10 * d
    assert counts["logits"] == d * 100
    assert counts["decoder"] == 2 * layer + 2 * d  # final pre-LN norm
    assert counts["total"] == 100 * d + 10 * d + d * 100 + 2 * layer + 2 * d


def test_unshared_embeddings_and_swiglu_gqa():
    cfg = TransformerConfig(vocab_size=50, d_model=16, d_ff=24, num_heads=4, num_kv_heads=2,
                            num_encoder_layers=1, num_decoder_layers=1, share_embeddings=False,
                            activation="swiglu", use_bias=False, norm="rms_norm")
    counts = flops.param_counts(cfg)
    d = 16
    f = 24
    h = 4
    attention = d * 4 * h + 2 * d * 2 * h + 4 * h * d
    ffn = 3 * d * f
    assert counts["source_embedding"] == counts["embedding"] == 50 * d
    assert counts["encoder"] == attention + ffn + 2 * d
    assert counts["decoder"] == 2 * attention + ffn + 3 * d


TINY = dict(vocab_size=11, d_model=8, d_ff=12, num_heads=2, num_encoder_layers=2,
            num_decoder_layers=3)


def test_tiny_encoder_decoder_flops_by_hand():
    cfg = TransformerConfig(**TINY)
    s = 5
    t = 7
    d = 8
    f = 12
    v = 11
    encoder_layer = 2 * s * d * d * 4 + 2 * s * s * d * 2 + 2 * s * d * f * 2
    decoder_self = 2 * t * d * d * 4 + 2 * t * t * d * 2 / 2  # causal: half the scores
    decoder_cross = 2 * t * d * d * 2 + 2 * s * d * d * 2 + 2 * t * s * d * 2
    decoder_layer = decoder_self + decoder_cross + 2 * t * d * f * 2
    forward = 2 * encoder_layer + 3 * decoder_layer + 2 * t * d * v
    assert flops.forward_flops(cfg, source_length=s, target_length=t)["total"] == forward
    per_token = flops.train_flops_per_token(cfg, source_length=s, target_length=t)
    assert per_token == pytest.approx(3 * forward / t)


@pytest.mark.parametrize("gated", ["swiglu", "geglu"])  # three FFN matmuls each
def test_tiny_decoder_only_and_encoder_only_flops(gated):
    s = 5
    t = 7
    d = 8
    f = 12
    v = 11
    decoder = TransformerConfig(**TINY, architecture="decoder", activation=gated)
    layer = 2 * t * d * d * 4 + 2 * t * t * d * 2 / 2 + 2 * t * d * f * 3
    forward = 3 * layer + 2 * t * d * v
    assert flops.train_flops_per_token(decoder, source_length=s, target_length=t) == (
        pytest.approx(3 * forward / t))
    encoder = TransformerConfig(**TINY, architecture="encoder")
    layer = 2 * s * d * d * 4 + 2 * s * s * d * 2 + 2 * s * d * f * 2
    forward = 2 * layer + 2 * s * d * v
    assert flops.train_flops_per_token(encoder, source_length=s, target_length=t) == (
        pytest.approx(3 * forward / s))


def test_tiny_gqa_flops_count_fewer_kv_projections():
    cfg = TransformerConfig(**dict(TINY, num_heads=4, num_kv_heads=1), d_k=4,
                            architecture="decoder")
    t = 7
    d = 8
    f = 12
    v = 11
    attention = 2 * t * d * 16 + 2 * t * d * 8 + 2 * t * 16 * d + 2 * t * t * 16 * 2 / 2
    forward = 3 * (attention + 2 * t * d * f * 2) + 2 * t * d * v
    assert flops.forward_flops(cfg, source_length=1, target_length=t)["total"] == forward


def test_base_flops_exact_and_near_six_n():
    per_token = flops.train_flops_per_token(BASE, source_length=64, target_length=64)
    # 384,983,040 with the decoder's causal T x T whole: its 6 layers' 2·64·64·512·2 halved
    assert per_token == 384_983_040 - 3 * 6 * (2 * 64 * 64 * 512 * 2 / 2) / 64
    counts = flops.param_counts(BASE)
    non_embedding = counts["total"] - counts["embedding"]
    attention_terms = 3 * 6 * (2 * 2 * 64 * 512) * 3  # encoder self, decoder self and cross
    assert 6 * non_embedding < per_token < 6 * counts["total"] + attention_terms


@pytest.mark.parametrize("name, total", [("wmt14_ende_base", 63_082_496),
                                         ("wmt14_ende_big", 214_245_376),
                                         ("wmt14_enfr_big", paper_param_count(32000, 1024, 4096))])
def test_paper_configs_build_the_paper_models(name, total, load_config):
    cfg = load_config(f"{name}.py")
    model = TransformerConfig.from_dict(cfg.model)
    text_fields = {f.name for f in dataclasses.fields(TransformerConfig)} - set(VISION_FIELDS)
    text_fields -= set(LORA_KEYS)  # set in the `finetune` section, copied in by resolve
    text_fields -= set(sharding.PIPELINE_KEYS)  # set in the `mesh` section, copied in alike
    assert text_fields == set(cfg.model)  # the paper's configs spell out every text setting
    assert model.vocab_size == cfg.data.vocab_size
    assert flops.param_counts(model)["total"] == total


def test_summary_of_the_base_config(load_config):
    cfg = load_config("wmt14_ende_base.py")
    text = summary.summarize(resolve(cfg))
    assert text.splitlines()[-1] == "total_params: 63082496"
    assert "layer.cross_attention" in text and "tied to embedding" in text
    per_token = flops.train_flops_per_token(TransformerConfig.from_dict(cfg.model),
                                            source_length=256, target_length=256)
    assert f"{per_token:.4g}" in text


def test_window_pairs_by_hand_and_as_the_mask_allows():
    # T = 8, window (2, 0): 1, 2, then 3 keys a query.
    assert flops.window_pairs(8, (2, 0)) == 1 + 2 + 3 * 6 == 21
    # (2, 2): 3, 4, 5, 5, 5, 5, 4, 3.
    assert flops.window_pairs(8, (2, 2)) == 34
    # 2 global tokens: rows 0 and 1 see all 8; row 2 keys 0..2, row 3 keys 0..3, rows 4..7
    # keys 0, 1 and their 3.
    assert flops.window_pairs(8, (2, 0), 2) == 16 + 3 + 4 + 5 * 4 == 43
    # Causal: global rows see keys up to their own only.
    assert flops.window_pairs(8, (2, 0), 2, causal=True) == 1 + 2 + 27 == 30
    assert flops.window_pairs(8, (10, 0)) == 36 and flops.window_pairs(8, (9, 9)) == 64
    for window, tokens in (((5, 3), 4), ((0, 0), 7), ((3, 0), 0)):
        mask = masks.make_local_mask(jnp.arange(23), jnp.arange(23), window, tokens)
        assert flops.window_pairs(23, window, tokens) == int(mask.sum())


LM_DIMS = dict(architecture="decoder", vocab_size=8000, num_encoder_layers=0,
               num_decoder_layers=2, d_model=256, d_ff=704, num_heads=4, num_kv_heads=2,
               activation="swiglu")


def test_local_global_and_linear_attention_flops_by_hand():
    """configs/lm_default.py's attention at T = 128 over 2 layers (N = 4, K = 2, H = Hv = 64)."""
    t = 128
    n = 4
    h = 64
    dense = TransformerConfig(**LM_DIMS)
    dense_core = 2 * t * t * n * (h + h) / 2  # causal: half the T x T scores
    assert flops.forward_flops(dense, source_length=1, target_length=t)[
        "attention_scores_values"] == 2 * dense_core
    # local,global with w = 32: the local layer's queries see 1 .. 32 keys, then 33.
    pairs = sum(range(1, 33)) + 33 * 96
    local = TransformerConfig(**LM_DIMS, attention_window=32, attention_pattern="local,global")
    got = flops.forward_flops(local, source_length=1, target_length=t)
    assert got["attention_scores_values"] == dense_core + 2 * pairs * n * (h + h)
    # + 4 global tokens: queries 4.. also see keys 0..3 where their window does not (33 .. 36:
    # 4 more keys from query 36 on, 1 .. 3 for queries 33 .. 35).
    with_global = dataclasses.replace(local, attention_global_tokens=4)
    pairs_global = pairs + 4 * (128 - 36) + 1 + 2 + 3
    assert flops.forward_flops(with_global, source_length=1, target_length=t)[
        "attention_scores_values"] == dense_core + 2 * pairs_global * n * (h + h)
    # Linear: one causal scan a layer in chunks of 64 (T = 100 pads to 128).
    linear = TransformerConfig(**LM_DIMS, attention_kind="linear")
    scan = 2 * 128 * (64 * n * (h + h) + n * h * (h + 1) + 2 * h * h)
    assert flops.forward_flops(linear, source_length=1, target_length=100)[
        "attention_scores_values"] == 2 * scan
    # An encoder scans both ways; the projections and everything else are unchanged.
    encoder = dataclasses.replace(linear, architecture="encoder", num_encoder_layers=2,
                                  num_decoder_layers=0)
    got = flops.forward_flops(encoder, source_length=100, target_length=1)
    assert got["attention_scores_values"] == 2 * 2 * scan
    dense_encoder = dataclasses.replace(encoder, attention_kind="softmax")
    expected = flops.forward_flops(dense_encoder, source_length=100, target_length=1)
    assert got["total"] - got["attention_scores_values"] == (
        expected["total"] - expected["attention_scores_values"])


def test_linear_attention_keeps_chunk_scores_not_the_attention_weights():
    """activations.activation_bytes: without remat each of the 2 layers of a decoder keeps the
    float32 weights N·T·T of "xla" softmax attention; linear attention keeps its chunks' scores
    N·T·C instead (C = 64): 2 layers x 4 bytes x 4·128·(128 - 64) fewer per row."""
    softmax = TransformerConfig(**LM_DIMS, attention_implementation="xla")
    linear = dataclasses.replace(softmax, attention_kind="linear")
    sizes = [activations.activation_bytes(cfg, rows=3, source_length=1, target_length=128)
             for cfg in (softmax, linear)]
    assert sizes[0] - sizes[1] == 3 * 2 * 4 * 4 * 128 * (128 - 64)


def test_the_text_classifier_counts_the_encoder_and_one_row_of_class_logits():
    dims = dict(vocab_size=100, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                num_classes=8, max_len=16)
    classifier = TransformerConfig(architecture="classifier", **dims)
    encoder = TransformerConfig(architecture="encoder", **dims)
    parts = flops.forward_flops(classifier, source_length=16, target_length=1)
    masked_lm = flops.forward_flops(encoder, source_length=16, target_length=1)
    assert parts["logits"] == 2 * 32 * 8
    assert parts["total"] - parts["logits"] == masked_lm["total"] - masked_lm["logits"]
    per_row = flops.train_flops_per_token(classifier, source_length=16, target_length=1)
    assert per_row == 3 * parts["total"]
