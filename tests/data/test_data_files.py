"""Own data from files (`transformer/data/files.py`): every format reads the documents written,
the on-the-fly permutation is a bijection, each epoch's order visits every document once with a
batch drawing from one window of shards, every bad input is one line naming the file, and a
language model's batches from a glob of jsonl.zst shards are a pure function of (seed, index)."""

import gzip
import hashlib
import json
import pathlib
import runpy

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import byte_level_bpe

from transformer.data import file_formats, file_specs, files
from transformer.data.permutation import Permutation

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ("the cat sat on a mat and dog ran far away from home in rain while birds sang over "
         "green hills near old stone bridges").split()


def documents(count, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(4, 30)))) for _ in range(count)]


def write_jsonl(path, records, compress=None):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if compress == "gz":
        data = gzip.compress(data)
    elif compress == "zst":
        data = zstandard.ZstdCompressor().compress(data)
    pathlib.Path(path).write_bytes(data)


def write_shards(directory, docs, shards, ext="jsonl.zst", nested=False):
    directory.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(np.array_split(np.arange(len(docs)), shards)):
        records = [{"meta": {"text": docs[i]}, "id": int(i)} if nested else {"text": docs[i]}
                   for i in part]
        write_jsonl(directory / f"part-{k:03d}.{ext}", records, ext.rsplit(".", 1)[-1]
                    if ext.endswith(("gz", "zst")) else None)
    return directory


# --------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_permutation_is_a_bijection_fixed_by_its_key(n):
    perm = Permutation(n, (3, 1))
    out = perm(np.arange(n))
    np.testing.assert_array_equal(np.sort(out), np.arange(n))
    np.testing.assert_array_equal(out[n // 3:], perm(np.arange(n // 3, n)))  # index by index
    if n >= 64:
        assert not np.array_equal(out, Permutation(n, (3, 2))(np.arange(n)))
        assert not np.array_equal(out, np.arange(n))
        # near-uniform: each element's mean position is about (n - 1) / 2 over many keys
        positions = np.mean([np.argsort(Permutation(n, (k,))(np.arange(n)))[:8]
                             for k in range(400)], axis=0)
        np.testing.assert_allclose(positions, (n - 1) / 2, rtol=0.12)


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt",
                                 "txt_paragraphs", "array_record"])
def test_every_format_reads_the_documents_written(fmt, tmp_path, monkeypatch):
    docs = documents(30)
    parts = np.array_split(np.arange(30), 3)
    ext = fmt.replace("txt_paragraphs", "txt")
    for k, part in enumerate(parts):
        path = tmp_path / f"shard-{k}.{ext}"
        if fmt.startswith("jsonl"):
            write_jsonl(path, [{"meta": {"text": docs[i]}} for i in part],
                        fmt.split(".")[1] if "." in fmt else None)
        elif fmt == "parquet":
            pq.write_table(pa.table({"meta": [{"text": docs[i], "n": int(i)} for i in part]}),
                           path)
        elif fmt == "txt":
            path.write_text("\n".join(docs[i] for i in part) + "\n")
        elif fmt == "txt_paragraphs":
            path.write_text("\n\n".join(docs[i].replace(" on ", "\non\n") for i in part))
        else:
            from array_record.python.array_record_module import ArrayRecordWriter

            writer = ArrayRecordWriter(str(path), "group_size:1")
            for i in part:
                writer.write(json.dumps({"meta": {"text": docs[i]}}).encode())
            writer.close()
    spec = {"txt": "text:", "txt_paragraphs": "text_paragraphs:"}.get(fmt, "")
    read = file_formats.ShardReader.read
    decoded = []
    monkeypatch.setattr(file_formats.ShardReader, "read",
                        lambda self, path: decoded.append(path) or read(self, path))
    source = files.FileDocuments(f"{spec}{tmp_path}/shard-*.{ext}", fields=("meta.text",))
    assert len(source) == 30
    # parquet's metadata and ArrayRecord's index count the rows; the other formats are read
    assert len(decoded) == (0 if fmt in ("parquet", "array_record") else 3)
    got = source.texts(np.arange(30))
    expected = [d.replace(" on ", "\non\n") for d in docs] if fmt == "txt_paragraphs" else docs
    assert got == expected


