"""The translation `Source`: the pipeline on `tfds.testing.mock_data` fed with the committed
LibreOffice-help pairs, exactly-once epochs, budgets, per-process rows, packed rows that never
attend across pairs, evaluation coverage, the config dispatch, and missing-data errors."""

import pathlib

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer.data import datasets, make_source, translation
from transformer.data import tokenizer as tokenizer_lib  # noqa: E402
from transformer.data.offline import corpus  # noqa: E402
from transformer.model.transformer import Transformer, TransformerConfig  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "offline_de_en"
ROWS = 4  # 8 rows of 64 per update
ACCUM = 2
LENGTH = 64
BUDGET = 300
VOCAB = 300


def _mock_wmt(pairs):
    """mock_data serving the fixture's pairs as wmt14_translate/de-en (TFDS order: de, en)."""

    def as_data_source(self, split, decoders=None, deserialize_method=None, **kwargs):
        return [{"de": de.encode(), "en": en.encode()} for en, de in pairs[split]]

    return tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE,
                                  as_data_source_fn=as_data_source)


def _placeholder_manual_dir(path):
    """The WMT archive names, empty: enough to pass the check before (mocked) preparation."""
    path.mkdir(exist_ok=True)
    for name in ("training-parallel-europarl-v7.tgz", "training-parallel-commoncrawl.tgz",
                 "training-parallel-nc-v9.tgz", "dev.tgz"):
        (path / name).touch()
    return str(path)


def _wmt_source(pairs, tmp, workdir, **overrides):
    kwargs = dict(source_lang="en", target_lang="de", vocab_size=VOCAB, max_length=LENGTH,
                  batch_size=ROWS * ACCUM, grad_accum_steps=ACCUM, tokens_per_batch=BUDGET,
                  eval_batch_size=4, seed=1, manual_dir=_placeholder_manual_dir(tmp / "manual"),
                  workdir=str(workdir)) | overrides
    with _mock_wmt(pairs):
        source = translation.TranslationSource("wmt14_translate/de-en", **kwargs)
        for split in ("validation", "test"):  # read inside the mock
            source.eval_split(split)
    return source


@pytest.fixture(scope="module")
def pairs():
    return corpus.corpus_pairs(str(FIXTURE))


