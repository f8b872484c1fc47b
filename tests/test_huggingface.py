"""Hugging Face checkpoints in and out (transformer/huggingface): tiny random models built by
`transformers` itself (nothing downloaded), saved, imported; our logits equal theirs within
float32 rounding, greedy generation gives their tokens, export gives their tensors bit for bit.
"""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES
from safetensors.numpy import load_file

from transformer import checkpoint, sharding
from transformer import workdir as workdir_lib
from transformer.config import resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.generator import Generator, load_generator
from transformer.huggingface import convert, families
from transformer.model import Transformer, init_cache
from transformer.model_config import TransformerConfig
from transformer.vit import VisionTransformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIAL = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)  # ours (data/tokenizer.py)
TOKENS = np.array([[2, 17, 5, 99, 42, 7, 64, 11, 3, 90],
                   [2, 8, 120, 33, 33, 61, 0, 0, 0, 0]], np.int32)  # row 1 right-padded
ATOL = 2e-5  # float32 rounding of logits of size ~1 through two layers


def _save(model, path):
    torch.manual_seed(0)
    model.eval().save_pretrained(path)
    return model


def _llama(path, **kwargs):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, initializer_range=0.2, **SPECIAL, **kwargs)
    torch.manual_seed(0)
    return _save(transformers.LlamaForCausalLM(config), path)


def _gpt2(path):
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, initializer_range=0.2, **SPECIAL)
    torch.manual_seed(0)
    return _save(transformers.GPT2LMHeadModel(config), path)


def _hf_logits(model, tokens):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(tokens != 0, dtype=torch.long))
    return out.logits.float().numpy()


def _import(tmp_path, hf_dir):
    workdir = str(tmp_path / "run")
    convert.import_checkpoint(str(hf_dir), workdir, overrides={"model.dtype": "float32"})
    run = resolve(workdir_lib.load_config(workdir))
    return workdir, run, checkpoint.load_params(workdir)


def _prefill_logits(model, params, tokens):
    """Logits [B, T, V] of `tokens` read as given (BOS included) into an empty decoding cache."""
    def prefill(p, t):
        cache = init_cache(model.config, *tokens.shape)
        return model.apply({"params": p}, None, None, t, cache=cache, method="decode")[0]
    return jax.jit(prefill)(params, tokens)


def _check_language_model(tmp_path, hf_model, hf_dir, tokenizer=None):
    workdir, run, params = _import(tmp_path, hf_dir)
    model = Transformer(run.model)
    expected = _hf_logits(hf_model, TOKENS)
    valid = TOKENS != 0
    # Incremental decoding's prefill: the tokens as given.
    ours = _prefill_logits(model, params, TOKENS)
    np.testing.assert_allclose(np.asarray(ours)[valid], expected[valid], atol=ATOL, rtol=0)
    # Teacher forcing (training, evaluation): targets shifted right behind BOS (id 2).
    targets = np.concatenate([TOKENS[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
    forced = jax.jit(lambda p, t: model.apply({"params": p}, None, t))(params, targets)
    np.testing.assert_allclose(np.asarray(forced)[targets != 0], expected[targets != 0],
                               atol=ATOL, rtol=0)
    # Greedy generation, as `generate --temperature=0` runs it: from text with the run's
    # vocabulary when the checkpoint brought one, else from token ids.
    if tokenizer is not None:
        prompt = tokenizer.encode(["Opens a dialog"])[0]
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([[2] + prompt]), max_new_tokens=8,
                                       do_sample=False, **SPECIAL)[0, 1:].tolist()
        ours = load_generator(workdir).generate(["Opens a dialog"], max_new_tokens=8,
                                                temperature=0.0)
        assert ours == [tokenizer.decode(theirs)]
        return workdir
    generator = Generator(run.config, run.model, params, tokenizer=None)
    prompts = [TOKENS[0, 1:6].tolist(), TOKENS[1, 1:4].tolist()]
    ours = generator.generate_ids(prompts, prompt_indices=[0, 1], seed=0, max_new_tokens=8,
                                  temperature=0.0, top_k=0, top_p=1.0)
    for prompt, row in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([[2] + prompt]), max_new_tokens=8,
                                       do_sample=False, **SPECIAL)[0, 1 + len(prompt):].numpy()
        stop = next((i + 1 for i, t in enumerate(theirs) if t == 3), len(theirs))
        np.testing.assert_array_equal(row[:stop], theirs[:stop])
    return workdir


def _check_round_trip(tmp_path, workdir, hf_dir, model_class):
    out = tmp_path / "exported"
    convert.export_workdir(workdir, str(out))
    original = load_file(str(hf_dir / convert.SINGLE_FILE))
    exported = load_file(str(out / convert.SINGLE_FILE))
    assert sorted(exported) == sorted(name for name in original
                                      if not name.endswith(families.GPT2.ignored))
    for name, value in exported.items():
        np.testing.assert_array_equal(value, original[name], err_msg=name)
        assert value.dtype == original[name].dtype
    return model_class.from_pretrained(str(out)).eval()


def test_llama_logits_generation_and_round_trip(tmp_path):
    hf_dir = tmp_path / "llama"
    hf_model = _llama(hf_dir)
    # A SentencePiece vocabulary with our special ids (one exported from a run here).
    tokenizer = tokenizer_lib.train(TRANSLATION_SENTENCES, 128, seed=0)
    (hf_dir / convert.TOKENIZER_MODEL).write_bytes(tokenizer.model_proto)
    workdir = _check_language_model(tmp_path, hf_model, hf_dir, tokenizer)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.LlamaForCausalLM)
    exported = tmp_path / "exported" / convert.TOKENIZER_MODEL
    assert exported.read_bytes() == tokenizer.model_proto
    with pytest.raises(ValueError, match="already holds a run"):
        convert.import_checkpoint(str(hf_dir), workdir)
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def test_gpt2_logits_generation_and_round_trip(tmp_path):
    hf_dir = tmp_path / "gpt2"
    hf_model = _gpt2(hf_dir)
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.GPT2LMHeadModel)
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def test_vit_logits_and_round_trip(tmp_path):
    hf_dir = tmp_path / "vit"
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=96, image_size=32, patch_size=8,
                                    num_channels=3, num_labels=10, initializer_range=0.2)
    torch.manual_seed(0)
    hf_model = _save(transformers.ViTForImageClassification(config), hf_dir)
    images = np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        expected = hf_model(pixel_values=torch.tensor(images)).logits.numpy()
    workdir, run, params = _import(tmp_path, hf_dir)
    assert (run.model.norm_eps, run.model.gelu_approximate) == (1e-12, False)
    ours = VisionTransformer(run.model).apply({"params": params}, images.transpose(0, 2, 3, 1))
    np.testing.assert_allclose(np.asarray(ours), expected, atol=ATOL, rtol=0)
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.ViTForImageClassification)


