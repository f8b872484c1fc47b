"""T5 (transformer/huggingface/t5.py): a tiny random `T5ForConditionalGeneration` in the v1.1 /
Flan-T5 layout (gated-GELU, an untied lm_head, d_kv * heads != d_model, more decoder than
encoder layers, random norm weights and bias tables, sequences past the bias's max distance;
nothing downloaded) imported gives its logits and its greedy and beam outputs (our cached
decoding with the decoder's relative bias at each step); export gives its tensors back; what
T5 cannot express is refused in one line; the original T5's ReLU feed-forward is read; the
tied, unscaled head that transformers 5 saves is read and written back; an embedding padded
past the tokenizer keeps the tokenizer, and a `spiece.model` alone is read as T5Tokenizer
reads it."""

import io
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_huggingface import ATOL, _check_round_trip, _import

import transformer
from transformer.data import tokenizer as tokenizer_lib
from transformer.huggingface import convert, families, t5
from transformer.inference import decoding
from transformer.inference.runs import open_run
from transformer.model.transformer import Transformer, init_cache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402 (after the skips)

V = 96
D = 32
T5 = dict(vocab_size=V, d_model=D, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3,
          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=10,
          feed_forward_proj="gated-gelu", dropout_rate=0.0, initializer_factor=1.0,
          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
EXTRA = 30  # output tokens allowed beyond the source's length (ours end before: EOS likelier)
PADDED = 8  # embedding rows past the tokenizer's pieces (Flan-T5: 32128 rows, 32100 pieces)


def _t5_dir(path, **changes):
    """A random T5 saved as the hub's v1.1 / Flan-T5 checkpoints are (config.json with
    tie_word_embeddings false, an lm_head.weight of its own), read back by transformers."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5 | changes))
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                value.normal_(1.0, 0.3)
            elif "relative_attention_bias" in name:
                value.normal_(0.0, 2.0)
    model.eval().save_pretrained(path)
    tensors = load_file(str(path / convert.SINGLE_FILE))
    rows = changes.get("vocab_size", V)
    head = np.random.default_rng(0).normal(0.0, 0.5, (rows, D)).astype(np.float32)
    head[1] *= 2.0  # EOS: outputs of 18 to 33 tokens here, each ending before the limit
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path / convert.SINGLE_FILE), metadata={"format": "pt"})
    config = json.loads((path / convert.HF_CONFIG).read_text())
    for key in ("scale_decoder_outputs", "is_gated_act", "dense_act_fn"):
        config.pop(key)
    (path / convert.HF_CONFIG).write_text(json.dumps(config | {"tie_word_embeddings": False}))
    model = transformers.T5ForConditionalGeneration.from_pretrained(str(path)).eval()
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
    return model


def _batch():
    """Sources [2, 14] (EOS last, row 1 padded) and targets [2, 13]: distances past 10."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, V, (2, 14))
    inputs[:, -1], inputs[1, 8:] = 1, 0
    inputs[1, 7] = 1
    return inputs, rng.integers(2, V, (2, 13))


def _hf_logits(model, inputs, targets):
    decoder_inputs = np.concatenate([np.zeros((len(targets), 1), np.int64), targets[:, :-1]], 1)
    with torch.no_grad():
        return model(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(inputs != 0),
                     decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()


def _check_logits(run, params, hf_model):
    inputs, targets = _batch()
    ours = Transformer(run.model).apply({"params": params}, jnp.asarray(inputs, jnp.int32),
                                        jnp.asarray(targets, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(hf_model, inputs, targets),
                               atol=ATOL, rtol=0)
    return inputs, targets


def _ours(run, params, source, beams):
    """Our search over one source: the output up to its EOS (the search's own)."""
    model = Transformer(run.model)
    inputs = jnp.asarray([source], jnp.int32)
    max_length = len(source) + EXTRA

    def decode_fn(tokens, cache):
        return model.apply({"params": params}, encoded, inputs, tokens, cache=cache,
                           method="decode")

    encoded = model.apply({"params": params}, inputs, method="encode")
    cache = init_cache(run.model, beams, max_length)
    common = dict(bos=jnp.zeros((1,), jnp.int32), max_lengths=jnp.array([max_length]),
                  max_length=max_length, eos_id=1)
    if beams == 1:
        tokens = decoding.greedy_search(decode_fn, cache, **common)[0]
    else:
        tokens = decoding.beam_search(decode_fn, cache, beam_size=beams, alpha=0.0,
                                      **common)[0][0, 0]
    tokens = np.asarray(tokens).tolist()
    return tokens[:tokens.index(1) + 1]


def _theirs(hf_model, source, beams):
    """transformers' generate as long as ours runs (EOS forced last), pad never drawn, no
    length penalty; the output after the decoder start, up to its EOS. Without its cache:
    transformers 5.25 sizes it by the encoder's layers, and the decoder has more."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([source]), num_beams=beams, do_sample=False,
                                max_new_tokens=len(source) + EXTRA, length_penalty=0.0,
                                suppress_tokens=[0], forced_eos_token_id=1,
                                use_cache=False)[0].tolist()
    return out[1:out.index(1) + 1]


def test_t5_logits_and_round_trip(tmp_path):
    hf_dir = tmp_path / "t5"
    hf_model = _t5_dir(hf_dir)
    workdir, run, params = _import(tmp_path, hf_dir)
    cfg = run.model
    assert (cfg.positional, cfg.activation, cfg.gelu_approximate, cfg.attention_scale,
            cfg.tie_output_embedding, cfg.bos_id, cfg.d_k, cfg.relative_buckets,
            cfg.relative_max_distance) == ("relative", "geglu", True, 1.0, False, 0, 12, 8, 10)
    inputs, targets = _check_logits(run, params, hf_model)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir,
                                 transformers.T5ForConditionalGeneration)
    np.testing.assert_array_equal(_hf_logits(reloaded, inputs, targets),
                                  _hf_logits(hf_model, inputs, targets))


@pytest.mark.slow
def test_t5_greedy_and_beam_outputs_are_transformers(tmp_path):
    """Cached decoding (the decoder's bias for each new position over the cache's) gives
    generate's outputs, 18 to 33 tokens long: past the bias's max distance (10)."""
    hf_model = _t5_dir(tmp_path / "t5")
    _, run, params = _import(tmp_path, tmp_path / "t5")
    inputs, _ = _batch()
    sources = [row[:list(row).index(1) + 1].tolist() for row in inputs]
    outputs = {}
    for beams in (1, 4):
        outputs[beams] = [_ours(run, params, source, beams) for source in sources]
        assert outputs[beams] == [_theirs(hf_model, s, beams) for s in sources], beams
        lengths = [len(o) for o in outputs[beams]]
        assert all(T5["relative_attention_max_distance"] < n < len(s) + EXTRA
                   for n, s in zip(lengths, sources, strict=True)), lengths
    assert outputs[1] != outputs[4]  # the beams find what greedy does not


def test_a_tied_unscaled_head_as_transformers_5_saves_t5(tmp_path):
    """transformers 5 saves a fresh T5 v1.1 with its head tied to the embedding, unscaled
    (`scale_decoder_outputs` false, no lm_head.weight): read as our tied head, written back
    so."""
    hf_dir = tmp_path / "t5"
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        **T5, tie_word_embeddings=False))  # v1.1: transformers 5 reads it as unscaled, tied
    with torch.no_grad():
        model.shared.weight.mul_(0.3)  # logits of size ~1, as the other families'
    model.eval().save_pretrained(hf_dir)
    assert "lm_head.weight" not in load_file(str(hf_dir / convert.SINGLE_FILE))
    hf_model = transformers.T5ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    assert not hf_model.config.scale_decoder_outputs
    workdir, run, params = _import(tmp_path, hf_dir)
    assert run.model.tie_output_embedding and "logits" not in params["decoder"]
    inputs, targets = _check_logits(run, params, hf_model)
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir,
                                 transformers.T5ForConditionalGeneration)
    assert not reloaded.config.scale_decoder_outputs
    np.testing.assert_array_equal(_hf_logits(reloaded, inputs, targets),
                                  _hf_logits(hf_model, inputs, targets))


def _tokenizer_json(hf_dir, pieces=V):
    """A word-level `tokenizer.json` of `pieces` with T5's special ids (pad 0, EOS 1 appended,
    unk 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, pieces)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf_dir / "tokenizer.json"), pad_token="<pad>", eos_token="</s>",
        unk_token="<unk>")


