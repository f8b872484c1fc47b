"""The families with q/k normalisation (transformer/huggingface/llama.py, families.py,
gemma.py): Qwen3 (each head's query and key RMS-normalised), OLMo 2 (all heads' together, and
each sublayer's output normalised), Qwen3 MoE and Gemma 3 (text). Tiny random models built by
`transformers` (nothing downloaded), their norm scales drawn at random so that a dropped or
misplaced norm shows: imported, the logits and greedy tokens are transformers', the sharded
forward pass on a 2x2x2 mesh too, and export gives their tensors back bit for bit."""

import json
import re

import jax
import numpy as np
import pytest
from test_huggingface import (
    ATOL,
    SPECIAL,
    TOKENS,
    _check_language_model,
    _check_round_trip,
    _hf_logits,
    _import,
    _prefill_logits,
    _save,
)

from transformer.huggingface import convert, families
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer
from transformer.parallel import sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# head_dim 16 is not hidden_size / heads (8): the norms' sizes and the heads' split both show.
SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, **SPECIAL)


def _build(hf_dir, config_class, model_class, offset=1.0, **kwargs):
    """A tiny `model_class`, its norm weights drawn around `offset` (1: a plain RMSNorm's
    scale; 0: Gemma's, which stores scale - 1), saved to `hf_dir`."""
    torch.manual_seed(0)
    model = model_class(config_class(**SIZES | kwargs))
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.endswith("norm.weight"):
                value.normal_(offset, 0.3)
    return _save(model, hf_dir)


def _run_model(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "config.json").read_text())["model"]


def _check_on_mesh(hf_dir, hf_model):
    """The checkpoint read straight onto a 2x2x2 (data, fsdp, tensor) mesh: the sharded
    forward pass gives transformers' logits."""
    hf = convert.read_json(str(hf_dir / convert.HF_CONFIG), "")
    family = families.for_checkpoint(hf, "")
    config = TransformerConfig(**family.config(hf), dtype="float32")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = convert.read_params(convert.TensorReader(str(hf_dir)), family, config, mesh)
    with jax.set_mesh(mesh):
        ours = _prefill_logits(Transformer(config), params, TOKENS)
    valid = TOKENS != 0
    np.testing.assert_allclose(np.asarray(ours)[valid], _hf_logits(hf_model, TOKENS)[valid],
                               atol=ATOL, rtol=0)


def _check_family(tmp_path, hf_dir, hf_model, model_class):
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, model_class)
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))
    _check_on_mesh(hf_dir, hf_model)
    return json.loads((tmp_path / "exported" / convert.HF_CONFIG).read_text())


@pytest.mark.parametrize("window", [None, 4], ids=["global", "local_and_global"])
def test_qwen3_logits_generation_mesh_and_round_trip(tmp_path, window):
    """Qwen3: Qwen2 without the biases, with an RMSNorm of each query and key head; with
    `use_sliding_window`, its global first and windowed later layers."""
    hf_dir = tmp_path / "qwen3"
    options = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) \
        if window else {}
    hf_model = _build(hf_dir, transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                      **options)
    exported = _check_family(tmp_path, hf_dir, hf_model, transformers.Qwen3ForCausalLM)
    run = _run_model(tmp_path)
    assert (run["qk_norm"], run["qkv_bias"], run["attention_pattern"]) == (
        "head", False, "global,local" if window else "global")
    assert exported["model_type"] == "qwen3"
    assert exported["layer_types"] == hf_model.config.layer_types


def test_olmo2_logits_generation_mesh_and_round_trip(tmp_path):
    """OLMo 2: no norm before a sublayer, one after it inside the residual branch, and the
    queries' and keys' RMSNorms over all their heads at once."""
    hf_dir = tmp_path / "olmo2"
    hf_model = _build(hf_dir, transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                      head_dim=8)  # OLMo 2's is D / N
    exported = _check_family(tmp_path, hf_dir, hf_model, transformers.Olmo2ForCausalLM)
    run = _run_model(tmp_path)
    assert (run["qk_norm"], run["norm_position"]) == ("full", "output")
    assert exported["model_type"] == "olmo2"


