"""Hugging Face checkpoints in and out (transformer/huggingface): tiny random models built by
`transformers` itself (nothing downloaded), saved, imported; our logits equal theirs within
float32 rounding, greedy generation gives their tokens, export gives their tensors bit for bit.
"""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES, byte_level_bpe, params_run
from safetensors.numpy import load_file

from transformer.checkpoint import averaging, layout
from transformer.config import resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.huggingface import convert, families
from transformer.inference.generator import Generator, load_generator
from transformer.inference.runs import open_run
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer, init_cache
from transformer.model.vit import VisionTransformer
from transformer.parallel import sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIAL = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)  # ours (data/tokenizer.py)
TOKENS = np.array([[2, 17, 5, 99, 42, 7, 64, 11, 3, 90],
                   [2, 8, 120, 33, 33, 61, 0, 0, 0, 0]], np.int32)  # row 1 right-padded
# Ours (XLA) against transformers (torch) in float32 on any x86-64 CPU: along a path from an
# embedding to a logit of these 2-3 layer models (D 64, d_ff 96, 10 positions) the sums hold
# ~1,350 terms, each sum rounding to n x 2^-24 of its size in the worst order another BLAS or
# thread count may take: ~8e-5 of logits of size ~1. Widened from 2e-5 (seen here: up to
# 7.4e-6, 2.7x under it; a fresh machine moved the Marian export's by 1.5x).
ATOL = 1e-4


def _save(model, path):
    torch.manual_seed(0)
    model.eval().save_pretrained(path)
    return model


def _llama(path, vocab_size=128, special=SPECIAL, **kwargs):
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, initializer_range=0.2, **special, **kwargs)
    torch.manual_seed(0)
    return _save(transformers.LlamaForCausalLM(config), path)


def _gpt2(path):
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, initializer_range=0.2, **SPECIAL)
    torch.manual_seed(0)
    return _save(transformers.GPT2LMHeadModel(config), path)


def _hf_logits(model, tokens, padded=True):
    """`model`'s logits of `tokens`, id 0 taken for padding unless not `padded`."""
    mask = tokens != 0 if padded else np.ones_like(tokens)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits.float().numpy()


def _import(tmp_path, hf_dir):
    workdir = str(tmp_path / "run")
    convert.import_checkpoint(str(hf_dir), workdir, overrides={"model.dtype": "float32"})
    run = resolve(layout.load_config(workdir))
    return workdir, run, averaging.load_params(workdir)


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
            theirs = hf_model.generate(  # padding (id 0) is never drawn, as ours
                torch.tensor([[2] + prompt]), max_new_tokens=8, do_sample=False,
                suppress_tokens=[0], **SPECIAL)[0, 1 + len(prompt):].numpy()
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
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "qwen2"}, "lacks tensor model.layers.0.self_attn.k_proj.bias"),
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
    workdir = params_run(tmp_path / "run", cfg, params)
    convert.export_workdir(str(workdir), str(tmp_path / "hf"))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    valid = TOKENS != 0
    np.testing.assert_allclose(_hf_logits(hf_model, TOKENS)[valid],
                               np.asarray(_prefill_logits(model, params, TOKENS))[valid],
                               atol=ATOL, rtol=0)