def test_the_format_is_inferred_from_the_extension_and_tfds_names_stay_tfds():
    assert file_specs.parse_spec("/d/train-*.jsonl.zst") == ("jsonl", "/d/train-*.jsonl.zst")
    assert file_specs.parse_spec("gs://b/c4/en/*.json.gz") == ("jsonl", "gs://b/c4/en/*.json.gz")
    assert file_specs.parse_spec("data/*.parquet") == ("parquet", "data/*.parquet")
    assert file_specs.parse_spec("text:/d/books/*") == ("text", "/d/books/*")
    for name in ("c4/en", "c4/en:3.0.1", "c4/en.noblocklist:3.*.*", "wmt14_translate/de-en",
                 "huggingface:mnist/mnist", "offline_de_en"):
        assert file_specs.parse_spec(name) is None, name


def test_a_path_that_is_no_file_and_no_tfds_name_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("some/dir/data", "some/dir/*", "corpus/*.jsonl.bz2", "~/no-such-dir-x/*",
                 "/no/such/dir/*.bin", "shards/"):
        with pytest.raises(file_specs.BadData) as e:
            file_specs.parse_spec(spec)
        where = str(pathlib.Path(spec.replace("~", str(pathlib.Path.home()))).absolute())
        assert str(e.value) == (
            f"data.dataset={spec!r} is not a TFDS name and no file matches {where!r}; check "
            f"the path, or write it as <format>:<glob> with format one of jsonl, parquet, "
            f"text, text_paragraphs, arrayrecord")
    (tmp_path / "some/dir").mkdir(parents=True)
    (tmp_path / "some/dir/data").write_text("a\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/train").write_text("a\n")  # TFDS's name shape, but a file here
    for spec in ("some/dir/data", "some/dir/*", "mine/train"):
        with pytest.raises(file_specs.BadData, match=r"cannot tell the format.*<format>:<glob>"):
            file_specs.parse_spec(spec)
    with pytest.raises(file_specs.BadData, match=r"data.eval_dataset='some/dir/\*': cannot tell"):
        files.FileDocuments("some/dir/*", setting="data.eval_dataset")
    assert file_specs.parse_spec("text:some/dir/*") == ("text", "some/dir/*")
    for spec in ("some/dir/*.jsonl", "some/dir/file.jsonl", "jsonl:some/dir"):
        with pytest.raises(file_specs.BadData) as e:
            files.FileDocuments(spec)
        path = spec.removeprefix("jsonl:")
        assert str(e.value) == (f"data.dataset={path!r} matches no file "
                                f"({str(tmp_path / path)!r}); check the path")


def test_a_hub_layout_directory_reads_bare_or_as_parquet(tmp_path):
    """A directory in the Hugging Face hub's layout is found by split name whether it is named
    bare or as `parquet:<dir>`."""
    for split, docs in (("train", documents(12)), ("validation", documents(4, seed=1))):
        pq.write_table(pa.table({"text": docs}), tmp_path / f"{split}-00000-of-00001.parquet")
    for spec in (str(tmp_path), f"parquet:{tmp_path}", f"parquet:{tmp_path}/"):
        assert file_specs.parse_spec(spec) == ("parquet", f"{tmp_path}/train-*.parquet"), spec
        assert file_specs.split_spec(spec, "validation") == (
            f"parquet:{tmp_path}/validation-*.parquet")
        assert files.FileDocuments(spec).texts(range(12)) == documents(12)


# --------------------------------------------------------------------------- order


def test_each_epoch_visits_every_document_once_a_window_at_a_time(tmp_path):
    write_shards(tmp_path, documents(230), shards=10)
    source = files.FileDocuments(f"{tmp_path}/*.jsonl.zst", seed=5, shuffle_window=3)
    n = len(source)
    first = source.order(0, np.arange(n))
    second = source.order(1, np.arange(n))
    for order in (first, second):
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(source.order(0, np.arange(40, 90)), first[40:90])
    # the first window: the rows of exactly 3 shards, all of them, before any other's
    shard = np.searchsorted(source.offsets, first, side="right") - 1
    first_three = []
    for k in shard:
        if k not in first_three:
            first_three.append(k)
        if len(first_three) == 3:
            break
    size = int(source.counts[first_three].sum())
    assert set(shard[:size]) == set(first_three)
    assert not set(shard[size:]) & set(first_three)
    again = files.FileDocuments(f"{tmp_path}/*.jsonl.zst", seed=5, shuffle_window=3)
    np.testing.assert_array_equal(again.order(0, np.arange(n)), first)