def test_tied_llama_and_sharded_placement(tmp_path):
    """A tied output (no lm_head tensor) and shards of a safetensors index, each array placed
    into the mesh's sharding: the sharded forward pass equals transformers'."""
    hf_dir = tmp_path / "tied"
    hf_model = _llama(hf_dir, tie_word_embeddings=True)
    hf_model.save_pretrained(hf_dir, max_shard_size="40KB")
    assert (hf_dir / convert.INDEX_FILE).exists()
    fields = families.Llama.config(convert.read_json(str(hf_dir / "config.json"), ""))
    config = TransformerConfig(**fields, dtype="float32")
    assert config.tie_output_embedding and config.rope_theta == 500000.0
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = convert.read_params(convert.TensorReader(str(hf_dir)), families.Llama, config,
                                 mesh)
    assert "logits" not in params["decoder"]
    query = params["decoder"]["layers_0"]["self_attention"]["query"]["kernel"]
    assert query.sharding.spec == jax.P("fsdp", "tensor", None)
    assert query.addressable_shards[0].data.shape == (32, 2, 16)
    with jax.set_mesh(mesh):
        ours = _prefill_logits(Transformer(config), params, TOKENS)
    valid = TOKENS != 0
    np.testing.assert_allclose(np.asarray(ours)[valid], _hf_logits(hf_model, TOKENS)[valid],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "model_type='bert' is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "qwen2"}, "qwen2 option q/k/v bias"),
])
def test_unsupported_options_are_one_line_errors(tmp_path, change, message):
    hf_dir = tmp_path / "llama"
    _llama(hf_dir)
    config = convert.read_json(str(hf_dir / "config.json"), "")
    (hf_dir / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_missing_files_and_tensors_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        convert.import_checkpoint(str(tmp_path), str(tmp_path / "run"))
    hf_dir = tmp_path / "llama"
    _llama(hf_dir)
    (hf_dir / convert.SINGLE_FILE).rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="holds neither model.safetensors"):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "run"))


def test_language_model_trained_here_exports_to_llama(tmp_path, load_config):
    """An lm_* run (embedding scaled by sqrt(D), untied, scanned layers) exports as a Llama
    whose logits are ours: the scale folds into the embedding table."""
    cfg = load_config("lm_default.py", **{
        "data.vocab_size": 128, "model.num_decoder_layers": 2, "model.d_model": 64,
        "model.d_ff": 96, "model.num_heads": 4, "model.num_kv_heads": 2, "model.max_len": 64,
        "model.scan_layers": True})
    run = resolve(cfg)
    assert run.model.scale_embeddings and not run.model.tie_output_embedding
    model = Transformer(run.model)
    tokens = jax.numpy.ones((1, 1), jax.numpy.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens, tokens)["params"])
    workdir = tmp_path / "run"
    workdir.mkdir()
    workdir_lib.write_config(str(workdir), cfg.to_dict(), {})
    series = checkpoint.ParamsSeries(str(workdir), every_minutes=1.0, keep=1, use_async=False)
    series.save(1, params)
    series.close()
    convert.export_workdir(str(workdir), str(tmp_path / "hf"))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    valid = TOKENS != 0
    np.testing.assert_allclose(_hf_logits(hf_model, TOKENS)[valid],
                               np.asarray(_prefill_logits(model, params, TOKENS))[valid],
                               atol=ATOL, rtol=0)