def test_qwen3_moe_logits_generation_mesh_and_round_trip(tmp_path):
    """Qwen3 MoE: Qwen3's attention, 4 experts of their own width (moe_intermediate_size),
    top-2 without renormalising (norm_topk_prob=False, transformers' default), a router sharp
    enough that tokens go to every expert."""
    hf_dir = tmp_path / "qwen3_moe"
    hf_model = _build(hf_dir, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=False)
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor(TOKENS), output_router_logits=True)
    chosen = np.stack([torch.topk(logits, 2, dim=-1).indices.numpy()
                       for logits in out.router_logits])
    assert set(chosen.reshape(-1).tolist()) == {0, 1, 2, 3}
    exported = _check_family(tmp_path, hf_dir, hf_model, transformers.Qwen3MoeForCausalLM)
    run = _run_model(tmp_path)
    assert (run["qk_norm"], run["num_experts"], run["d_ff"], run["moe_renormalize"]) == (
        "head", 4, 24, False)
    assert (exported["model_type"], exported["num_experts"], exported["norm_topk_prob"]) == (
        "qwen3_moe", 4, False)


def test_qwen3_moe_dense_and_routed_layers_from_fused_experts(tmp_path):
    """Every second layer routed (decoder_sparse_step=2; the dense one as wide as the
    experts), the checkpoint in `transformers` 5's in-memory layout (its `state_dict` saved as
    it is: mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]): imported with
    transformers' logits, exported per expert as `save_pretrained` writes it."""
    from safetensors.torch import save_file

    hf_dir = tmp_path / "qwen3_moe"
    hf_model = _build(hf_dir, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      decoder_sparse_step=2, norm_topk_prob=True)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / convert.HF_CONFIG).write_text((hf_dir / convert.HF_CONFIG).read_text())
    state = {name: value.contiguous() for name, value in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    assert "model.layers.0.mlp.gate_proj.weight" in state  # the dense layer
    save_file(state, str(fused_dir / convert.SINGLE_FILE), metadata={"format": "pt"})
    workdir, run, params = _import(tmp_path, fused_dir)
    assert (run.model.moe_layer_interval, run.model.moe_renormalize) == (2, True)
    ours = _prefill_logits(Transformer(run.model), params, TOKENS)
    valid = TOKENS != 0
    np.testing.assert_allclose(np.asarray(ours)[valid], _hf_logits(hf_model, TOKENS)[valid],
                               atol=ATOL, rtol=0)
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.Qwen3MoeForCausalLM)


GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def test_gemma3_logits_generation_mesh_and_round_trip(tmp_path):
    """Gemma 3 (text): Gemma 2's sandwich norms, scale - 1 stored, query_pre_attn_scalar
    other than its head dim, no soft-capping, each query and key head RMS-normalised, a local
    layer (window 4, RoPE base 10k) and a global one (base 1M, scaled linearly as Gemma 3
    4B's)."""
    hf_dir = tmp_path / "gemma3"
    hf_model = _build(hf_dir, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                      offset=0.0, query_pre_attn_scalar=24, sliding_window=4,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_parameters=GEMMA3_ROPE)
    exported = _check_family(tmp_path, hf_dir, hf_model, transformers.Gemma3ForCausalLM)
    run = _run_model(tmp_path)
    assert (run["qk_norm"], run["attention_pattern"], run["attention_window"],
            run["rope_local_theta"], run["rope_theta"], run["rope_scaling"],
            run["logits_softcap"]) == ("head", "local,global", 3, 10000.0, 1e6, "linear", None)
    assert exported["model_type"] == "gemma3_text"
    assert exported["rope_parameters"] == hf_model.config.rope_parameters


def _config(config_class, **kwargs) -> dict:
    return config_class(**SIZES | kwargs).to_dict()