def test_a_record_of_the_shards_rows_spares_later_readers_the_count(tmp_path, monkeypatch):
    write_shards(tmp_path / "train", documents(230), shards=5)
    (tmp_path / "train/part-002.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b'{"text": "a b"}\n{"text": oops}\n{"text": "c d"}\n'))
    spec = f"{tmp_path}/train/*.jsonl.zst"
    record = str(tmp_path / "vocab")
    plain = files.FileDocuments(spec, seed=3, skip_bad_lines=True)
    first = files.FileDocuments(spec, seed=3, skip_bad_lines=True, record_dir=record)
    np.testing.assert_array_equal(first.counts, plain.counts)
    assert len(list((tmp_path / "vocab").glob("rows-*.json"))) == 1
    reads = []
    read = file_formats.ShardReader.read
    monkeypatch.setattr(file_formats.ShardReader, "read", lambda self, path: reads.append(path) or
                        read(self, path))
    again = files.FileDocuments(spec, seed=3, skip_bad_lines=True, record_dir=record)
    assert reads == [] and again.skipped_lines == plain.skipped_lines == 1
    n = len(plain)
    np.testing.assert_array_equal(again.order(0, np.arange(n)), plain.order(0, np.arange(n)))
    write_jsonl(tmp_path / "train/part-004.jsonl.zst", [{"text": "e f"}] * 3, "zst")
    changed = files.FileDocuments(spec, seed=3, skip_bad_lines=True, record_dir=record)
    assert len(reads) == 5  # a shard changed: every shard counted again
    assert changed.counts.tolist() == plain.counts.tolist()[:4] + [3]
    assert len(list((tmp_path / "vocab").glob("rows-*.json"))) == 1


def test_a_sample_reads_a_bounded_number_of_shards_whatever_the_corpus(tmp_path, monkeypatch):
    write_shards(tmp_path, documents(400), shards=20)
    source = files.FileDocuments(f"{tmp_path}/*.jsonl.zst", seed=4)
    n = len(source)
    # no more shards than the bound: a uniform draw over every document, as before the bound
    np.testing.assert_array_equal(source.sample(50, (7,)),
                                  np.sort(Permutation(n, (4, 7))(np.arange(50))))
    monkeypatch.setattr(files, "SAMPLE_SHARDS", 3)
    reads = []
    read = file_formats.ShardReader.read
    monkeypatch.setattr(file_formats.ShardReader, "read", lambda self, path: reads.append(path) or
                        read(self, path))
    ids = source.sample(45, (7,))
    assert len(ids) == 45 and len(set(ids.tolist())) == 45 and np.all(np.diff(ids) > 0)
    shards = np.unique(np.searchsorted(source.offsets, ids, side="right") - 1)
    assert len(shards) == 3
    source.texts(ids)
    assert len(reads) == 3  # the chosen shards alone are read
    np.testing.assert_array_equal(source.sample(45, (7,)), ids)  # a function of the key
    assert not np.array_equal(source.sample(45, (8,)), ids)
    assert len(source.sample(10_000, (7,))) == int(source.counts[shards].sum())  # all of them


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_are_one_line_naming_the_file(tmp_path):
    good = tmp_path / "good.jsonl"
    write_jsonl(good, [{"text": "a b"}, {"text": "c d"}])

    def refused(spec, match, **kw):
        with pytest.raises(file_specs.BadData, match=match) as e:
            files.FileDocuments(spec, **kw)
        assert "\n" not in str(e.value)

    refused(f"{tmp_path}/nothing-*.jsonl", "matches no file")
    refused(str(good), r"no field 'body' \(it has \['text'\]\)", fields=("body",))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/a.jsonl").write_text('{"text": "x"}\n{"text": oops}\n{"text": "y"}\n')
    refused(f"{tmp_path}/bad/*.jsonl", r"bad/a.jsonl:2: malformed JSON.*skip_bad_lines")
    skipping = files.FileDocuments(f"{tmp_path}/bad/*.jsonl", skip_bad_lines=True)
    assert skipping.skipped_lines == 1 and skipping.texts([0, 1]) == ["x", "y"]
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1/a.jsonl").write_bytes('{"text": "Stra\xdfe"}\n'.encode("latin-1"))
    refused(f"{tmp_path}/latin1/*.jsonl", r"latin1/a.jsonl:1: not UTF-8")
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "empty/a.jsonl", [{"text": "a"}])
    (tmp_path / "empty/b.jsonl").write_text("")
    refused(f"{tmp_path}/empty/*.jsonl", r"empty/b.jsonl has no documents")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    refused(str(tmp_path / "ints.parquet"), r"ints.parquet: column 'text' is int64, not a string")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "body.parquet")
    refused(str(tmp_path / "body.parquet"), r"no column 'text' \(it has \['body'\]\)")
    (tmp_path / "corpus.bin").write_bytes(b"x")
    refused(f"{tmp_path}/*.bin", "cannot tell the format")
    refused("gs://no-such-bucket-for-tests/*.jsonl", r"gs://no-such-bucket-for-tests/\*.jsonl")


