"""Parameter and FLOPs accounting against formulas written out by hand; the paper configs and
the summary built on them."""

import dataclasses

import pytest

from transformer import flops, summary
from transformer.config import resolve
from transformer.model import TransformerConfig
from transformer.model_config import VISION_FIELDS

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
    d, f = 16, 32
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
    d, f, h = 16, 24, 4
    attention = d * 4 * h + 2 * d * 2 * h + 4 * h * d
    ffn = 3 * d * f
    assert counts["source_embedding"] == counts["embedding"] == 50 * d
    assert counts["encoder"] == attention + ffn + 2 * d
    assert counts["decoder"] == 2 * attention + ffn + 3 * d


TINY = dict(vocab_size=11, d_model=8, d_ff=12, num_heads=2, num_encoder_layers=2,
            num_decoder_layers=3)


def test_tiny_encoder_decoder_flops_by_hand():
    cfg = TransformerConfig(**TINY)
    s, t, d, f, v = 5, 7, 8, 12, 11
    encoder_layer = 2 * s * d * d * 4 + 2 * s * s * d * 2 + 2 * s * d * f * 2
    decoder_self = 2 * t * d * d * 4 + 2 * t * t * d * 2
    decoder_cross = 2 * t * d * d * 2 + 2 * s * d * d * 2 + 2 * t * s * d * 2
    decoder_layer = decoder_self + decoder_cross + 2 * t * d * f * 2
    forward = 2 * encoder_layer + 3 * decoder_layer + 2 * t * d * v
    assert flops.forward_flops(cfg, source_length=s, target_length=t)["total"] == forward
    per_token = flops.train_flops_per_token(cfg, source_length=s, target_length=t)
    assert per_token == pytest.approx(3 * forward / t)


def test_tiny_decoder_only_and_encoder_only_flops():
    s, t, d, f, v = 5, 7, 8, 12, 11
    decoder = TransformerConfig(**TINY, architecture="decoder", activation="swiglu")
    layer = 2 * t * d * d * 4 + 2 * t * t * d * 2 + 2 * t * d * f * 3
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
    t, d, f, v = 7, 8, 12, 11
    attention = 2 * t * d * 16 + 2 * t * d * 8 + 2 * t * 16 * d + 2 * t * t * 16 * 2
    forward = 3 * (attention + 2 * t * d * f * 2) + 2 * t * d * v
    assert flops.forward_flops(cfg, source_length=1, target_length=t)["total"] == forward


def test_base_flops_exact_and_near_six_n():
    per_token = flops.train_flops_per_token(BASE, source_length=64, target_length=64)
    assert per_token == 384_983_040
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
