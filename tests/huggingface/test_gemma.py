"""Gemma 2 (transformer/huggingface/gemma.py): a tiny random `Gemma2ForCausalLM` (nothing
downloaded) with soft-capping tight enough to matter, a query_pre_attn_scalar other than its
head dim, random norm weights (stored as scale - 1) and a window of 4 keys in its local
layers: imported, its logits and greedy tokens are ours, export gives its tensors back."""

import dataclasses
import json

import flax
import flax.linen as nn
import jax
import numpy as np
import pytest
from test_huggingface import (
    SPECIAL,
    TOKENS,
    _check_language_model,
    _check_round_trip,
    _hf_logits,
    _save,
)

from transformer.huggingface import convert, families
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GEMMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=24, max_position_embeddings=64, sliding_window=4,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.2,
             **SPECIAL)


def test_gemma2_logits_generation_and_round_trip(tmp_path):
    hf_dir = tmp_path / "gemma2"
    torch.manual_seed(0)
    hf_model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA))
    with torch.no_grad():
        for name, value in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                value.normal_(0.0, 0.3)
    _save(hf_model, hf_dir)
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    run = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (run["attention_pattern"], run["attention_window"], run["activation"]) == (
        "local,global,local", 3, "geglu")
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.Gemma2ForCausalLM)
    assert reloaded.config.layer_types == hf_model.config.layer_types
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def test_without_the_caps_or_the_post_norms_the_logits_differ():
    """The caps, the attention scale and the post-sublayer norms each change the numbers,
    so the test above would see one dropped: the post norms left out, or their scales ignored
    (left at 1: Gemma stores scale - 1, which the test above draws at random)."""
    hf = transformers.Gemma2Config(**GEMMA).to_dict()
    fields = families.Gemma2.config(hf)
    cfg = TransformerConfig(**fields, dtype="float32")
    assert (cfg.attention_logit_softcap, cfg.logits_softcap, cfg.attention_scale) == (
        2.0, 3.0, pytest.approx(24 ** -0.5))  # float64 either way: approx's 1e-6 for form
    assert cfg.post_sublayer_norm and cfg.norm_scale_offset == 1.0
    params = nn.unbox(Transformer(cfg).init(jax.random.key(0), None, TOKENS[:, :4])["params"])
    params = jax.tree.map(lambda x: x * 3.0, params)
    post = [path for path, _ in flax.traverse_util.flatten_dict(params, sep="/").items()
            if "/post_norm_" in path]
    assert len(post) == 2 * GEMMA["num_hidden_layers"], post  # attention and ffn, a layer
    stored = jax.random.normal(jax.random.key(1), (len(post), GEMMA["hidden_size"])) * 0.3
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    flat |= {path: stored[i] for i, path in enumerate(post)}  # scales 1 + N(0, 0.3)
    params = flax.traverse_util.unflatten_dict(flat, sep="/")

    def logits(params=params, **change):
        model = Transformer(dataclasses.replace(cfg, **change))
        return np.asarray(model.apply({"params": params}, None, TOKENS))

    base = logits()
    unit_scales = flax.traverse_util.unflatten_dict(
        flat | {path: np.zeros_like(flat[path]) for path in post}, sep="/")
    for change in (dict(attention_logit_softcap=None), dict(logits_softcap=None),
                   dict(attention_scale_dim=None), dict(post_sublayer_norm=False),
                   dict(params=unit_scales)):
        # float32 logits of size ~3 (the cap) agree to ~1e-6; a dropped part moves them by
        # more than 1e-2
        assert np.abs(logits(**change) - base).max() > 1e-2, change


@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"sliding_window": 1}, "sliding_window=1"),
])
def test_unsupported_gemma2_variants_are_one_line_errors(tmp_path, change, message):
    hf_dir = tmp_path / "gemma2"
    torch.manual_seed(0)
    _save(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA)), hf_dir)
    config = json.loads((hf_dir / convert.HF_CONFIG).read_text())
    (hf_dir / convert.HF_CONFIG).write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=message):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "run"))
