"""The decoder-only families beyond Llama's defaults (transformer/huggingface/llama.py):
Llama 3.1's, linear and YaRN RoPE scaling, Mistral's sliding window, Qwen2's query, key and
value biases and its local and global layers. Tiny random models built by `transformers`
(nothing downloaded): the RoPE frequencies equal `transformers`' own, the imported logits and
greedy tokens equal theirs, export gives their tensors and options back."""

import json

import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES, byte_level_bpe
from test_huggingface import (
    SPECIAL,
    TOKENS,
    _check_greedy_text,
    _check_language_model,
    _check_round_trip,
    _hf_logits,
    _save,
)

from transformer.huggingface import convert
from transformer.model.config import TransformerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, initializer_range=0.2, **SPECIAL)
ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 8.0, "beta_slow": 1.0},
}


def _build(path, config_class, model_class, **kwargs):
    torch.manual_seed(0)
    return _save(model_class(config_class(**SIZES, **kwargs)), path)


def _exported_config(tmp_path):
    return json.loads((tmp_path / "exported" / convert.HF_CONFIG).read_text())


@pytest.mark.parametrize("rope_type", sorted(ROPE))
def test_rope_frequencies_equal_transformers_rope_init_functions(rope_type):
    """`layers.rope_inverse_frequencies` (through the model config) against the function
    `transformers` computes each rope_type's frequencies and cos/sin scale with."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from transformer.huggingface import llama

    rope = dict(ROPE[rope_type], rope_theta=10000.0)
    hf = transformers.LlamaConfig(**SIZES, head_dim=32, num_attention_heads_=None,
                                  rope_parameters=rope)
    theirs, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    fields = llama.Llama.config(hf.to_dict())
    ours = TransformerConfig(**fields).rope_arguments()
    # the same float32 powers and divisions in two libraries: a few ulps (2^-23 = 1.2e-7)
    np.testing.assert_allclose(ours["inv_freq"], theirs.numpy(), rtol=1e-6, atol=0)
    assert ours["scale"] == pytest.approx(scale)
    default = 10000.0 ** (-np.arange(0, 32, 2) / 32)
    assert not np.allclose(ours["inv_freq"], default)  # the scaling changes something


@pytest.mark.parametrize("rope_type", sorted(ROPE))
def test_llama_with_scaled_rope_logits_generation_and_round_trip(tmp_path, rope_type):
    hf_dir = tmp_path / "llama"
    hf_model = _build(hf_dir, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      rope_parameters=dict(ROPE[rope_type], rope_theta=500000.0))
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.LlamaForCausalLM)
    original = json.loads((hf_dir / convert.HF_CONFIG).read_text())["rope_parameters"]
    assert _exported_config(tmp_path)["rope_parameters"] == original
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def test_mistral_sliding_window_logits_generation_and_round_trip(tmp_path):
    """A window of 4 keys (the query's own included: our attention_window 3) over rows of 10
    tokens, and generation past it (the decoding cache's ring buffer)."""
    hf_dir = tmp_path / "mistral"
    hf_model = _build(hf_dir, transformers.MistralConfig, transformers.MistralForCausalLM,
                      sliding_window=4, rope_theta=10000.0)
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    run = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (run["attention_window"], run["attention_pattern"]) == (3, "local")
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.MistralForCausalLM)
    exported = _exported_config(tmp_path)
    assert (exported["model_type"], exported["sliding_window"]) == ("mistral", 4)
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


@pytest.mark.parametrize("window", [None, 4], ids=["global", "local_and_global"])
def test_qwen2_biases_and_windows_logits_generation_and_round_trip(tmp_path, window):
    """Qwen2's q/k/v biases (random, so that they count) and, with `use_sliding_window`,
    its global first and windowed later layers (`max_window_layers`)."""
    hf_dir = tmp_path / "qwen2"
    options = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) \
        if window else {}
    hf_model = _build(hf_dir, transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                      **options)
    with torch.no_grad():
        for name, value in hf_model.named_parameters():
            if name.endswith("proj.bias"):
                value.normal_(0.0, 0.5)
    _save(hf_model, hf_dir)
    workdir = _check_language_model(tmp_path, hf_model, hf_dir)
    run = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert run["qkv_bias"] and run["attention_pattern"] == (
        "global,local" if window else "global")
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.Qwen2ForCausalLM)
    assert reloaded.config.layer_types == hf_model.config.layer_types
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def _qwen2_tokenizer(hf_dir):
    """Qwen2's kind of tokenizer.json in `hf_dir`: byte-level BPE (no BOS put before a text)
    with its <|endoftext|>, <|im_start|> and <|im_end|> special tokens."""
    from transformer.data import tokenizer as tokenizer_lib

    hf_dir.mkdir()
    json_tokenizer = byte_level_bpe(TRANSLATION_SENTENCES, vocab_size=320, added_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    json_tokenizer.save(str(hf_dir / tokenizer_lib.JSON_FILE))
    return json_tokenizer


def test_qwen2_tokenizer_pads_with_its_end_token_and_exports_so(tmp_path):
    """Qwen2's tokenizer (byte-level BPE in a tokenizer.json, <|endoftext|> both config.json's
    bos and eos, no pad_token_id; its tokenizer_config.json has no BOS and pads with
    <|endoftext|>): the run keeps no pad id (transformers' pad only fills batches), generates
    transformers' greedy text from text, and the export's AutoTokenizer reads and pads text as
    the original's and names no BOS either."""
    from transformer.data import tokenizer as tokenizer_lib

    hf_dir = tmp_path / "qwen2"
    json_tokenizer = _qwen2_tokenizer(hf_dir)
    end = json_tokenizer.token_to_id("<|endoftext|>")
    (hf_dir / convert.TOKENIZER_CONFIG).write_text(json.dumps(dict(
        tokenizer_class="Qwen2Tokenizer", bos_token=None, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token=None, add_prefix_space=False)))
    sizes = SIZES | dict(vocab_size=json_tokenizer.get_vocab_size(), bos_token_id=end,
                         eos_token_id=end, pad_token_id=None)
    torch.manual_seed(0)
    hf_model = _save(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes)), hf_dir)
    original = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert (original.bos_token_id, original.eos_token_id, original.pad_token_id) == (
        None, end, end)
    workdir = str(tmp_path / "run")
    convert.import_checkpoint(str(hf_dir), workdir, overrides={"model.dtype": "float32"})
    special = json.loads((tmp_path / "run/vocab" / tokenizer_lib.SPECIAL_IDS_FILE).read_text())
    assert special == {"bos_id": end, "eos_id": end, "pad_id": None}
    tokenizer = tokenizer_lib.load(str(tmp_path / "run/vocab"))
    texts = ["Opens a dialog where you can choose", "Click"]
    assert tokenizer.encode(texts) == original(texts)["input_ids"]  # no BOS put before
    _check_greedy_text(hf_model, workdir, tokenizer, [])
    out = tmp_path / "exported"
    out.mkdir()  # an earlier export's generation_config.json, which this one has none of
    (out / convert.GENERATION_CONFIG).write_text(json.dumps({"eos_token_id": [end, 1]}))
    convert.export_workdir(workdir, str(out))
    assert not (out / convert.GENERATION_CONFIG).exists()
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (exported.bos_token, exported.eos_token_id, exported.pad_token_id) == (
        None, end, end)  # no BOS, as Qwen2Tokenizer's
    assert json.loads((out / convert.TOKENIZER_CONFIG).read_text()).get("bos_token") is None
    padded = original(texts, padding=True)["input_ids"]
    assert padded[1][-1] == end and exported(texts, padding=True)["input_ids"] == padded


