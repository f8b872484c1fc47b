"""Marian (transformer/huggingface/marian.py): a tiny random `MarianMTModel` (SiLU
feed-forward, scaled embeddings, a random final_logits_bias; nothing downloaded) imported with
`MarianTokenizer`'s files gives its logits, greedy and beam translations; the paper's model
trained here exports to a Marian that `transformers` loads and translates with; what Marian
cannot express is refused in one line."""

import dataclasses
import json
import re
from unittest import mock

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES, params_run
from test_huggingface import ATOL, _check_round_trip, _import, _save

import transformer
from transformer.checkpoint import averaging
from transformer.config import resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.huggingface import convert, marian
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer
from transformer.ops import layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 128
IDS = dict(pad_token_id=0, eos_token_id=3, decoder_start_token_id=2, forced_eos_token_id=3)
SIZES = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
             decoder_ffn_dim=64, max_position_embeddings=64, init_std=0.2, **IDS)
SOURCES = ["Opens a dialog where you can choose", "Click the button"]
PADDING_SCALE = 3.0  # a padded run's rows past the pieces, times this: the decoders meet them


def _vocabulary(hf_dir):
    """Our SentencePiece model written as MarianTokenizer's files."""
    tokenizer = tokenizer_lib.train(TRANSLATION_SENTENCES, V, seed=0)
    spm = hf_dir / "spm.model"
    spm.write_bytes(tokenizer.model_proto)
    marian.write_vocabulary(str(spm), str(hf_dir), TransformerConfig(norm_eps=1e-5,
                                                                     vocab_size=V))
    spm.unlink()
    return tokenizer