@pytest.mark.parametrize("config_class, change, message", [
    ("Qwen3Config", {"attention_bias": True}, "qwen3 option attention_bias=True"),
    ("Olmo2Config", {"attention_bias": True}, "olmo2 option attention_bias=True"),
    ("Qwen3MoeConfig", {"mlp_only_layers": [0]}, "qwen3_moe option mlp_only_layers=[0]"),
    ("Qwen3MoeConfig", {"decoder_sparse_step": 2, "moe_intermediate_size": 24},
     "qwen3_moe option decoder_sparse_step=2"),
    ("Gemma3TextConfig", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "gemma3_text option rope_type='linear'"),
])
def test_unsupported_variants_are_one_line_errors(config_class, change, message):
    hf = _config(getattr(transformers, config_class)) | change
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        families.for_checkpoint(hf, "config.json").config(hf)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("change, message", [
    (dict(qk_norm="rms"), "model.qk_norm='rms' is not one of none, head, full"),
    (dict(rope_local_theta=1e4), "model.rope_local_theta=10000.0 is the RoPE base of local"),
    (dict(rope_local_theta=-1.0, attention_window=3, attention_pattern="local,global"),
     "model.rope_local_theta=-1.0 must be positive"),
    (dict(norm_position="middle"), "model.norm_position='middle' is not one of post, pre, "
                                   "output"),
])
def test_bad_qk_norm_settings_are_one_line_errors(change, message):
    fields = families.Llama.config(_config(transformers.Qwen3Config)) | change
    with pytest.raises(ValueError, match=re.escape(message)):
        TransformerConfig(**fields)


def test_export_picks_each_family_and_refuses_what_none_computes():
    """A Qwen3 without its q/k norm is a Llama, an OLMo 2 norm position with Qwen3's per-head
    norm is none of them (OLMo 2 normalises all heads together)."""
    picks = {"Qwen3Config": families.Llama, "Olmo2Config": families.Olmo2,
             "Qwen3MoeConfig": families.Qwen3Moe, "Gemma3TextConfig": families.Gemma3}
    for name, family in picks.items():
        hf = _config(getattr(transformers, name))
        assert families.for_model(TransformerConfig(**family.config(hf)), "w") is family
        assert family.hf_config(TransformerConfig(**family.config(hf)))["model_type"] == (
            hf["model_type"])
    qwen3 = families.Llama.config(_config(transformers.Qwen3Config))
    assert families.Llama.hf_config(TransformerConfig(**qwen3 | dict(qk_norm="none")))[
        "model_type"] == "llama"
    olmo2 = families.Olmo2.config(_config(transformers.Olmo2Config, head_dim=8))
    with pytest.raises(ValueError, match=re.escape(  # closest: Qwen3's per-head norm
            "closest is Llama, which differs in model.norm_position='output' (wants 'pre')")):
        families.for_model(TransformerConfig(**olmo2 | dict(qk_norm="head")), "--workdir=w")


def test_gemma3_config_of_the_older_format_reads_the_same():
    """A Gemma 3 config.json as the Hub's first releases wrote it (rope_theta, rope_scaling and
    rope_local_base_freq at the top, sliding_window_pattern instead of layer_types) gives the
    model fields of transformers 5's per-layer-type rope_parameters."""
    hf = _config(transformers.Gemma3TextConfig, num_hidden_layers=7, query_pre_attn_scalar=24,
                 sliding_window=4, rope_parameters=GEMMA3_ROPE)
    old = {key: value for key, value in hf.items() if key not in (
        "rope_parameters", "layer_types")} | dict(
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=10000.0, sliding_window_pattern=6)
    fields = families.Gemma3.config(old)
    assert fields == families.Gemma3.config(hf)
    assert (fields["attention_pattern"], fields["rope_local_theta"], fields["rope_theta"]) == (
        "local,local,local,local,local,global,local", 10000.0, 1e6)
