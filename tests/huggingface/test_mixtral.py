"""Mixtral (transformer/huggingface/families.py): a tiny random `MixtralForCausalLM` (nothing
downloaded; 2 layers, 4 experts, top-2, a router sharp enough that the choices differ from
token to token): imported, its logits and greedy tokens are ours, export gives its tensors
and options back and `from_pretrained` loads them."""

import json
import re

import numpy as np
import pytest
from conftest import params_run
from test_huggingface import (
    ATOL,
    SPECIAL,
    TOKENS,
    _check_language_model,
    _check_round_trip,
    _hf_logits,
    _prefill_logits,
    _save,
)

from transformer.huggingface import convert, families

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MIXTRAL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
               initializer_range=0.2, **SPECIAL)


def _mixtral(path, **kwargs):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL, **kwargs))
    return _save(model, path)


def _routed_experts(model, tokens):
    """Each layer's top-2 experts [layers, tokens, 2] for `tokens`, as `transformers` picks."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), output_router_logits=True)
    return np.stack([torch.topk(logits, 2, dim=-1).indices.numpy()
                     for logits in out.router_logits])


@pytest.mark.parametrize("window", [None, 4], ids=["global", "sliding_window"])
def test_mixtral_logits_generation_and_round_trip(tmp_path, window):
    hf_dir = tmp_path / "mixtral"
    hf_model = _mixtral(hf_dir, sliding_window=window)
    # The router sends tokens to every expert and pairs differ: a wrong expert order or a
    # gate/up swap would change the logits.
    chosen = _routed_experts(hf_model, TOKENS)
    assert set(chosen.reshape(-1).tolist()) == {0, 1, 2, 3}
    assert len({tuple(sorted(pair)) for pair in chosen.reshape(-1, 2).tolist()}) > 2
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    run = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (run["num_experts"], run["experts_per_token"], run["moe_renormalize"],
            run["moe_capacity_factor"], run["attention_window"]) == (
        4, 2, True, 0.0, None if window is None else window - 1)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.MixtralForCausalLM)
    exported = json.loads((tmp_path / "exported" / convert.HF_CONFIG).read_text())
    original = json.loads((hf_dir / convert.HF_CONFIG).read_text())
    for key in ("model_type", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "router_aux_loss_coef", "rope_parameters"):
        assert exported[key] == original[key], key
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def test_mixtral_with_fused_experts_imports_and_exports_per_expert(tmp_path):
    """A checkpoint holding `transformers` 5's in-memory layout (its `state_dict` saved as it
    is: mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F], mlp.gate), which
    `from_pretrained` reads too, imports with transformers' logits and greedy tokens; export
    writes the Hub's per-expert layout, tensors equal to `save_pretrained`'s."""
    from safetensors.torch import save_file

    hf_dir = tmp_path / "mixtral"
    fused_dir = tmp_path / "fused"
    hf_model = _mixtral(hf_dir)
    fused_dir.mkdir()
    (fused_dir / convert.HF_CONFIG).write_text((hf_dir / convert.HF_CONFIG).read_text())
    state = {name: value.contiguous() for name, value in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused_dir / convert.SINGLE_FILE), metadata={"format": "pt"})
    workdir = _check_language_model(tmp_path, hf_model, fused_dir)
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.MixtralForCausalLM)


@pytest.mark.parametrize("change, message", [
    ({"router_jitter_noise": 0.01}, "mixtral option router_jitter_noise=0.01"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_mixtral_variants_are_one_line_errors(tmp_path, change, message):
    hf_dir = tmp_path / "mixtral"
    _mixtral(hf_dir)
    config = json.loads((hf_dir / convert.HF_CONFIG).read_text())
    (hf_dir / convert.HF_CONFIG).write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "run"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, message", [
    (dict(moe_renormalize=False), "model.moe_renormalize=False (wants True)"),
    (dict(moe_router_scores="sigmoid"), "model.moe_router_scores='sigmoid'"),
    (dict(moe_shared_expert=True), "model.moe_shared_expert=True (wants False)"),
    (dict(moe_layer_interval=2), "model.moe_layer_interval=2 (wants 1)"),
])
def test_routing_mixtral_does_not_compute_is_refused_on_export(change, message):
    """Export picks Mixtral only for its routing; a dense model is never taken for one, nor
    a routed one for a Llama."""
    from transformer.model.config import TransformerConfig

    fields = families.Mixtral.config(transformers.MixtralConfig(**MIXTRAL).to_dict())
    assert families.for_model(TransformerConfig(**fields), "w") is families.Mixtral
    dense = TransformerConfig(**fields | dict(num_experts=0))
    assert families.for_model(dense, "w") is families.Llama
    with pytest.raises(ValueError, match=re.escape(message)):
        families.for_model(TransformerConfig(**fields | change), "--workdir=w")


def test_routed_language_model_trained_here_exports_to_mixtral(tmp_path, load_config):
    """An lm_default run with 4 experts, top-2 (embedding scaled by sqrt(D), untied, scanned
    layers) exports as a Mixtral whose logits are ours."""
    import flax.linen as nn
    import jax

    from transformer.config import resolve
    from transformer.model.transformer import Transformer

    cfg = load_config("lm_default.py", **{
        "data.vocab_size": 128, "model.num_decoder_layers": 2, "model.d_model": 32,
        "model.d_ff": 48, "model.num_heads": 4, "model.num_kv_heads": 2, "model.max_len": 64,
        "model.scan_layers": True, "model.num_experts": 4, "model.experts_per_token": 2})
    run = resolve(cfg)
    model = Transformer(run.model)
    tokens = jax.numpy.ones((1, 1), jax.numpy.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens, tokens)["params"])
    params["decoder"]["layers"]["moe"]["router"] *= 4.0  # choices that differ between tokens
    workdir = params_run(tmp_path / "run", cfg, params)
    convert.export_workdir(str(workdir), str(tmp_path / "hf"))
    hf_model = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    chosen = _routed_experts(hf_model, TOKENS)
    assert len({tuple(sorted(pair)) for pair in chosen.reshape(-1, 2).tolist()}) > 2
    valid = TOKENS != 0
    np.testing.assert_allclose(_hf_logits(hf_model, TOKENS)[valid],
                               np.asarray(_prefill_logits(model, params, TOKENS))[valid],
                               atol=ATOL, rtol=0)