def _hf_logits(model, inputs, targets):
    """Teacher-forced logits of `targets` (decoder input: start, then targets shifted)."""
    decoder_inputs = np.concatenate([np.full((len(targets), 1), 2), targets[:, :-1]], axis=1)
    with torch.no_grad():
        return model(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(inputs != 0),
                     decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()


def _hf_translations(model, hf_dir, sentences, beams, extra):
    """`MarianTokenizer` and `generate` on one sentence at a time, as long as ours may run
    (source pieces with EOS + extra), padding never drawn, no length penalty."""
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    out = []
    for sentence in sentences:
        batch = tokenizer([sentence], return_tensors="pt")
        with torch.no_grad():
            tokens = model.generate(**batch, num_beams=beams, do_sample=False,
                                    max_new_tokens=batch["input_ids"].shape[1] + extra,
                                    length_penalty=0.0, suppress_tokens=[0], **IDS)
        out.append(tokenizer.decode(tokens[0], skip_special_tokens=True))
    return out


def _random_marian(tmp_path):
    """A random SiLU Marian with scaled embeddings and a random final_logits_bias, saved with
    MarianTokenizer's files in tmp_path/marian: the model and that directory."""
    hf_dir = tmp_path / "marian"
    hf_dir.mkdir()
    _vocabulary(hf_dir)
    torch.manual_seed(0)
    hf_model = transformers.MarianMTModel(transformers.MarianConfig(
        **SIZES, activation_function="swish", scale_embedding=True))
    hf_model.final_logits_bias.normal_(0.0, 1.0)
    _save(hf_model, hf_dir)
    return hf_model, hf_dir


def test_marian_logits_translations_and_round_trip(tmp_path):
    hf_model, hf_dir = _random_marian(tmp_path)
    workdir, run, params = _import(tmp_path, hf_dir)
    assert (run.model.activation, run.model.logits_bias, run.model.norm_position) == (
        "silu", True, "post")
    # The source as MarianTokenizer reads it (pieces, then EOS) is ours.
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    ours = transformer.load(workdir)
    assert hf_tokenizer(SOURCES)["input_ids"] == ours.encode(SOURCES)
    rng = np.random.default_rng(0)
    inputs = rng.integers(4, V, (2, 9)).astype(np.int64)
    inputs[:, -1], inputs[1, 5:] = 3, 0  # EOS; row 1 right-padded
    targets = rng.integers(4, V, (2, 7)).astype(np.int64)
    expected = _hf_logits(hf_model, inputs, targets)
    logits = Transformer(run.model).apply({"params": params}, inputs.astype(np.int32),
                                          targets.astype(np.int32))
    np.testing.assert_allclose(np.asarray(logits), expected, atol=ATOL, rtol=0)
    translations = {}
    for beams in (1, 4):
        theirs = _hf_translations(hf_model, hf_dir, SOURCES, beams, extra=5)
        translations[beams] = ours.translate(SOURCES, beam_size=beams, alpha=0.0,
                                             max_extra_length=5, batch_size=1)
        assert translations[beams] == theirs, beams
    assert translations[1] != translations[4]  # the beams find what greedy does not
    reloaded = _check_round_trip(tmp_path, workdir, hf_dir, transformers.MarianMTModel)
    np.testing.assert_array_equal(_hf_logits(reloaded, inputs, targets), expected)
    for name in (marian.SOURCE_SPM, marian.VOCAB_JSON):
        assert (tmp_path / "exported" / name).read_bytes() == (hf_dir / name).read_bytes()


def _generated_ids(model, tokenizer, sentence, beams, extra, **ids):
    """`generate`'s best output for `sentence` (as `_hf_translations` runs it), without the
    decoder start, up to and with its first end, padding dropped."""
    batch = tokenizer([sentence], return_tensors="pt")
    with torch.no_grad():
        tokens = model.generate(**batch, num_beams=beams, do_sample=False, length_penalty=0.0,
                                max_new_tokens=batch["input_ids"].shape[1] + extra,
                                suppress_tokens=[0], **ids)
    return [int(i) for i in tokens[0][1:] if i != 0]


def test_a_marian_listing_two_ends_translates_as_generate(tmp_path):
    """generation_config.json lists eos_token_id [3, X] (X: the second piece that the one-end
    model's greedy translation of a source emits): the import keeps both ends, our greedy
    and beam-4 outputs stop where `generate`'s do (id for id, the text before the end), and
    the export lists both again."""
    hf_model, hf_dir = _random_marian(tmp_path)
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    one_end = _generated_ids(hf_model, hf_tokenizer, SOURCES[0], 1, 5, **IDS)
    assert len(one_end) > 3 and 3 not in one_end[:2]
    end = one_end[1]
    generation = json.loads((hf_dir / convert.GENERATION_CONFIG).read_text())
    (hf_dir / convert.GENERATION_CONFIG).write_text(json.dumps(generation | {
        "eos_token_id": [3, end]}))
    workdir, _, _ = _import(tmp_path, hf_dir)
    special = json.loads((tmp_path / "run" / "vocab" / "special_ids.json").read_text())
    assert special["eos_ids"] == [3, end]
    ours = transformer.load(workdir)
    exported = tmp_path / "exported"
    convert.export_workdir(workdir, str(exported))
    assert json.loads((exported / convert.GENERATION_CONFIG).read_text())["eos_token_id"] == [
        3, end]
    stopped = 0
    for hf_path in (hf_dir, exported):
        model = transformers.MarianMTModel.from_pretrained(str(hf_path)).eval()
        for beams in (1, 4):
            for sentence in SOURCES:
                theirs = _generated_ids(model, hf_tokenizer, sentence, beams, 5)
                row = ours.translate_ids(ours.encode([sentence]), beam_size=beams, alpha=0.0,
                                         max_extra_length=5)[0]
                assert [int(i) for i in row if i != 0] == theirs, (hf_path, beams, sentence)
                stopped += theirs[-1] == end
                text = ours.translate([sentence], beam_size=beams, alpha=0.0,
                                      max_extra_length=5)
                assert text == [hf_tokenizer.decode(theirs[:-1], skip_special_tokens=True)]
    assert stopped >= 2  # greedy (at least) stops at the second end


def _papers_run(tmp_path, load_config, rows=V):
    """A post-LN run of our paper's recipe (configs/default.py's model, post-LN; interleaved
    sinusoids, ReLU, LayerNorm eps 1e-6), random weights scaled for sharper logits, its V-piece
    vocabulary padded to `rows` embedding rows where more: its workdir, model and
    parameters."""
    cfg = load_config("default.py", **{
        "data.vocab_size": rows, "model.num_encoder_layers": 2, "model.num_decoder_layers": 2,
        "model.d_model": 32, "model.d_ff": 64, "model.num_heads": 4, "model.max_len": 64,
        "model.norm_position": "post"})
    run = resolve(cfg)
    assert run.model.norm_eps == 1e-6 and run.model.positional == "sinusoidal"
    model = Transformer(run.model)
    tokens = jax.numpy.ones((1, 1), jax.numpy.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens, tokens)["params"])
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    table = params["embedding"]["embedding"]  # padding rows made likely (none where rows = V)
    params["embedding"]["embedding"] = table.at[V:].multiply(PADDING_SCALE)
    workdir = params_run(tmp_path / "run", cfg, params)
    tokenizer = tokenizer_lib.train(TRANSLATION_SENTENCES, V, seed=0)
    tokenizer_lib.Tokenizer(tokenizer.model_proto, rows).save(str(workdir / "vocab"))
    return workdir, model, params