@pytest.fixture(scope="module")
def source(pairs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mock")
    return _wmt_source(pairs, tmp, tmp / "workdir")


def test_mock_pipeline_batches(source, pairs):
    batch = source.train_batch(0, (0, ROWS))
    assert sorted(batch) == sorted(translation.batching.KEYS)
    assert all(v.shape == (ACCUM, ROWS, LENGTH) and v.dtype == np.int32 for v in batch.values())
    assert source.rows_per_batch == ROWS and source.source_length == LENGTH
    examples, placement = source.batch_examples(0)
    row, src_off, _ = placement[0]
    a, r = divmod(row, ROWS)
    first = batch["inputs"][a, r, src_off:]
    text = source.tokenizer.decode(first)  # decode stops at the pair's EOS
    assert (text, source.tokenizer.decode(source.train.pair(examples[0])[1])) in pairs["train"]
    assert "wmt14_translate/de-en/1.0.0 en->de" in source.fingerprint()
    workdir = pathlib.Path(source.workdir)
    assert (workdir / "vocab" / tokenizer_lib.MODEL_FILE).exists()
    assert list((workdir / "vocab" / "tokens").glob("*-train/meta.json"))


def test_every_example_once_per_epoch_within_budget(source):
    seen = []
    for index in range(source.plans.batches_in_epoch(0)):
        batch = source.train_batch(index, (0, ROWS))
        examples, _ = source.batch_examples(index)
        seen.extend(examples.tolist())
        lengths = (source.train.source_lengths[examples], source.train.target_lengths[examples])
        assert (batch["inputs"] != 0).sum() == lengths[0].sum() <= BUDGET
        assert (batch["targets"] != 0).sum() == lengths[1].sum() <= BUDGET
        a, r, t = np.nonzero(batch["targets"])
        segments = batch["targets_segmentation"][a, r, t]
        assert len(set(zip(a.tolist(), r.tolist(), segments.tolist(), strict=True))) == len(
            examples)
    fits = np.flatnonzero((source.train.source_lengths <= LENGTH)
                          & (source.train.target_lengths <= LENGTH))
    assert sorted(seen) == fits.tolist() and len(fits) == source.num_train_examples
    next_epoch = source.batch_examples(source.plans.batches_in_epoch(0))[0]
    assert len(next_epoch) and set(next_epoch) <= set(fits.tolist())


def test_same_batch_on_one_or_two_processes_and_after_a_restart(source, pairs, tmp_path):
    for index in (0, 3, source.plans.batches_in_epoch(0) + 1):
        whole = source.train_batch(index, (0, ROWS))
        halves = [source.train_batch(index, rows) for rows in ((0, ROWS // 2), (ROWS // 2, ROWS))]
        for key in whole:
            np.testing.assert_array_equal(whole[key], np.concatenate([h[key] for h in halves],
                                                                     axis=1))
    again = _wmt_source(pairs, tmp_path, source.workdir)  # vocab and tokens reused
    assert again.tokenizer.sha256 == source.tokenizer.sha256
    for key, value in source.train_batch(5, (0, ROWS)).items():
        np.testing.assert_array_equal(again.train_batch(5, (0, ROWS))[key], value)


def test_a_gs_workdir_keeps_the_tokenized_split_in_the_bucket(source, pairs, bucket, tmp_path,
                                                               monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # a remote workdir must create nothing here
    built = []  # the sizes of the splits tokenized (train, validation, test)
    build = translation.TokenizedSplit.build
    monkeypatch.setattr(translation.TokenizedSplit, "build", lambda *args: built.append(
        len(data := build(*args))) or data)
    remote = _wmt_source(pairs, tmp_path, "gs://bucket/run")
    assert built == [len(source.train), len(pairs["validation"]), len(pairs["test"])]
    cache = "gs://bucket/run/vocab/tokens/wmt14_translate-de-en-1.0.0-train"
    assert sorted(name for name in bucket if name.startswith("gs://bucket/run/vocab/tokens/")) \
        == [f"{cache}/{name}" for name in ("meta.json", "source_ids.npy", "source_starts.npy",
                                           "target_ids.npy", "target_starts.npy")]  # no .tmp
    again = _wmt_source(pairs, tmp_path, "gs://bucket/run")
    assert built[3:] == built[1:3]  # the training split read from the bucket, not tokenized
    for name in translation.TokenizedSplit.FILES:
        np.testing.assert_array_equal(getattr(again.train, name), getattr(source.train, name))
    for key, value in source.train_batch(5, (0, ROWS)).items():
        np.testing.assert_array_equal(remote.train_batch(5, (0, ROWS))[key], value)
        np.testing.assert_array_equal(again.train_batch(5, (0, ROWS))[key], value)
    assert list((tmp_path / "cwd").iterdir()) == []


def test_eval_covers_the_split_once(source, pairs):
    batches = list(source.eval_batches("test", (0, 4)))
    segments = sum(len(np.unique(b["targets_segmentation"][0, r][b["targets"][0, r] != 0]))
                   for b in batches for r in range(4))
    assert segments == len(pairs["test"])
    halves = [list(source.eval_batches("test", rows)) for rows in ((0, 2), (2, 4))]
    assert len(halves[0]) == len(halves[1]) == len(batches)
    for whole, first, second in zip(batches, *halves, strict=True):
        assert whole["inputs"].shape == (1, 4, LENGTH)
        np.testing.assert_array_equal(whole["targets"],
                                      np.concatenate([first["targets"], second["targets"]], 1))


def test_packed_rows_never_attend_across_pairs(source):
    """The model's logits for a packed row equal each pair's logits computed alone."""
    batch = {k: v[0] for k, v in source.train_batch(0, (0, ROWS)).items()}
    row = int(np.argmax(batch["targets_segmentation"].max(axis=1)))
    assert batch["targets_segmentation"][row].max() >= 2  # a row with several pairs
    cfg = TransformerConfig(vocab_size=VOCAB, num_encoder_layers=1, num_decoder_layers=1,
                            d_model=32, d_ff=64, num_heads=2, max_len=LENGTH, dropout_rate=0.0)
    model = Transformer(cfg)
    packed = {k: v[row:row + 1] for k, v in batch.items()}
    params = model.init(jax.random.key(0), packed["inputs"], packed["targets"])
    logits = jax.jit(model.apply)(params, packed["inputs"], packed["targets"],
                                  **{k: v for k, v in packed.items() if "_" in k})
    count = int(packed["targets_segmentation"].max())
    alone = {k: np.zeros((count, LENGTH), np.int32) for k in ("inputs", "targets")}
    at = {}
    for segment in range(1, count + 1):  # each pair alone, in its own padded row
        for key in alone:
            at[key] = packed[f"{key}_segmentation"][0] == segment
            alone[key][segment - 1, :at[key].sum()] = packed[key][0][at[key]]
        at[segment] = at["targets"]
    alone_logits = jax.jit(model.apply)(params, alone["inputs"], alone["targets"])
    for segment in range(1, count + 1):
        expected = alone_logits[segment - 1, :at[segment].sum()]
        np.testing.assert_allclose(logits[0][at[segment]], expected, atol=2e-5, rtol=2e-5)


def test_make_source_dispatches_offline_config(offline_fixture_data_dir, tmp_path, load_config):
    data_dir = offline_fixture_data_dir
    cfg = load_config("default.py")
    cfg.data.data_dir, cfg.data.vocab_size, cfg.data.max_length = str(data_dir), 200, 32
    cfg.model.max_len, cfg.data.batch_size, cfg.data.tokens_per_batch = 32, 4, 128
    source = make_source(cfg, workdir=str(tmp_path / "run"))
    train_pairs = len(corpus.corpus_pairs(
        str(pathlib.Path(__file__).parent / "offline_de_en"))["train"])
    assert source.fingerprint().startswith(f"offline_de_en/1.0.0 en->de train={train_pairs} ")
    assert "packages=" in source.fingerprint()
    assert source.train_batch(0, (0, 4))["inputs"].shape == (1, 4, 32)
    cfg.model.max_len = 16
    with pytest.raises(ValueError, match="data.max_length=32 exceeds model.max_len=16"):
        make_source(cfg)


def test_missing_wmt_files_is_one_line_naming_them(tmp_path):
    with pytest.raises(datasets.DataUnavailable) as error:
        datasets.prepare_dataset("wmt14_translate/de-en", data_dir=str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "data.manual_dir" in message
    for name in ("training-parallel-europarl-v7.tgz", "training-parallel-commoncrawl.tgz",
                 "training-parallel-nc-v9.tgz", "dev.tgz"):
        assert name in message


def test_pairs_end_in_the_tokenizers_own_eos():
    """A tokenizer whose EOS is not id 3 (an imported T5's is 1): pairs end in its EOS, also
    where an evaluation pair is truncated."""

    class Letters:  # id = letter's position + 2; EOS 1
        eos_id = 1

        def encode(self, texts, num_threads=1):
            return [[ord(c) - ord("a") + 2 for c in text] for text in texts]

    data = translation.TokenizedSplit.build([[("ab", "cde"), ("f", "gh")]], Letters(), np.int32)
    assert [list(map(list, data.pair(i))) for i in range(2)] == [[[2, 3, 1], [4, 5, 6, 1]],
                                                                  [[7, 1], [8, 9, 1]]]
    cut = translation._truncate(data, 3, Letters.eos_id)
    assert list(cut.pair(0)[1]) == [4, 5, 1] and list(cut.pair(1)[1]) == [8, 9, 1]