def _llama_sentencepiece(path):
    """Llama's special ids (unk 0, bos 1, eos 2, no padding) in a small SentencePiece model."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRANSLATION_SENTENCES), model_writer=model, vocab_size=128,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (path / convert.TOKENIZER_MODEL).write_bytes(model.getvalue())
    return 128, dict(bos_token_id=1, eos_token_id=2)


def _gpt2_tokenizer_json(path):
    """GPT-2's kind of vocabulary: byte-level BPE in a tokenizer.json, "<|endoftext|>" last as
    both bos and eos, no padding (id 0 is an ordinary token)."""
    tokenizer = byte_level_bpe(TRANSLATION_SENTENCES, vocab_size=320,
                               added_tokens=["<|endoftext|>"])
    tokenizer.save(str(path / tokenizer_lib.JSON_FILE))
    last = tokenizer.get_vocab_size() - 1
    return last + 1, dict(bos_token_id=last, eos_token_id=last)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_checkpoint_tokenizer_and_its_special_ids_become_the_run_vocabulary(
        tmp_path, family):
    """Llama's SentencePiece model (bos 1, eos 2) and GPT-2's tokenizer.json (bos = eos = the
    last id, no padding): the run reads text with them, teacher-forces behind the checkpoint's
    BOS, generates what `transformers` generates, and exports them unchanged."""
    hf_dir = tmp_path / family
    hf_dir.mkdir()
    make_vocabulary, config_class, model_class, sizes = {
        "llama": (_llama_sentencepiece, transformers.LlamaConfig,
                  transformers.LlamaForCausalLM,
                  dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64)),
        "gpt2": (_gpt2_tokenizer_json, transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    }[family]
    vocab_size, special = make_vocabulary(hf_dir)
    torch.manual_seed(0)
    hf_model = _save(model_class(config_class(vocab_size=vocab_size, initializer_range=0.2,
                                              **special, **sizes)), hf_dir)
    workdir, run, params = _import(tmp_path, hf_dir)
    bos = special["bos_token_id"]
    eos = special["eos_token_id"]
    assert (run.model.bos_id, run.model.eos_id, run.model.pad_id) == (bos, eos, None)
    tokenizer = open_run(workdir).tokenizer
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (bos, eos, None)
    text = "Opens a dialog where you can choose" + ("!" if family == "gpt2" else "")
    ids = tokenizer.encode([text])[0]
    if family == "gpt2":  # the tokenizers library's own reading, through transformers
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(hf_dir / tokenizer_lib.JSON_FILE))
        assert ids == fast.encode(text, add_special_tokens=False)
        assert ids[-1] == 0  # "!": id 0 is an ordinary token here
    assert tokenizer.decode(ids + [eos, 7]) == text
    # Teacher forcing puts the checkpoint's BOS first; id 0 is never taken for padding.
    targets = np.array([ids + [eos]], np.int32)
    forced = Transformer(run.model).apply({"params": params}, None, targets)
    expected = _hf_logits(hf_model, np.array([[bos] + ids], np.int32), padded=False)
    np.testing.assert_allclose(np.asarray(forced), expected, atol=ATOL, rtol=0)
    # Greedy generation from text, as `generate --temperature=0` runs it: Llama's
    # SentencePiece tokenizer puts BOS first, GPT-2's tokenizer.json nothing.
    start = [bos] if family == "llama" else []
    _check_greedy_text(hf_model, workdir, tokenizer, start)
    # Export writes the vocabulary and the special ids back unchanged, and AutoTokenizer reads
    # the text as our generate does (after BOS where the vocabulary is SentencePiece).
    out = tmp_path / "exported"
    convert.export_workdir(workdir, str(out))
    name = tokenizer_lib.JSON_FILE if family == "gpt2" else convert.TOKENIZER_MODEL
    assert (out / name).read_bytes() == (hf_dir / name).read_bytes()
    exported = convert.read_json(str(out / "config.json"), "")
    assert {k: exported[k] for k in special} == special
    assert exported["pad_token_id"] is None
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert hf_tokenizer(text)["input_ids"] == start + ids
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id,
            hf_tokenizer.pad_token_id) == (bos, eos, None)


def test_a_sentencepiece_model_padded_past_its_pieces_keeps_it(tmp_path):
    """A Llama whose embedding has rows past its tokenizer.model's pieces (no tokenizer.json):
    the SentencePiece model is the run's vocabulary, its vocab_size the model's rows
    (special_ids.json records them), padding ids decode to nothing, and the export writes the
    model and the padded tensors back."""
    hf_dir = tmp_path / "llama"
    _llama(hf_dir, vocab_size=136, special=dict(bos_token_id=1, eos_token_id=2))
    pieces, _ = _llama_sentencepiece(hf_dir)
    workdir, run, _ = _import(tmp_path, hf_dir)
    assert run.config.data.vocab_size == run.model.vocab_size == 136
    tokenizer = open_run(workdir).tokenizer
    assert (tokenizer.vocab_size, tokenizer.pieces) == (136, pieces)
    assert json.loads((tmp_path / "run/vocab" / tokenizer_lib.SPECIAL_IDS_FILE).read_text()
                      ) == {"vocab_size": 136}
    given = tokenizer_lib.read_given(str(tmp_path / "run/vocab" / tokenizer_lib.MODEL_FILE))
    assert given.vocab_size == 136  # the run's vocab/ as data.vocab_path
    text = "Opens a dialog where you can choose"
    ids = tokenizer.encode([text])[0]
    assert ids == tokenizer_lib.Tokenizer.load(str(hf_dir / convert.TOKENIZER_MODEL)).encode(
        [text])[0]
    assert tokenizer.decode(ids[:2] + [pieces, 135] + ids[2:]) == text
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.LlamaForCausalLM)
    assert (tmp_path / "exported" / convert.TOKENIZER_MODEL).read_bytes() == (
        hf_dir / convert.TOKENIZER_MODEL).read_bytes()


def _check_greedy_text(hf_model, workdir, tokenizer, start, text="Opens a dialog"):
    """`generate --temperature=0` on `text` gives what `transformers`' greedy `generate` gives
    on the same text read after `start` (what its tokenizer puts before a text)."""
    prompt = start + tokenizer.encode([text])[0]
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                   pad_token_id=tokenizer.eos_id)[0].tolist()
    ours = load_generator(workdir).generate([text], max_new_tokens=8, temperature=0.0)
    assert ours == [tokenizer.decode(theirs)]
    return theirs


@pytest.mark.parametrize("template", [False, True], ids=["no_bos", "bos_template"])
def test_prompts_get_bos_only_where_the_tokenizer_post_processor_adds_it(tmp_path, template):
    """A Llama with a tokenizer.json that adds no BOS (a byte-level BPE without template) or
    adds it (a template "<bos> $A", as Llama 3's): `transformers`' tokenizer reads the prompt
    as its post-processor says, and our greedy text equals its `generate`'s."""
    from tokenizers import processors

    hf_dir = tmp_path / "llama"
    hf_dir.mkdir()
    vocab_size, special = _gpt2_tokenizer_json(hf_dir)
    bos = special["bos_token_id"] - 1  # a byte piece as BOS, so that BOS != EOS
    special["bos_token_id"] = bos
    if template:
        from tokenizers import Tokenizer

        json_tokenizer = Tokenizer.from_file(str(hf_dir / tokenizer_lib.JSON_FILE))
        piece = json_tokenizer.id_to_token(bos)
        json_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{piece} $A", special_tokens=[(piece, bos)])
        json_tokenizer.save(str(hf_dir / tokenizer_lib.JSON_FILE))
    hf_model = _llama(hf_dir, vocab_size=vocab_size, special=special)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf_dir / tokenizer_lib.JSON_FILE))
    start = fast.encode("Opens a dialog")[:-len(fast.encode("Opens a dialog",
                                                             add_special_tokens=False))]
    assert start == ([bos] if template else [])
    workdir, _, _ = _import(tmp_path, hf_dir)
    tokenizer = open_run(workdir).tokenizer
    _check_greedy_text(hf_model, workdir, tokenizer, start)