def _float32_error(model: TransformerConfig, logits: np.ndarray, source_length: int,
                   target_length: int) -> float:
    """How far float32 arithmetic may move the logits between two implementations (ours in
    XLA, transformers' in torch) on any x86-64 CPU: each sum of n terms rounds to within
    n x 2^-24 of its size in the worst order (another BLAS, thread count or XLA version
    reorders sums; ~sqrt(n) x 2^-24 typically), and along the path from an embedding to a
    logit the sums hold N terms in all: a norm's mean and variance (2D), a projection (D), the
    scores (d_k), the softmax's sum and the values (2 x keys), the output projection (heads x
    d_v), the feed-forward (D, then d_ff) in each layer, the logits (D). N x 2^-24 of the
    largest logit (a LayerNorm passes on relative errors, not the scale): at this model's
    size, N = 1,588 and 1.2e-3, where the two implementations differ by ~1e-4 (2026-12)."""
    d = model.d_model
    heads = model.num_heads

    def attention(keys):
        return 2 * d + d + model.d_k + 2 * keys + heads * model.d_v

    ffn = 2 * d + d + model.d_ff
    terms = (model.num_encoder_layers * (attention(source_length) + ffn)
             + model.num_decoder_layers * (attention(target_length) + attention(source_length)
                                           + ffn) + d)
    return terms * 2.0 ** -24 * float(np.abs(logits).max())