@pytest.mark.slow
def test_an_imported_t5_translates_text_as_transformers(tmp_path):
    """The checkpoint's tokenizer.json becomes the run's vocabulary, and `Translator` starts
    from the model's decoder start (pad, 0) and ends at its EOS (1): greedy and beam-4 text
    equal to generate's, decoded by the same tokenizer."""
    hf_dir = tmp_path / "t5"
    hf_model = _t5_dir(hf_dir)
    hf_tokenizer = _tokenizer_json(hf_dir)
    workdir, _, _ = _import(tmp_path, hf_dir)
    translator = transformer.load(workdir)
    inputs, _ = _batch()
    sentences = [" ".join(f"w{i}" for i in row[:list(row).index(1)]) for row in inputs]
    assert translator.encode(sentences) == hf_tokenizer(sentences)["input_ids"]
    for beams in (1, 4):
        ours = translator.translate(sentences, beam_size=beams, alpha=0.0,
                                    max_extra_length=EXTRA, batch_size=1)
        theirs = [hf_tokenizer.decode(_theirs(hf_model, ids, beams), skip_special_tokens=True)
                  for ids in hf_tokenizer(sentences)["input_ids"]]
        assert ours == theirs and all(ours), beams


def test_an_embedding_padded_past_the_tokenizer_keeps_it(tmp_path):
    """Published T5 and Flan-T5 have more embedding rows than tokenizer pieces: the
    tokenizer.json is the run's vocabulary all the same, its vocab_size the model's rows (the
    data's vocab_size and the workdir's check agree), the padding's ids decode to nothing, as
    transformers' decode gives them, and the export writes the rows and the file back."""
    hf_dir = tmp_path / "t5"
    _t5_dir(hf_dir)
    pieces = V - PADDED
    hf_tokenizer = _tokenizer_json(hf_dir, pieces)
    workdir, run, params = _import(tmp_path, hf_dir)
    assert params["embedding"]["embedding"].shape == (V, D)
    tokenizer = open_run(workdir).tokenizer
    assert (tokenizer.vocab_size, tokenizer.pieces, run.model.vocab_size) == (V, pieces, V)
    sentences = ["w5 w87 w3", "w40 w12"]
    assert [ids + [1] for ids in tokenizer.encode(sentences)] == hf_tokenizer(
        sentences)["input_ids"]
    ids = [5, pieces, 87, V - 1, 3, 1, 7]
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids[:5]) == "w5 w87 w3"
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.T5ForConditionalGeneration)
    exported = tmp_path / "exported" / tokenizer_lib.JSON_FILE
    assert exported.read_bytes() == (hf_dir / tokenizer_lib.JSON_FILE).read_bytes()
    with pytest.raises(tokenizer_lib.VocabularyMismatch, match="more than the model's"):
        tokenizer_lib.HuggingFaceTokenizer(exported.read_bytes(), bos_id=0, eos_id=1, pad_id=0,
                                           vocab_size=pieces - 1)