def test_a_large_export_is_written_in_shards_with_their_index(tmp_path):
    """Shards of at most `max_shard_bytes` (a bigger tensor alone in its own), indexed as
    `save_pretrained` indexes them: `transformers` loads the same tensors and logits."""
    hf_dir = tmp_path / "llama"
    hf_model = _llama(hf_dir)
    workdir, _, _ = _import(tmp_path, hf_dir)
    out = tmp_path / "sharded"
    out.mkdir()
    (out / convert.SINGLE_FILE).write_bytes(b"an earlier export")
    path = convert.export_workdir(workdir, str(out), max_shard_bytes=40_000)
    assert path == str(out / convert.INDEX_FILE)
    index = convert.read_json(path, "")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}" \
        ".safetensors"
    assert sorted(p.name for p in out.glob("model*")) == sorted(shards + [convert.INDEX_FILE])
    original = load_file(str(hf_dir / convert.SINGLE_FILE))
    sizes = {}
    for shard in shards:
        tensors = load_file(str(out / shard))
        sizes[shard] = sum(v.nbytes for v in tensors.values())
        assert len(tensors) == 1 or sizes[shard] <= 40_000
        for name, value in tensors.items():
            assert index["weight_map"][name] == shard
            np.testing.assert_array_equal(value, original[name], err_msg=name)
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert set(index["weight_map"]) == set(original)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))