def _assert_same_logits(hf_model, model, params, *, target_ids: int) -> None:
    """The exported Marian's logits are ours on 2 random sources (EOS-ended, one padded) and
    targets of ids below `target_ids`, apart from float32 rounding (`_float32_error`), at
    either LayerNorm epsilon: as exported (transformers fixes Marian's at 1e-5) against our
    model at 1e-5, and with its LayerNorms set to the run's epsilon against the run's model.
    The epsilon's own effect on our logits (the run's against 1e-5, in one arithmetic) is
    nonzero and within its bound: a LayerNorm's output moves by (1e-5 - eps) / (2 var)
    relative where its input has variance var, and each of the model's norms (their inputs'
    smallest variance measured on the way) passes that on to the largest logit."""
    rng = np.random.default_rng(1)
    inputs = rng.integers(4, V, (2, 9)).astype(np.int64)
    inputs[:, -1], inputs[1, 5:] = 3, 0
    targets = rng.integers(4, target_ids, (2, 7)).astype(np.int64)
    variances = []

    def layer_norm(x, scale, bias=None, *, eps):
        variances.append(float(np.asarray(x, np.float64).var(-1).min()))
        return layer_norm_fn(x, scale, bias, eps=eps)

    layer_norm_fn = layers.layer_norm
    with mock.patch.object(layers, "layer_norm", layer_norm):  # model.apply runs eagerly
        ours = np.asarray(model.apply({"params": params}, inputs.astype(np.int32),
                                      targets.astype(np.int32)))
    at_marian_eps = np.asarray(Transformer(dataclasses.replace(
        model.config, norm_eps=marian.HF_NORM_EPS)).apply(
        {"params": params}, inputs.astype(np.int32), targets.astype(np.int32)))
    atol = _float32_error(model.config, ours, inputs.shape[1], targets.shape[1])
    np.testing.assert_allclose(_hf_logits(hf_model, inputs, targets), at_marian_eps,
                               atol=atol, rtol=0)
    norms = [m for m in hf_model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == len(variances) and {m.eps for m in norms} == {marian.HF_NORM_EPS}
    try:
        for m in norms:
            m.eps = model.config.norm_eps
        np.testing.assert_allclose(_hf_logits(hf_model, inputs, targets), ours, atol=atol,
                                   rtol=0)
    finally:
        for m in norms:
            m.eps = marian.HF_NORM_EPS
    eps_effect = np.abs(at_marian_eps - ours).max()
    bound = (len(variances) * abs(marian.HF_NORM_EPS - model.config.norm_eps)
             / (2 * min(variances)) * np.abs(ours).max())
    assert (model.config.norm_eps == marian.HF_NORM_EPS) or 0 < eps_effect <= bound, (
        eps_effect, bound)


def test_the_papers_model_trained_here_exports_to_marian(tmp_path, load_config):
    """The paper's model loads as a MarianMTModel whose logits are ours (its features
    reordered into Marian's split sinusoid layout; its eps becomes 1e-5, which moves the
    logits by less than float32 arithmetic does here: each is compared at its eps, the
    eps's effect bounded apart, `_assert_same_logits`) and whose greedy
    translation is ours. Exported over an earlier export of another tokenizer kind, the
    directory holds Marian's files alone."""
    workdir, model, params = _papers_run(tmp_path, load_config)
    (tmp_path / "hf").mkdir()
    for stale in ("tokenizer.json", "tokenizer.model", "spiece.model", "generation_config.json"):
        (tmp_path / "hf" / stale).write_text("stale")
    convert.export_workdir(str(workdir), str(tmp_path / "hf"))
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == [
        "config.json", "model.safetensors", "source.spm", "target.spm", "tokenizer_config.json",
        "vocab.json"]
    hf_model = transformers.MarianMTModel.from_pretrained(str(tmp_path / "hf")).eval()
    _assert_same_logits(hf_model, model, params, target_ids=V)
    translator = transformer.load(str(workdir))
    theirs = _hf_translations(hf_model, tmp_path / "hf", SOURCES, 1, extra=5)
    assert translator.translate(SOURCES, beam_size=1, alpha=0.0, max_extra_length=5,
                                batch_size=1) == theirs


def test_a_padded_run_exports_to_marian_and_back(tmp_path, load_config):
    """A run whose V-piece vocabulary is padded to V + 8 embedding rows (vocab/special_ids.json)
    exports as a Marian of V + 8 rows whose vocab.json lists the V pieces and the 8 padding
    rows (special tokens): `from_pretrained` and `MarianTokenizer` load it, its logits are
    ours and its greedy translations are ours (with padding rows made likely, so that both
    decoders meet them, and `MarianTokenizer.decode` drops them as ours); the export imports
    back with the padded vocabulary and the same tensors."""
    rows = V + 8
    workdir, model, params = _papers_run(tmp_path, load_config, rows)
    out = tmp_path / "hf"
    convert.export_workdir(str(workdir), str(out))
    config = json.loads((out / convert.HF_CONFIG).read_text())
    vocab = json.loads((out / marian.VOCAB_JSON).read_text())
    assert (config["vocab_size"], len(vocab), max(vocab.values())) == (rows, rows, rows - 1)
    hf_model = transformers.MarianMTModel.from_pretrained(str(out)).eval()
    _assert_same_logits(hf_model, model, params, target_ids=rows)
    translator = transformer.load(str(workdir))
    generated = translator.translate_ids(translator.encode(SOURCES), beam_size=1, alpha=0.0,
                                         max_extra_length=5)
    assert (generated >= V).any()  # a padding row, which MarianTokenizer must decode
    theirs = _hf_translations(hf_model, out, SOURCES, 1, extra=5)
    assert translator.translate(SOURCES, beam_size=1, alpha=0.0, max_extra_length=5,
                                batch_size=1) == theirs
    back = tmp_path / "back"
    convert.import_checkpoint(str(out), str(back))
    vocabulary = tokenizer_lib.load(str(back / "vocab"))
    assert (vocabulary.vocab_size, vocabulary.pieces) == (rows, V)
    assert transformer.load(str(back)).translate(
        SOURCES, beam_size=1, alpha=0.0, max_extra_length=5, batch_size=1) == theirs


def test_the_decoding_peer_benchmark_translates_as_transformers(tmp_path, load_config):
    """benchmarks/peers/marian.py on the paper's model: one sentence a batch at alpha 0, ours
    and `generate`'s greedy and beam-4 outputs are the same; BLEU and speeds are reported."""
    import runpy

    workdir, _, _ = _papers_run(tmp_path, load_config)
    compare = runpy.run_path(str(convert.CONFIGS_DIR.parent / "benchmarks" / "peers" /
                                 "marian.py"))["compare"]
    records = compare(str(workdir), SOURCES, SOURCES, beam_sizes=[4, 1], batch_size=1,
                      alpha=0.0, rounds=1)
    assert [(r["beam_size"], r["identical"]) for r in records] == [(4, 2), (1, 2)]
    for r in records:
        assert r["ours_bleu"] == r["theirs_bleu"] and r["ours_sentences_per_sec"] > 0


@pytest.mark.parametrize("field, value, message", [
    ("norm_position", "pre", "norm_position='pre' (wants 'post')"),
    ("positional", "rope", "positional='rope' (wants 'sinusoidal')"),
    ("tie_output_embedding", False, "tie_output_embedding=False"),
])
def test_what_marian_cannot_express_is_refused_on_export(field, value, message):
    from transformer.huggingface import families

    cfg = TransformerConfig(**{field: value})
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        families.for_model(cfg, "--workdir=w")
    assert "\n" not in str(error.value) and "closest is Marian" in str(error.value)


@pytest.mark.parametrize("change, message", [
    (dict(pad_token_id=58, eos_token_id=0, decoder_start_token_id=58),
     r"pad_token_id/decoder_start_token_id/eos_token_id=\(58, 58, 0\)"),
    (dict(decoder_ffn_dim=32), "decoder_ffn_dim=32"),
    (dict(share_encoder_decoder_embeddings=False), "share_encoder_decoder_embeddings=False"),
])
def test_unsupported_marian_variants_are_one_line_errors(tmp_path, change, message):
    hf_dir = tmp_path / "marian"
    torch.manual_seed(0)
    _save(transformers.MarianMTModel(transformers.MarianConfig(**SIZES)), hf_dir)
    config = json.loads((hf_dir / convert.HF_CONFIG).read_text())
    (hf_dir / convert.HF_CONFIG).write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=message):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_imported_marian_fine_tunes_on_the_offline_corpus(tmp_path, load_config,
                                                              offline_fixture_data_dir):
    """`init_from` on an imported MarianMTModel: configs/default.py's data and optimizer with
    the checkpoint's model and vocabulary; the run starts from its weights, the loss falls,
    and the result translates and exports again."""
    import dataclasses

    from conftest import SHRUNK_DEFAULT
    from ml_collections import ConfigDict

    from transformer.training.loop import train_and_evaluate

    hf_dir = tmp_path / "marian"
    hf_dir.mkdir()
    _vocabulary(hf_dir)
    torch.manual_seed(0)
    _save(transformers.MarianMTModel(transformers.MarianConfig(
        **(SIZES | dict(init_std=0.02)), activation_function="swish", scale_embedding=True,
        dropout=0.0)), hf_dir)
    pretrained = tmp_path / "imported"
    convert.import_checkpoint(str(hf_dir), str(pretrained), overrides={"model.dtype": "float32"})
    imported = json.loads((pretrained / "config.json").read_text())["model"]
    cfg = load_config("default.py", **{
        **{k: v for k, v in SHRUNK_DEFAULT.items() if not k.startswith("model.")},
        "data.vocab_size": V, "data.data_dir": str(offline_fixture_data_dir),
        "num_train_steps": 30, "eval_every_steps": 30, "bleu_every_steps": 30,
        "log_every_steps": 1, "optimizer.warmup_steps": 3, "init_from": str(pretrained)})
    cfg.model = ConfigDict(imported)
    workdir = tmp_path / "finetuned"
    train_and_evaluate(cfg, str(workdir))
    assert (workdir / "vocab" / tokenizer_lib.MODEL_FILE).read_bytes() == (
        hf_dir / marian.SOURCE_SPM).read_bytes()
    with open(workdir / "metrics.jsonl") as f:
        train = [line for line in map(json.loads, f) if line["split"] == "train"]
    losses = [line["loss"] for line in train]
    assert len(losses) == 30 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses
    # The weights moved from the imported ones (not from a fresh initialisation, whose
    # correlation with them is ~0). Adam moves a weight by at most ~1.7 x the learning rate an
    # update ((1 - b1) / sqrt((1 - b2) (1 - b1**2 / b2)) for b1 0.9, b2 0.98); moves of that
    # size, independent of the weights, leave the correlation at spread / hypot(spread, moved).
    before, after = (averaging.load_params(str(w))["embedding"]["embedding"]
                     for w in (pretrained, workdir))
    moved = 1.7 * sum(line["learning_rate"] for line in train)
    floor = np.std(before) / np.hypot(np.std(before), moved)
    assert np.corrcoef(np.ravel(before), np.ravel(after))[0, 1] > floor > 0.1
    translator = transformer.load(str(workdir))
    assert dataclasses.asdict(translator.model_config)["logits_bias"]
    assert len(translator.translate(SOURCES, beam_size=2)) == 2
    convert.export_workdir(str(workdir), str(tmp_path / "exported"))
    reloaded = transformers.MarianMTModel.from_pretrained(str(tmp_path / "exported"))
    assert reloaded.config.activation_function == "swish"


