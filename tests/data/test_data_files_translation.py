"""Translation from files: the offline corpus written in the Hugging Face hub's parquet layout
(`hub_layout`) reads back pair for pair by split name, flat `en`/`de` columns and named fields
work too, and `configs/wmt14_files.py` trains from the layout and resumes bit-identically after
SIGKILL."""

import importlib.util
import pathlib
import runpy

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from transformer.data import file_specs, files, hub_layout

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hub(offline_fixture_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "wmt14"
    directory = hub_layout.from_tfds("offline_de_en", str(out), "de-en",
                                     data_dir=str(offline_fixture_data_dir), shards=3)
    return pathlib.Path(directory)


def small_config(dataset):
    cfg = runpy.run_path(str(ROOT / "configs/wmt14_files.py"))["get_config"]()
    cfg.data.update(dict(dataset=str(dataset), vocab_size=200, max_length=32, batch_size=8,
                         tokens_per_batch=0, eval_batch_size=8))
    cfg.model.update(dict(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=32))
    return cfg


def test_the_hub_layout_reads_back_pair_for_pair_by_split(hub, offline_fixture_data_dir,
                                                          tmp_path):
    from transformer.data.datasets import open_split, prepare_dataset, read_pairs
    from transformer.data.translation import from_config

    assert sorted(p.name for p in hub.iterdir())[:2] == ["test-00000-of-00001.parquet",
                                                          "train-00000-of-00003.parquet"]
    assert file_specs.split_spec(str(hub), "validation") == f"parquet:{hub}/validation-*.parquet"
    source = from_config(small_config(hub), str(tmp_path / "run"))
    builder = prepare_dataset("offline_de_en", str(offline_fixture_data_dir))
    for split in ("train", "validation"):
        tfds_split = open_split(builder, split)
        assert len(source._source(split)) == len(tfds_split)
        assert source.raw_pairs(split) == read_pairs(tfds_split, range(len(tfds_split)), "en",
                                                     "de")
    again = from_config(small_config(hub), str(tmp_path / "run"))
    whole = source.train_batch(3, (0, 8))
    halves = [again.train_batch(3, rows) for rows in ((0, 4), (4, 8))]
    for key, value in whole.items():
        np.testing.assert_array_equal(value, np.concatenate([h[key] for h in halves], 1))
    assert (whole["targets_segmentation"] > 0).any()


def test_flat_columns_and_named_fields(tmp_path):
    from transformer.data.translation import _file_split

    pq.write_table(pa.table({"en": ["a house", "a cat"], "de": ["ein Haus", "eine Katze"]}),
                   tmp_path / "flat.parquet")
    pq.write_table(pa.table({"src": ["a dog"], "tgt": ["ein Hund"]}), tmp_path / "named.parquet")
    flat = _file_split(str(tmp_path / "flat.parquet"), "data.dataset", ("en", "de"),
                       (None, None))
    assert flat.__getitems__([1, 0]) == [{"en": "a cat", "de": "eine Katze"},
                                         {"en": "a house", "de": "ein Haus"}]
    named = _file_split(str(tmp_path / "named.parquet"), "data.dataset", ("en", "de"),
                        ("src", "tgt"))
    assert named[0] == {"en": "a dog", "de": "ein Hund"}
    with pytest.raises(file_specs.BadData, match=r"named.parquet: no column 'en' \(it has"):
        _file_split(str(tmp_path / "named.parquet"), "data.dataset", ("en", "de"), (None, None))


def test_the_nested_layout_is_found_once_and_recorded(tmp_path, monkeypatch):
    """jsonl shards of Hugging Face's nested `translation.<code>`: the first construction tries
    the flat columns and falls back, the second reads no shard, from the recorded layout."""
    import json

    from transformer.data.translation import _file_split

    (tmp_path / "train").mkdir()
    for k in range(2):
        (tmp_path / f"train/part-{k}.jsonl").write_text("".join(
            json.dumps({"translation": p}) + "\n" for p in _pairs(5, k)))
    counted = []
    count = files.FileDocuments._count
    monkeypatch.setattr(files.FileDocuments, "_count",
                        lambda self, k: counted.append(self.fields) or count(self, k))

    def split():
        return _file_split(f"jsonl:{tmp_path}/train/*.jsonl", "data.dataset", ("en", "de"),
                           (None, None), record_dir=str(tmp_path / "vocab"))

    first = split()
    assert counted == [("en", "de")] + [("translation.en", "translation.de")] * 2
    assert first[6] == _pairs(5, 1)[1]
    counted.clear()
    again = split()
    assert counted == []  # neither the flat columns tried nor a shard counted
    assert again[6] == first[6]


@pytest.mark.slow
def test_wmt14_files_trains_from_the_layout_and_resumes_after_kill9(hub, tmp_path):
    spec = importlib.util.spec_from_file_location("multihost",
                                                  ROOT / "tests/training/test_multihost.py")
    multihost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(multihost)
    shrink = {"data.dataset": hub, "data.vocab_size": 200, "data.max_length": 32,
              "data.batch_size": 8, "data.eval_batch_size": 8, "data.tokens_per_batch": 0,
              "model.max_len": 32, "model.d_model": 32, "model.d_ff": 64,
              "model.num_heads": 2, "model.num_encoder_layers": 1,
              "model.num_decoder_layers": 1, "num_train_steps": 6, "eval_every_steps": 6,
              "bleu_every_steps": 6, "bleu_num_sentences": 8, "checkpoint_every_steps": 3,
              "checkpoint_every_minutes": 0, "params_every_minutes": 0, "log_every_steps": 1,
              "optimizer.warmup_steps": 1}
    run = dict(overrides=["--config=configs/wmt14_files.py",
                          *(f"--config.{k}={v}" for k, v in shrink.items())], common=())
    multihost.finish(multihost.launch(tmp_path / "ref", processes=1, devices=1, **run))
    killed = tmp_path / "killed"
    procs = multihost.launch(killed, processes=1, devices=1, faults={0: "killafter@3"}, **run)
    procs[0].wait(timeout=600)
    assert procs[0].returncode == -9, multihost.output_of(procs[0])[-2000:]
    multihost.finish(multihost.launch(killed, processes=1, devices=1, **run))
    reference = multihost.figures(tmp_path / "ref")
    assert (6, "validation") in reference and multihost.figures(killed) == reference


def _pairs(count, seed):
    rng = np.random.default_rng(seed)
    english = "the cat sat on a mat and a dog ran home in the rain".split()
    german = "die Katze sass auf einer Matte und ein Hund lief heim im Regen".split()
    return [{"en": " ".join(rng.choice(english, 6)), "de": " ".join(rng.choice(german, 6))}
            for _ in range(count)]


def test_data_vocab_path_and_the_rows_record_from_jsonl_files(tmp_path, monkeypatch):
    """A SentencePiece model given as data.vocab_path is the run's one shared vocabulary, ids as
    its own; the shards' rows are recorded in <workdir>/vocab/ and a second construction
    counts none; a bad path is one line before any file is read."""
    import json

    from transformer.data import tokenizer as tokenizer_lib
    from transformer.data.translation import TranslationSource

    train = _pairs(60, 1)
    validation = _pairs(8, 2)
    (tmp_path / "train").mkdir()
    for k in range(2):
        (tmp_path / f"train/part-{k}.jsonl").write_text(
            "".join(json.dumps(p) + "\n" for p in train[30 * k:30 * (k + 1)]))
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps(p) + "\n" for p in validation))
    texts = [p[lang] for p in train for lang in ("en", "de")]
    given = tokenizer_lib.train(texts, 48, seed=5)
    path = given.save(str(tmp_path / "mine"))
    counted = []
    count = files.FileDocuments._count
    monkeypatch.setattr(files.FileDocuments, "_count",
                        lambda self, k: counted.append(self.paths[k]) or count(self, k))

    def source(vocab_path):
        return TranslationSource(f"jsonl:{tmp_path}/train/*.jsonl", source_lang="en",
                                 target_lang="de", vocab_size=48, max_length=16, batch_size=4,
                                 eval_dataset=f"jsonl:{tmp_path}/validation.jsonl",
                                 workdir=str(tmp_path / "run"), vocab_path=vocab_path)

    first = source(path)
    assert first.tokenizer.sha256 == given.sha256
    assert tokenizer_lib.load(str(tmp_path / "run/vocab")).sha256 == given.sha256  # its copy
    eos = given.eos_id
    for i, pair in enumerate(train):
        ids = [given.encode([pair[lang]])[0] + [eos] for lang in ("en", "de")]
        assert [side.tolist() for side in first.train.pair(i)] == ids
    data, _ = first.eval_split("validation")
    assert data.pair(3)[1].tolist() == given.encode([validation[3]["de"]])[0] + [eos]
    assert len(counted) == 3 and len(list((tmp_path / "run/vocab").glob("rows-*.json"))) == 2
    counted.clear()
    again = source(path)
    assert counted == []  # the record's counts: no shard read to count
    np.testing.assert_array_equal(again.train_batch(2, (0, 4))["inputs"],
                                  first.train_batch(2, (0, 4))["inputs"])
    with pytest.raises(ValueError, match=r"^data.vocab_path='.*missing.model' is not a readable"):
        TranslationSource(f"jsonl:{tmp_path}/none/*.jsonl", source_lang="en", target_lang="de",
                          vocab_size=48, max_length=16, batch_size=4,
                          vocab_path=str(tmp_path / "missing.model"))