def test_padding_is_read_from_segment_ids_where_a_batch_has_them():
    """Id 0 is an ordinary token of some imported vocabularies (GPT-2's "!"): where a batch
    has segment ids they alone say what counts in the loss."""
    from transformer.training import train_state

    targets = np.array([[0, 5, 0, 0]], np.int32)
    packed = {"targets": targets, "targets_segmentation": np.array([[1, 1, 2, 0]], np.int32)}
    np.testing.assert_array_equal(train_state.loss_weights(packed), [[1, 1, 1, 0]])
    np.testing.assert_array_equal(train_state.loss_weights({"targets": targets}), [[0, 1, 0, 0]])


@pytest.mark.slow
def test_an_imported_gpt2_fine_tunes_on_the_offline_corpus_with_its_own_vocabulary(
        tmp_path, offline_fixture_data_dir):
    """configs/finetune.py on an imported GPT-2 (tokenizer.json, bos = eos, no padding): the
    run reads the corpus with the checkpoint's vocabulary, starts from its weights, the loss
    falls, and the result generates text."""
    import runpy

    from transformer.training.loop import train_and_evaluate

    hf_dir = tmp_path / "gpt2"
    hf_dir.mkdir()
    vocab_size, special = _gpt2_tokenizer_json(hf_dir)
    torch.manual_seed(0)
    _save(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64,
        initializer_range=0.2, **special)), hf_dir)
    pretrained = tmp_path / "imported"
    convert.import_checkpoint(str(hf_dir), str(pretrained), overrides={"model.dtype": "float32"})
    cfg = runpy.run_path("configs/finetune.py")["get_config"](str(pretrained))
    assert (cfg.model.bos_id, cfg.data.vocab_size) == (vocab_size - 1, vocab_size)
    cfg.data.update(dict(data_dir=str(offline_fixture_data_dir), max_length=32, batch_size=8))
    cfg.update(dict(num_train_steps=30, eval_every_steps=30, checkpoint_every_steps=30,
                    log_every_steps=1))
    cfg.optimizer.update(dict(warmup_steps=3, learning_rate=3e-3))
    workdir = tmp_path / "finetuned"
    train_and_evaluate(cfg, str(workdir))
    assert (workdir / "vocab" / tokenizer_lib.JSON_FILE).read_bytes() == (
        hf_dir / tokenizer_lib.JSON_FILE).read_bytes()
    with open(workdir / "metrics.jsonl") as f:
        losses = [line["loss"] for line in map(json.loads, f) if line["split"] == "train"]
    assert len(losses) == 30 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses
    text = load_generator(str(workdir)).generate(["Click the"], max_new_tokens=8,
                                                 temperature=0.0)[0]
    assert text.startswith("Click the") and len(text) > len("Click the")