def _opus_marian(tmp_path):
    """A random SiLU Marian with OPUS-MT's ids (EOS 0, unk 1, pad = decoder start = the last
    id; `vocab.json` numbering a unigram `source.spm`'s pieces) in tmp_path/opus: the model,
    that directory, its pad id and its config.json's ids."""
    import io

    import sentencepiece as spm

    hf_dir = tmp_path / "opus"
    hf_dir.mkdir()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRANSLATION_SENTENCES), model_writer=model, vocab_size=72,
        model_type="unigram", unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2)
    for name in (marian.SOURCE_SPM, marian.TARGET_SPM):
        (hf_dir / name).write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [processor.id_to_piece(i) for i in range(2, processor.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1, **{p: 2 + i for i, p in enumerate(pieces)}}
    vocab["<pad>"] = pad = len(vocab)
    (hf_dir / marian.VOCAB_JSON).write_text(json.dumps(vocab))
    ids = dict(pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad,
               forced_eos_token_id=0)
    torch.manual_seed(0)
    hf_model = transformers.MarianMTModel(transformers.MarianConfig(
        **(SIZES | ids | dict(vocab_size=pad + 1)), activation_function="swish"))
    hf_model.final_logits_bias.normal_(0.0, 1.0)
    _save(hf_model, hf_dir)
    return hf_model, hf_dir, pad, ids


def test_a_marian_with_opus_mt_ids_imports_renumbered(tmp_path):
    """OPUS-MT's ids (EOS 0, unk 1, pad = decoder start = the last id; `vocab.json` numbering
    a unigram `source.spm`'s pieces): the run's vocabulary and model take our ids (one row
    longer), encode sources as `MarianTokenizer` does, give its logits and its greedy and
    beam translations (its pad never generated, as its `bad_words_ids` say)."""
    hf_model, hf_dir, pad, ids = _opus_marian(tmp_path)
    workdir, run, params = _import(tmp_path, hf_dir)
    order = marian.opus_order(json.loads((hf_dir / "config.json").read_text()))
    assert run.model.vocab_size == pad + 2 == len(order)
    to_ours = np.argsort(order, kind="stable")[:pad + 1]  # Marian id -> ours
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    ours = transformer.load(workdir)
    theirs_ids = hf_tokenizer(SOURCES)["input_ids"]
    assert [to_ours[row].tolist() for row in theirs_ids] == ours.encode(SOURCES)
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, pad, (2, 9))
    inputs[:, -1], inputs[1, 5:] = 0, pad  # EOS; row 1 right-padded
    targets = rng.integers(2, pad, (2, 7))
    decoder_inputs = np.concatenate([np.full((2, 1), pad), targets[:, :-1]], axis=1)
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor(inputs),
                            attention_mask=torch.tensor(inputs != pad),
                            decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()
    logits = np.asarray(Transformer(run.model).apply(
        {"params": params}, to_ours[inputs].astype(np.int32), to_ours[targets].astype(np.int32)))
    real = [i for i in range(len(order)) if i not in (0, 2)]  # pad and BOS: Marian's pad
    np.testing.assert_allclose(logits[..., real], expected[..., order[real]], atol=ATOL, rtol=0)
    for beams in (1, 4):
        translations = []
        for sentence in SOURCES:
            batch = hf_tokenizer([sentence], return_tensors="pt")
            with torch.no_grad():
                tokens = hf_model.generate(
                    **batch, num_beams=beams, do_sample=False, length_penalty=0.0,
                    max_new_tokens=batch["input_ids"].shape[1] + 5, bad_words_ids=[[pad]],
                    **ids)
            translations.append(hf_tokenizer.decode(tokens[0], skip_special_tokens=True))
        assert ours.translate(SOURCES, beam_size=beams, alpha=0.0, max_extra_length=5,
                              batch_size=1) == translations, beams