# --------------------------------------------------------------------------- language model


def small_lm_files_config(tmp_path):
    """configs/lm_files.py on 600 documents in 6 nested jsonl.zst shards (and 40 to evaluate)
    written under tmp_path, with a 2-layer model of width 32 and 6 steps."""
    write_shards(tmp_path / "train", documents(600), shards=6, nested=True)
    write_shards(tmp_path / "validation", documents(40, seed=1), shards=2, nested=True)
    cfg = runpy.run_path(str(ROOT / "configs/lm_files.py"))["get_config"]()
    cfg.data.update(dict(dataset=f"jsonl:{tmp_path}/train/*.jsonl.zst", text_field="meta.text",
                         eval_dataset=f"{tmp_path}/validation/*.jsonl.zst", vocab_size=64,
                         max_length=32, batch_size=8, shuffle_window=2))
    cfg.model.update(dict(d_model=32, d_ff=64, num_heads=2, num_kv_heads=1,
                          num_decoder_layers=2, max_len=32))
    cfg.update(dict(num_train_steps=6, eval_every_steps=6, checkpoint_every_steps=3,
                    log_every_steps=1))
    return cfg


@pytest.fixture
def lm_files_config(tmp_path):
    return small_lm_files_config(tmp_path)


def test_language_model_batches_from_files_are_a_function_of_the_index(lm_files_config,
                                                                       tmp_path):
    from transformer.data.language_model import from_config

    source = from_config(lm_files_config, str(tmp_path / "run"))
    again = from_config(lm_files_config, str(tmp_path / "run"))  # a restart: the saved vocab
    assert len(list((tmp_path / "run/vocab").glob("rows-*.json"))) == 2  # train, validation
    assert source.num_train_documents == 600
    whole = source.train_batch(7, (0, 8))
    halves = [again.train_batch(7, rows) for rows in ((0, 4), (4, 8))]
    for key, value in whole.items():
        np.testing.assert_array_equal(value, np.concatenate([h[key] for h in halves], 1))
    assert (whole["targets_segmentation"] > 0).mean() > 0.7
    # the batch holds the tokens of the documents the order names, each cut with EOS
    docs = source.batch_documents(7)
    texts = source.documents["train"].texts(docs)
    pieces, _ = source.train_pieces(7)
    ids = [list(e) + [source.tokenizer.eos_id] for e in source.tokenizer.encode(texts)]
    expected = [e[i:i + 32] for e in ids for i in range(0, len(e), 32)]
    assert [np.asarray(p).tolist() for p in pieces] == expected
    assert len(set(docs.tolist())) == len(docs) == source.docs_per_batch
    assert not np.array_equal(whole["targets"], source.train_batch(8, (0, 8))["targets"])
    evaluated = sum(int((b["targets_segmentation"] > 0).sum())
                    for b in source.eval_batches("validation", (0, 8)))
    assert evaluated == sum(map(len, source._eval_plan[0]))