SPIECE_PIECES = 40  # a tiny SentencePiece model; T5's has 32000
WORDS = ("the quick brown fox jumps over a lazy dog house cat tree water running jumped "
         "under nothing something").split()


def _spiece_dir(path):
    """A T5 v1.1 checkpoint as google/t5-v1_1-* ship it: config.json, the weights and a
    `spiece.model` (unigram, T5's ids: pad 0, EOS 1, unk 2, no BOS), no tokenizer.json; the
    embedding has rows for the pieces, T5Tokenizer's 100 extra ids and padding."""
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    sentences = [" ".join(rng.choice(WORDS, 8)) + "." for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=SPIECE_PIECES,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>",
        eos_piece="</s>", unk_piece="<unk>", num_threads=1, minloglevel=2)
    rows = SPIECE_PIECES + t5.EXTRA_IDS + PADDED
    hf_model = _t5_dir(path, vocab_size=rows)
    (path / t5.SPIECE_FILE).write_bytes(model.getvalue())
    return hf_model, transformers.AutoTokenizer.from_pretrained(str(path)), rows


SPIECE_SENTENCES = ["the quick brown fox.", "a cat <extra_id_0> jumped over<extra_id_1>the  dog",
                    "  Ünïcode ﬁsh\thouse  "]


def test_a_spiece_model_alone_is_read_as_t5tokenizer_reads_it(tmp_path):
    """google/t5-v1_1-* hold `spiece.model` only: it becomes the run's vocabulary with T5's
    100 extra ids counting down from the last (`<extra_id_0>`), encoding and decoding as
    transformers' T5Tokenizer (sentinels, the charsmap normaliser, repeated whitespace); the
    export writes the spiece.model back and a tokenizer.json that encodes the same."""
    hf_dir = tmp_path / "t5"
    _, hf_tokenizer, rows = _spiece_dir(hf_dir)
    assert type(hf_tokenizer).__name__ == "T5Tokenizer" and not (hf_dir / "tokenizer.json"
                                                                  ).exists()
    workdir, run, _ = _import(tmp_path, hf_dir)
    tokenizer = open_run(workdir).tokenizer
    assert (tokenizer.vocab_size, tokenizer.pieces) == (rows, len(hf_tokenizer))
    expected = hf_tokenizer(SPIECE_SENTENCES)["input_ids"]
    assert [ids + [1] for ids in tokenizer.encode(SPIECE_SENTENCES)] == expected
    extra_0 = SPIECE_PIECES + t5.EXTRA_IDS - 1
    assert expected[1].count(extra_0) == 1 and 2 in expected[2]  # a sentinel, an unknown
    for ids in expected:
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids[:-1])
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.T5ForConditionalGeneration)
    out = tmp_path / "exported"
    assert (out / t5.SPIECE_FILE).read_bytes() == (hf_dir / t5.SPIECE_FILE).read_bytes()
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    assert exported(SPIECE_SENTENCES)["input_ids"] == expected