def _fine_tuned_run(tmp_path, workdir, params):
    """A run started from `workdir` (its init_from; the vocabulary copied as training copies
    it) holding `params` moved by noise, every tensor: its workdir and parameters."""
    from transformer.checkpoint import layout
    from transformer.training import transfer

    cfg = layout.load_config(workdir)
    cfg.init_from = str(workdir)
    tuned = jax.tree.map(lambda x: np.asarray(x) + np.random.default_rng(x.size).normal(
        0, 0.05, x.shape).astype(np.float32), params)
    out = params_run(tmp_path / "tuned_run", cfg, tuned)
    transfer.copy_vocabulary(transfer.parse(str(workdir)), str(out), cfg.data.vocab_size)
    return str(out), tuned


def test_an_imported_opus_mt_marian_fine_tuned_exports_back(tmp_path):
    """An OPUS-MT Marian imported (its vocabulary renumbered to ours, its SentencePiece files
    kept in vocab/) exports back bit-exact with OPUS-MT's ids; a run fine-tuned from it
    (init_from; every tensor moved, our pad and BOS rows apart) exports with the checkpoint's
    `source.spm`, `target.spm` and `vocab.json` (found through init_from), which
    `MarianTokenizer` loads (the original's ids), and `MarianMTModel` gives our logits within
    ATOL (float32 in either order, as the import's comparison). A run whose vocabulary no
    longer matches the kept files is refused in one line before anything is written."""
    hf_model, hf_dir, pad, _ = _opus_marian(tmp_path)
    workdir, run, params = _import(tmp_path, hf_dir)
    _check_round_trip(tmp_path, workdir, hf_dir, transformers.MarianMTModel)
    tuned_dir, tuned = _fine_tuned_run(tmp_path, workdir, params)
    table = tuned["embedding"]["embedding"]
    assert np.abs(table[0] - table[2]).max() > 0.01
    out = tmp_path / "tuned"
    convert.export_workdir(tuned_dir, str(out))
    for name in (marian.SOURCE_SPM, marian.TARGET_SPM, marian.VOCAB_JSON):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()
    original = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    exported = transformers.MarianTokenizer.from_pretrained(str(out))
    assert exported(SOURCES)["input_ids"] == original(SOURCES)["input_ids"]
    reloaded = transformers.MarianMTModel.from_pretrained(str(out)).eval()
    assert (reloaded.config.pad_token_id, reloaded.config.decoder_start_token_id,
            reloaded.config.eos_token_id, reloaded.config.vocab_size) == (pad, pad, 0, pad + 1)
    assert reloaded.generation_config.bad_words_ids == [[pad]]
    order = marian.opus_order(reloaded.config.to_dict())
    to_ours = np.argsort(order, kind="stable")[:pad + 1]
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, pad, (2, 9))
    inputs[:, -1], inputs[1, 5:] = 0, pad
    targets = rng.integers(2, pad, (2, 7))
    decoder_inputs = np.concatenate([np.full((2, 1), pad), targets[:, :-1]], axis=1)
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(
            inputs != pad), decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()
    ours = np.asarray(Transformer(run.model).apply(
        {"params": tuned}, to_ours[inputs].astype(np.int32), to_ours[targets].astype(np.int32)))
    real = [i for i in range(len(order)) if i not in (0, 2)]  # pad and BOS: Marian's pad
    np.testing.assert_allclose(ours[..., real], theirs[..., order[real]], atol=ATOL, rtol=0)
    translator = transformer.load(tuned_dir)
    for sentence in SOURCES:  # generate reads the ids and bad_words_ids the export wrote
        batch = exported([sentence], return_tensors="pt")
        with torch.no_grad():
            tokens = reloaded.generate(**batch, num_beams=1, do_sample=False,
                                       max_new_tokens=batch["input_ids"].shape[1] + 5)
        assert translator.translate([sentence], beam_size=1, alpha=0.0, max_extra_length=5) == [
            exported.decode(tokens[0], skip_special_tokens=True)]
    vocab = json.loads((tmp_path / "run" / "vocab" / marian.VOCAB_JSON).read_text())
    first, second = sorted(vocab, key=vocab.get)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "run" / "vocab" / marian.VOCAB_JSON).write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="no longer the one") as error:
        convert.export_workdir(tuned_dir, str(tmp_path / "refused"))
    assert "\n" not in str(error.value) and not (tmp_path / "refused").exists()