@pytest.mark.parametrize("objective", ["causal", "span_corruption"])
def test_packing_groups_let_a_process_tokenize_only_its_rows_documents(lm_files_config,
                                                                       tmp_path, objective):
    from transformer.data import batching
    from transformer.data.language_model import from_config

    lm_files_config.data.update(dict(pack_groups=4, objective=objective))
    lm_files_config.grad_accum_steps = 2  # a group: one row of each micro-batch of 4 rows
    if objective == "span_corruption":
        lm_files_config.data.num_sentinels = 10
        lm_files_config.model.update(dict(architecture="encoder_decoder",
                                          num_encoder_layers=1, num_decoder_layers=1))
    source = from_config(lm_files_config, str(tmp_path / "run"))
    runs = [source.group_documents(5, g) for g in range(4)]  # group g: row g of each micro-batch
    np.testing.assert_array_equal(np.concatenate(runs), source.batch_documents(5))
    whole = source.train_batch(5, (0, 4))  # [micro, rows, length]
    read = []
    texts = source._texts
    source._texts = lambda split, ids: read.extend(np.asarray(ids).tolist()) or texts(split, ids)
    half = source.train_batch(5, (0, 2))  # rows 0-1 of both micro-batches: groups 0 and 1
    assert sorted(read) == sorted(np.concatenate([runs[0], runs[1]]).tolist())
    for key, value in half.items():
        np.testing.assert_array_equal(value, whole[key][:, :2])
    side = "inputs" if objective == "span_corruption" else "targets"
    if objective == "causal":  # each group: its documents' pieces, first-fit into its 2 rows
        for g, run in enumerate(runs):
            pieces = source._cut(source.documents["train"].texts(run))
            placement = batching.first_fit(np.zeros(len(pieces), int), [len(p) for p in pieces], 2,
                                           32, drop=True)
            rows = batching.pack([(np.zeros(0, np.int32), p) for p in pieces],
                                 placement, (0, 2), 0, 32)["targets"]
            np.testing.assert_array_equal(whole["targets"][:, g], rows)
    assert (whole[f"{side}_segmentation"] > 0).mean() > 0.6
    lm_files_config.data.pack_groups = 3
    with pytest.raises(ValueError, match=r"^data.pack_groups=3 must divide the 4 rows of a "
                                         r"micro-batch \(data.batch_size=8 / "
                                         r"grad_accum_steps=2\)$"):
        from_config(lm_files_config, str(tmp_path / "run"))


def test_language_model_from_files_needs_an_eval_dataset(lm_files_config):
    from transformer.data.language_model import from_config

    lm_files_config.data.eval_dataset = None
    with pytest.raises(ValueError, match="set data.eval_dataset"):
        from_config(lm_files_config)


# --------------------------------------------------------------------------- mixtures


def test_a_mixture_draws_each_source_s_token_share_within_1_percent(lm_files_config, tmp_path):
    from transformer.data.language_model import from_config

    rng = np.random.default_rng(2)
    for name, (low, high) in (("web", (5, 20)), ("code", (30, 80)), ("books", (60, 200))):
        docs = [" ".join(rng.choice(WORDS, int(rng.integers(low, high)))) for _ in range(300)]
        write_shards(tmp_path / name, docs, shards=3)
    weights = {"web": 0.7, "code": 0.2, "books": 0.1}
    lm_files_config.data.sources = [{"dataset": f"{tmp_path}/{n}/*.jsonl.zst", "weight": w}
                                    for n, w in weights.items()]
    lm_files_config.data.text_field = "text"
    lm_files_config.data.eval_dataset = f"{tmp_path}/web/*.jsonl.zst"
    source = from_config(lm_files_config)
    mixture = source.documents["train"]
    tokens = np.zeros(3)
    for index in range(300):  # several epochs of the small sources
        ids = source.batch_documents(index)
        lengths = [len(t) + 1 for t in source.tokenizer.encode(mixture.texts(ids))]
        np.add.at(tokens, mixture.source_of(ids), lengths)
    np.testing.assert_allclose(tokens / tokens.sum(), list(weights.values()), atol=0.01)
    again = from_config(lm_files_config)
    np.testing.assert_array_equal(again.batch_documents(123), source.batch_documents(123))
    lm_files_config.data.sources[1]["weight"] = 0.0
    with pytest.raises(file_specs.BadData, match=r"data.sources\[1\].weight=0.0 must be positive"):
        from_config(lm_files_config)