@pytest.mark.slow
def test_an_imported_spiece_t5_translates_as_transformers(tmp_path):
    """Greedy text from `Translator` on the spiece.model run equals generate's, decoded by
    T5Tokenizer (sentinels kept, as ours keeps them; padding rows dropped by both)."""
    hf_dir = tmp_path / "t5"
    hf_model, hf_tokenizer, _ = _spiece_dir(hf_dir)
    workdir, _, _ = _import(tmp_path, hf_dir)
    translator = transformer.load(workdir)
    ours = translator.translate(SPIECE_SENTENCES[:2], beam_size=1, max_extra_length=EXTRA,
                                batch_size=1)
    theirs = [hf_tokenizer.decode(_theirs(hf_model, ids, 1)[:-1])
              for ids in hf_tokenizer(SPIECE_SENTENCES[:2])["input_ids"]]
    assert ours == theirs and all(ours)


def test_an_imported_t5_vocabulary_gives_span_corruption_t5s_sentinels(tmp_path):
    """T5's 100 extra ids are the imported vocabulary's sentinels in T5's order
    (`<extra_id_0>` the last piece), so span corruption on it (the fine-tuning run's copy, as
    `init_from` makes one) puts T5's sentinels in both sides and ends each with T5's EOS (1)."""
    from transformer.data.language_model import LanguageModelSource

    hf_dir = tmp_path / "t5"
    _, hf_tokenizer, rows = _spiece_dir(hf_dir)
    workdir, _, _ = _import(tmp_path, hf_dir)
    sentinels = open_run(workdir).tokenizer.sentinel_ids
    assert sentinels == hf_tokenizer.convert_tokens_to_ids(
        [tokenizer_lib.SENTINEL_PIECE.format(k) for k in range(t5.EXTRA_IDS)])
    assert sentinels[0] == SPIECE_PIECES + t5.EXTRA_IDS - 1
    finetuned = tmp_path / "finetuned"
    shutil.copytree(tmp_path / "run" / "vocab", finetuned / "vocab")
    rng = np.random.default_rng(1)
    for split, count in (("train", 64), ("validation", 8)):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(rng.choice(WORDS, 12)) + "."}) + "\n"
            for _ in range(count)))
    source = LanguageModelSource(
        f"jsonl:{tmp_path}/train.jsonl", objective="span_corruption", vocab_size=rows,
        max_length=32, batch_size=4, eval_dataset=f"jsonl:{tmp_path}/validation.jsonl",
        workdir=str(finetuned), num_sentinels=t5.EXTRA_IDS)
    batch = source.train_batch(0, (0, 4))
    pieces = 0
    for side in ("inputs", "targets"):
        for row, segments in zip(batch[side][0], batch[f"{side}_segmentation"][0], strict=True):
            for segment in set(segments.tolist()) - {0}:
                piece = row[segments == segment].tolist()
                assert sentinels[0] in piece and piece[-1] == 1, (side, piece)
                assert set(piece) - set(sentinels) <= set(range(SPIECE_PIECES)), piece
                pieces += 1
    assert pieces >= 8