@pytest.mark.parametrize("listed_in", ["generation_config", "config"])
def test_greedy_decoding_stops_at_every_end_id_the_checkpoint_lists(tmp_path, listed_in):
    """Qwen2-Instruct's two ends, <|im_end|> (config.json's eos) and <|endoftext|>, listed in
    generation_config.json or, without one, in config.json's eos_token_id (as Llama 3.1's):
    the import records both, a greedy continuation that writes the second stops there with
    `transformers`' tokens and text, and the export lists both again."""
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.inference.generator import load_generator

    hf_dir = tmp_path / "qwen2"
    json_tokenizer = _qwen2_tokenizer(hf_dir)
    end, im_end = map(json_tokenizer.token_to_id, ("<|endoftext|>", "<|im_end|>"))
    sizes = SIZES | dict(vocab_size=json_tokenizer.get_vocab_size(), bos_token_id=end,
                         eos_token_id=im_end, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes)).eval()
    text = "Opens a dialog"
    prompt = json_tokenizer.encode(text).ids
    with torch.no_grad():
        free = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 pad_token_id=end)[0, len(prompt):].tolist()
    # The first new token not written before becomes <|endoftext|> (their output rows swap).
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    assert not {end, im_end} & set(free[:k + 1])
    with torch.no_grad():
        hf_model.lm_head.weight[[free[k], end]] = hf_model.lm_head.weight[[end, free[k]]]
    _save(hf_model, hf_dir)
    if listed_in == "generation_config":
        generation = json.loads((hf_dir / "generation_config.json").read_text())
        (hf_dir / "generation_config.json").write_text(json.dumps(
            generation | {"eos_token_id": [im_end, end]}))
    else:
        (hf_dir / "generation_config.json").unlink()
        config = json.loads((hf_dir / convert.HF_CONFIG).read_text())
        (hf_dir / convert.HF_CONFIG).write_text(json.dumps(
            config | {"eos_token_id": [im_end, end]}))
    with torch.no_grad():
        theirs = transformers.Qwen2ForCausalLM.from_pretrained(str(hf_dir)).eval().generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
            pad_token_id=end)[0, len(prompt):].tolist()
    assert theirs == free[:k] + [end]  # transformers stops at the second end
    workdir = str(tmp_path / "run")
    convert.import_checkpoint(str(hf_dir), workdir, overrides={"model.dtype": "float32"})
    special = json.loads((tmp_path / "run/vocab" / tokenizer_lib.SPECIAL_IDS_FILE).read_text())
    assert special == {"bos_id": end, "eos_id": im_end, "pad_id": None,
                       "eos_ids": [im_end, end]}
    generator = load_generator(workdir)
    ours = generator.generate_ids([prompt], prompt_indices=[0], seed=0, max_new_tokens=8,
                                  temperature=0.0, top_k=0, top_p=1.0)[0]
    np.testing.assert_array_equal(ours, theirs + [0] * (8 - len(theirs)))
    tokenizer = tokenizer_lib.load(str(tmp_path / "run/vocab"))
    assert generator.generate([text], max_new_tokens=8, temperature=0.0) == [
        tokenizer.decode(prompt + theirs[:-1])]
    out = tmp_path / "exported"
    convert.export_workdir(workdir, str(out))
    assert _exported_config(tmp_path)["eos_token_id"] == im_end
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == [im_end, end]
    with torch.no_grad():
        again = transformers.Qwen2ForCausalLM.from_pretrained(str(out)).eval().generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
            pad_token_id=end)[0, len(prompt):].tolist()
    assert again == theirs