def test_data_vocab_path_uses_an_existing_sentencepiece_model_as_is(lm_files_config, tmp_path):
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.data.language_model import from_config

    given = tokenizer_lib.train(documents(300, seed=4), 64, seed=9)
    path = given.save(str(tmp_path / "mine"))
    lm_files_config.data.vocab_path = path
    source = from_config(lm_files_config, str(tmp_path / "run"))
    assert source.tokenizer.sha256 == given.sha256
    kept = tokenizer_lib.load(str(tmp_path / "run" / "vocab"))
    assert kept.sha256 == given.sha256  # the run's own copy, for resume and inference
    lm_files_config.data.vocab_path = str(tmp_path / "missing.model")
    lm_files_config.data.dataset = f"jsonl:{tmp_path}/none/*.jsonl"  # read after the path
    with pytest.raises(ValueError, match=r"^data.vocab_path=.*missing.model.*not a readable"):
        from_config(lm_files_config, str(tmp_path / "other"))


def train_tokenizer_json(path, special_tokens, texts):
    """A byte-level BPE tokenizer.json (GPT-2's kind) of 300 ids saved at `path`."""
    model = byte_level_bpe(texts, vocab_size=300, special_tokens=special_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(str(path))
    return model


def test_data_vocab_path_uses_a_hugging_face_tokenizer_json_as_is(lm_files_config, tmp_path):
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.data.language_model import LanguageModelSource, from_config

    texts = documents(300, seed=4)
    library = train_tokenizer_json(tmp_path / "mine/tokenizer.json",
                                   ["<pad>", "<unk>", "<s>", "</s>"], texts)
    lm_files_config.data.vocab_path = str(tmp_path / "mine/tokenizer.json")
    size = library.get_vocab_size()
    lm_files_config.data.vocab_size = lm_files_config.model.vocab_size = size
    source = from_config(lm_files_config, str(tmp_path / "run"))
    special = source.tokenizer.bos_id, source.tokenizer.eos_id, source.tokenizer.pad_id
    assert special == (2, 3, 0)
    sample = documents(20, seed=7) + ["Straße, 東京 — ünïcode"]
    expected = [e.ids for e in library.encode_batch(sample, add_special_tokens=False)]
    assert source.tokenizer.encode(sample) == expected
    assert [source.tokenizer.decode(ids + [3, 9]) for ids in expected] == sample  # stops at eos
    batch = source.train_batch(0, (0, 8))
    first = batch["targets"][0, 0][batch["targets_segmentation"][0, 0] == 1]  # accum 0, row 0
    pieces = [e.ids + [3] for e in library.encode_batch(
        source._texts("train", source.batch_documents(0)), add_special_tokens=False)]
    assert first.tolist() in [p[i:i + 32] for p in pieces for i in range(0, len(p), 32)]
    kept = tokenizer_lib.load(str(tmp_path / "run/vocab"))  # the run's copy, for resume
    assert kept.sha256 == source.tokenizer.sha256 and kept.eos_id == 3
    other = train_tokenizer_json(tmp_path / "other/tokenizer.json",
                                 ["<pad>", "<unk>", "<s>", "</s>", "<x>"], texts)
    lm_files_config.data.vocab_path = str(tmp_path / "other/tokenizer.json")
    lm_files_config.data.vocab_size = lm_files_config.model.vocab_size = other.get_vocab_size()
    with pytest.raises(tokenizer_lib.VocabularyMismatch, match=r"not the vocabulary this run "
                       r"started with"):
        from_config(lm_files_config, str(tmp_path / "run"))
    data = lm_files_config.data
    with pytest.raises(ValueError, match=r"data.objective='masked' needs a \[MASK\] piece"):
        LanguageModelSource(data.dataset, objective="masked", vocab_size=data.vocab_size,
                            max_length=32, batch_size=8, text_field="meta.text",
                            eval_dataset=data.eval_dataset, vocab_path=data.vocab_path)


@pytest.mark.slow
def test_a_run_trains_and_evaluates_with_a_given_tokenizer_json(lm_files_config, tmp_path):
    from transformer.training.loop import train_and_evaluate

    library = train_tokenizer_json(tmp_path / "mine/tokenizer.json",
                                   ["<pad>", "<unk>", "<s>", "</s>"], documents(300, seed=4))
    lm_files_config.data.vocab_path = str(tmp_path / "mine/tokenizer.json")
    lm_files_config.data.vocab_size = lm_files_config.model.vocab_size = library.get_vocab_size()
    lm_files_config.update(dict(num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2))
    lm_files_config.optimizer.warmup_steps = 1
    train_and_evaluate(lm_files_config, str(tmp_path / "run"))
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    losses = {(m["step"], m["split"]): m["loss"] for m in metrics if "loss" in m}
    assert sorted(losses) == [(1, "train"), (2, "train"), (2, "validation")]
    # the first loss is about that of a uniform guess over the vocabulary
    np.testing.assert_allclose(losses[1, "train"], np.log(library.get_vocab_size()), rtol=0.1)
    config = json.loads((tmp_path / "run/config.json").read_text())
    digest = hashlib.sha256((tmp_path / "mine/tokenizer.json").read_bytes()).hexdigest()
    assert config["provenance"]["vocabulary"].startswith("tokenizer.json")
    assert config["provenance"]["vocabulary"].endswith(f"sha256={digest}")


def test_a_tokenizer_json_needs_an_eos_token_and_keeps_gpt2s_ids(tmp_path):
    from transformer.data import tokenizer as tokenizer_lib

    texts = documents(50)
    train_tokenizer_json(tmp_path / "gpt2/tokenizer.json", ["<|endoftext|>"], texts)
    gpt2 = tokenizer_lib.read_given(str(tmp_path / "gpt2/tokenizer.json"))
    assert (gpt2.bos_id, gpt2.eos_id, gpt2.pad_id) == (0, 0, None)  # id 0 an ordinary token
    train_tokenizer_json(tmp_path / "bare/tokenizer.json", ["<unk>", "<s>"], texts)
    with pytest.raises(tokenizer_lib.VocabularyMismatch) as e:
        tokenizer_lib.read_given(str(tmp_path / "bare/tokenizer.json"))
    assert str(e.value) == (
        f"data.vocab_path={str(tmp_path / 'bare/tokenizer.json')!r} has no end-of-sequence "
        f"token: add one of </s>, <|endoftext|>, <|end_of_text|>, <eos>, [SEP] as a special "
        f"token (it has ['<s>', '<unk>'])")
    (tmp_path / "broken.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=r"broken.json' is not a readable tokenizer.json "
                       r"\(Exception\); give a SentencePiece model or a Hugging Face"):
        tokenizer_lib.read_given(str(tmp_path / "broken.json"))


# --------------------------------------------------------------------------- classification


def test_text_classification_reads_labelled_files(tmp_path):
    from transformer.data.text_classification import TextClassificationSource

    rng = np.random.default_rng(5)
    names = ("books", "code", "web")

    def labelled(count):
        labels = rng.integers(0, 3, count)
        return [{"body": {"text": " ".join(rng.choice(WORDS, 6)) + f" {names[c]}"},
                 "topic": names[c]} for c in labels]

    train = labelled(64)
    validation = labelled(10)
    write_jsonl(tmp_path / "train.jsonl", train)
    pq.write_table(pa.table({"body": [r["body"] for r in validation],
                             "topic": [r["topic"] for r in validation]}),
                   tmp_path / "validation.parquet")
    source = TextClassificationSource(
        str(tmp_path / "train.jsonl"), eval_dataset=str(tmp_path / "validation.parquet"),
        vocab_size=48, max_length=96, batch_size=8, text_feature="body.text",
        label_feature="topic", num_classes=3)
    assert source.class_names == names
    rows, labels = source.split("validation")
    assert labels.tolist() == [names.index(r["topic"]) for r in validation]
    decoded = [source.tokenizer.decode(row) for row in rows]
    assert decoded == [r["body"]["text"] for r in validation]
    batch = source.train_batch(2, (0, 8))
    assert batch["inputs"].shape == (1, 8, 96) and batch["label"].shape == (1, 8)
    write_jsonl(tmp_path / "odd.jsonl", [{"body": {"text": "a b"}, "topic": "poetry"}])
    with pytest.raises(file_specs.BadData, match="label 'poetry' is not a class"):
        TextClassificationSource(
            str(tmp_path / "train.jsonl"), eval_dataset=str(tmp_path / "odd.jsonl"),
            vocab_size=48, max_length=16, batch_size=8, text_feature="body.text",
            label_feature="topic")
    with pytest.raises(file_specs.BadData, match=r"train.jsonl:1: no label field 'label'"):
        TextClassificationSource(
            str(tmp_path / "train.jsonl"), eval_dataset=str(tmp_path / "odd.jsonl"),
            vocab_size=48, max_length=16, batch_size=8, text_feature="body.text")


def test_masked_replacements_are_pieces_never_padding_rows(lm_files_config):
    """A vocabulary padded past its pieces (an imported checkpoint's): BERT's random
    replacements are real pieces, never one of the padding rows."""
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.data.language_model import LanguageModelSource

    trained = tokenizer_lib.train(documents(300, seed=4), 64, seed=0)
    padded = tokenizer_lib.Tokenizer(trained.model_proto, vocab_size=128)
    data = lm_files_config.data
    source = LanguageModelSource(data.dataset, objective="masked", vocab_size=128,
                                 max_length=32, batch_size=8, text_field="meta.text",
                                 eval_dataset=data.eval_dataset, tokenizer=padded, mask_rate=0.5)
    batches = [source.train_batch(i, (0, 8)) for i in range(20)]
    inputs = np.concatenate([b["inputs"].ravel() for b in batches])
    replaced = np.concatenate([(b["targets"] != 0) & (b["inputs"] != b["targets"])
                               & (b["inputs"] != padded.mask_id) for b in batches], None)
    assert replaced.sum() > 100  # ~13 random pieces a batch; half were >= 64 when drawn from rows
    assert inputs.max() < 64


def test_text_classification_uses_data_vocab_path_and_records_the_rows(tmp_path, monkeypatch):
    """A tokenizer.json given as data.vocab_path: rows are its ids and its own eos (id 1 here,
    not ours), a copy kept in <workdir>/vocab/; the rows per shard are recorded there and a
    second construction counts none; a bad path, or one without padding at id 0, is one line
    before any file is read."""
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.data.text_classification import TextClassificationSource

    rng = np.random.default_rng(3)
    records = [{"text": " ".join(rng.choice(WORDS, 5)), "label": int(rng.integers(0, 2))}
               for _ in range(40)]
    (tmp_path / "train").mkdir()
    write_jsonl(tmp_path / "train/a.jsonl", records[:16])
    write_jsonl(tmp_path / "train/b.jsonl", records[16:32])
    write_jsonl(tmp_path / "validation.jsonl", records[32:])
    library = train_tokenizer_json(tmp_path / "mine/tokenizer.json",
                                   ["<pad>", "</s>", "<s>", "<unk>"], documents(100))
    counted = []
    count = files.FileDocuments._count
    monkeypatch.setattr(files.FileDocuments, "_count",
                        lambda self, k: counted.append(self.paths[k]) or count(self, k))

    def source(vocab_path, dataset=f"{tmp_path}/train/*.jsonl"):
        return TextClassificationSource(
            dataset, eval_dataset=str(tmp_path / "validation.jsonl"),
            vocab_size=library.get_vocab_size(), max_length=12, batch_size=8, num_classes=2,
            workdir=str(tmp_path / "run"), vocab_path=vocab_path)

    first = source(str(tmp_path / "mine/tokenizer.json"))
    rows, labels = first.split("validation")
    for row, record in zip(rows, records[32:], strict=True):
        ids = library.encode(record["text"], add_special_tokens=False).ids[:11] + [1]
        assert row.tolist() == ids + [0] * (12 - len(ids))
    assert labels.tolist() == [r["label"] for r in records[32:]]
    kept = tokenizer_lib.load(str(tmp_path / "run/vocab"))
    assert kept.sha256 == first.tokenizer.sha256 and kept.eos_id == 1
    assert len(counted) == 3 and len(list((tmp_path / "run/vocab").glob("rows-*.json"))) == 2
    counted.clear()
    again = source(str(tmp_path / "mine/tokenizer.json"))
    assert counted == []  # the record's counts: no shard read to count
    np.testing.assert_array_equal(again.train_batch(1, (0, 8))["inputs"],
                                  first.train_batch(1, (0, 8))["inputs"])
    with pytest.raises(ValueError, match=r"^data.vocab_path='.*missing.json' is not a readable"):
        source(str(tmp_path / "missing.json"), dataset=f"{tmp_path}/none/*.jsonl")
    train_tokenizer_json(tmp_path / "bare/tokenizer.json", ["<unk>", "</s>"], documents(100))
    with pytest.raises(tokenizer_lib.VocabularyMismatch, match=r"has no padding token at id 0"):
        source(str(tmp_path / "bare/tokenizer.json"), dataset=f"{tmp_path}/none/*.jsonl")