def test_without_the_relative_bias_the_logits_differ(tmp_path):
    """The bias tables are read (zeroed, the logits move), so the test above would see a
    dropped or misread one."""
    hf_model = _t5_dir(tmp_path / "t5")
    _, run, params = _import(tmp_path, tmp_path / "t5")
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0 if "relative_bias" in jax.tree_util.keystr(path) else x, params)
    inputs, targets = _batch()
    ours = Transformer(run.model).apply({"params": zeroed}, jnp.asarray(inputs, jnp.int32),
                                        jnp.asarray(targets, jnp.int32))
    assert np.abs(np.asarray(ours) - _hf_logits(hf_model, inputs, targets)).max() > 0.1


def test_the_original_t5s_relu_feed_forward_is_read(tmp_path):
    hf_model = _t5_dir(tmp_path / "t5", feed_forward_proj="relu")
    _, run, params = _import(tmp_path, tmp_path / "t5")
    assert run.model.activation == "relu"
    _check_logits(run, params, hf_model)


@pytest.mark.parametrize("change, message", [
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
    (dict(feed_forward_proj="gated-relu"), "feed_forward_proj='gated-relu'"),
])
def test_what_our_model_does_not_compute_is_refused_on_import(change, message):
    hf = transformers.T5Config(**T5).to_dict() | {"tie_word_embeddings": False}
    hf.pop("scale_decoder_outputs")
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        families.T5.config(hf | change)
    assert "\n" not in str(error.value)


def test_what_t5_cannot_express_is_refused_on_export(tmp_path):
    _t5_dir(tmp_path / "t5")
    workdir, _, _ = _import(tmp_path, tmp_path / "t5")
    path = tmp_path / "run" / "config.json"
    config = json.loads(path.read_text())
    config["model"]["gelu_approximate"] = False
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="closest is T5, which differs in model.gelu_approx"
                                         "imate=False with activation='geglu'") as error:
        convert.export_workdir(workdir, str(tmp_path / "out"))
    assert "\n" not in str(error.value)


def test_a_fine_tuned_spiece_t5_exports_its_spiece_model(tmp_path):
    """A run fine-tuned (init_from; every tensor moved) from an imported spiece.model T5
    exports the checkpoint's `spiece.model` (kept in the import's vocab/, found through
    init_from), which T5Tokenizer reads as it read the original (the same ids), and a
    T5ForConditionalGeneration with our logits within ATOL (float32 in either order, as the
    import's comparison). A kept spiece.model that no longer gives the run's vocabulary is
    refused in one line before anything is written."""
    from sentencepiece import sentencepiece_model_pb2
    from test_marian import _fine_tuned_run

    hf_dir = tmp_path / "t5"
    _, hf_tokenizer, _ = _spiece_dir(hf_dir)
    workdir, run, params = _import(tmp_path, hf_dir)
    tuned_dir, tuned = _fine_tuned_run(tmp_path, workdir, params)
    out = tmp_path / "tuned"
    convert.export_workdir(tuned_dir, str(out))
    assert (out / t5.SPIECE_FILE).read_bytes() == (hf_dir / t5.SPIECE_FILE).read_bytes()
    (out / tokenizer_lib.JSON_FILE).unlink()  # T5Tokenizer from spiece.model alone
    exported = transformers.T5Tokenizer.from_pretrained(str(out))
    expected = hf_tokenizer(SPIECE_SENTENCES)["input_ids"]
    assert exported(SPIECE_SENTENCES)["input_ids"] == expected
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(str(out)).eval()
    width = max(map(len, expected))
    inputs = np.array([ids + [0] * (width - len(ids)) for ids in expected])
    targets = np.random.default_rng(0).integers(3, SPIECE_PIECES, (len(inputs), 7))
    decoder_inputs = np.concatenate([np.zeros((len(inputs), 1), int), targets[:, :-1]], 1)
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(
            inputs != 0), decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()
    ours = Transformer(run.model).apply({"params": tuned}, inputs.astype(np.int32),
                                        targets.astype(np.int32))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=ATOL, rtol=0)
    kept = tmp_path / "run" / "vocab" / t5.SPIECE_FILE
    proto = sentencepiece_model_pb2.ModelProto.FromString(kept.read_bytes())
    proto.pieces[10].piece = "\u2581changed"
    kept.write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match="no longer the one") as error:
        convert.export_workdir(tuned_dir, str(tmp_path / "refused"))
    assert "\n" not in str(error.value) and not (tmp_path / "refused").exists()