@pytest.mark.parametrize("model_type, change, message", [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_type='dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7}},
     "mscale=0.7"),
    ("llama", {"rope_parameters": {"rope_type": "longrope"}}, "rope_type='longrope'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                   "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"sliding_window": 8}, "llama option sliding_window=8"),
    ("mistral", {"sliding_window": 1}, "sliding_window=1"),
])
def test_unsupported_variants_are_one_line_errors(tmp_path, model_type, change, message):
    hf_dir = tmp_path / "model"
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    _build(hf_dir, config_class, model_class)
    config = json.loads((hf_dir / convert.HF_CONFIG).read_text())
    (hf_dir / convert.HF_CONFIG).write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")) as error:
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "run"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_mixed_window_pattern_without_biases_is_refused_on_export():
    """Local and global layers are Qwen2's (with its biases); Mistral's window is in every
    layer: such a model is none of the families."""
    from transformer.huggingface import families

    cfg = TransformerConfig(architecture="decoder", num_encoder_layers=0, num_decoder_layers=2,
                            positional="rope", norm="rms_norm", norm_position="pre",
                            activation="swiglu", use_bias=False, scale_embeddings=False,
                            attention_window=3, attention_pattern="local,global")
    with pytest.raises(ValueError, match="Mistral's window is in every layer"):
        families.for_model(cfg, "--workdir=w")


def test_a_window_model_whose_id_0_is_a_token_generates_as_transformers(tmp_path):
    """Mistral's ids (bos 1, eos 2, no padding: id 0 is its <unk>, an ordinary token): prompts
    holding id 0, padded into a bucket longer than the window, generate `transformers`' greedy
    tokens; the pads after a prompt never enter the ring buffer, a prompt's id 0 does."""
    from test_huggingface import _import

    from transformer.inference.generator import Generator

    hf_dir = tmp_path / "mistral"
    sizes = SIZES | dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    torch.manual_seed(0)
    hf_model = _save(transformers.MistralForCausalLM(transformers.MistralConfig(
        **sizes, sliding_window=4)), hf_dir)
    _, run, params = _import(tmp_path, hf_dir)
    assert (run.model.pad_id, run.model.attention_window) == (None, 3)
    generator = Generator(run.config, run.model, params, tokenizer=None)
    prompts = [[17, 0, 99, 42, 0, 64], [0, 120, 33]]
    ours = generator.generate_ids(prompts, prompt_indices=[0, 1], seed=0, max_new_tokens=8,
                                  temperature=0.0, top_k=0, top_p=1.0, length=16)
    for prompt, row in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([[1] + prompt]), max_new_tokens=8,
                                       do_sample=False, pad_token_id=2)[0, 1 + len(prompt):]
        stop = next((i + 1 for i, t in enumerate(theirs.tolist()) if t == 2), len(theirs))
        np.testing.assert_array_equal(row[:stop], theirs.numpy()[:stop])
