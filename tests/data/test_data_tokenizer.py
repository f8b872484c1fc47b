"""SentencePiece: special ids, round trip, seeded training, reuse and mismatch errors."""

import json
import pathlib

import pytest

from transformer.data import tokenizer as tokenizer_lib
from transformer.data.offline import corpus

FIXTURE = pathlib.Path(__file__).parent / "offline_de_en"


@pytest.fixture(scope="module")
def sentences():
    return [s for pair in corpus.libreoffice_pairs(str(FIXTURE)) for s in pair]


@pytest.fixture(scope="module")
def tokenizer(sentences):
    return tokenizer_lib.train(sentences, 300, seed=0)


def test_special_ids_and_mask(tokenizer):
    assert tokenizer.vocab_size == 300
    assert [tokenizer.id_to_piece(i) for i in range(5)] == ["<pad>", "<unk>", "<s>", "</s>",
                                                            "[MASK]"]
    assert tokenizer.mask_id == 4
    assert tokenizer.encode(["[MASK]"])[0][-1] == 4  # user-defined: never split


def test_round_trip(tokenizer, sentences):
    ids = tokenizer.encode(sentences)
    assert all(min(seq) >= 4 and tokenizer_lib.EOS_ID not in seq for seq in ids if seq)
    for text, seq in zip(sentences, ids, strict=True):
        assert tokenizer.decode(seq) == text
    seq = ids[0]
    bos = tokenizer_lib.BOS_ID
    eos = tokenizer_lib.EOS_ID
    assert tokenizer.decode([bos, *seq, eos, 17, 18, 0, 0]) == sentences[0]
    assert tokenizer.decode(seq + [tokenizer_lib.PAD_ID] * 3) == sentences[0]


def test_training_is_seeded_and_deterministic(sentences, tokenizer):
    assert tokenizer_lib.train(sentences, 300, seed=0).sha256 == tokenizer.sha256


def test_load_or_train_reuses_and_refuses_mismatches(tmp_path, sentences):
    calls = []

    def source():
        calls.append(1)
        return iter(sentences)

    vocab = tmp_path / "vocab"
    first = tokenizer_lib.load_or_train(str(vocab), 300, seed=0, sentences=source,
                                        info={"dataset": "x"})
    assert (vocab / tokenizer_lib.MODEL_FILE).exists() and (vocab / "sentencepiece.vocab").exists()
    assert json.loads((vocab / "info.json").read_text())["sha256"] == first.sha256
    again = tokenizer_lib.load_or_train(str(vocab), 300, seed=0, sentences=source,
                                        expected_sha256=first.sha256)
    assert again.sha256 == first.sha256 and len(calls) == 1  # reused, not retrained
    with pytest.raises(tokenizer_lib.VocabularyMismatch, match="data.vocab_size=400"):
        tokenizer_lib.load_or_train(str(vocab), 400, seed=0, sentences=source)
    with pytest.raises(tokenizer_lib.VocabularyMismatch,
                       match="not the vocabulary this run was trained"):
        tokenizer_lib.load_or_train(str(vocab), 300, seed=0, sentences=source,
                                    expected_sha256="0" * 64)


def test_impossible_vocab_size_is_one_line(sentences):
    with pytest.raises(tokenizer_lib.VocabularyMismatch, match="data.vocab_size=100000") as error:
        tokenizer_lib.train(sentences[:20], 100_000, seed=0)
    assert "\n" not in str(error.value)


def test_the_model_reads_the_special_ids_of_its_vocabulary(tokenizer):
    """Ours are pad 0, unk 1, bos 2, eos 3; a model section that says otherwise is one line
    naming the key and the value to set."""
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 2, 3)
    tokenizer_lib.check_special_ids(tokenizer, {})  # the defaults are ours
    with pytest.raises(tokenizer_lib.VocabularyMismatch,
                       match=r"^model.eos_id=2 but the vocabulary's "
                             r"eos_id is 3: set --config.model.eos_id=3$"):
        tokenizer_lib.check_special_ids(tokenizer, {"bos_id": 2, "eos_id": 2, "pad_id": 0})


@pytest.mark.parametrize("remote", [False, True])
def test_a_workdirs_vocabulary_may_be_remote(remote, bucket, sentences, tokenizer, tmp_path,
                                             monkeypatch):
    monkeypatch.chdir(tmp_path)  # a remote path must create nothing here
    root = "gs://bucket/run" if remote else str(tmp_path / "run")

    def files():  # what was written, local paths named as the bucket's
        local = sorted(str(p.relative_to(tmp_path)).replace("run", "gs://bucket/run", 1)
                       for p in tmp_path.rglob("*") if p.is_file())
        return sorted(bucket) + local if remote else local

    first = tokenizer_lib.load_or_train(f"{root}/vocab", 300, seed=0,
                                        sentences=lambda: iter(sentences))
    assert first.sha256 == tokenizer.sha256
    assert files() == [f"gs://bucket/run/vocab/{name}" for name in
                       ("info.json", "sentencepiece.model", "sentencepiece.vocab")]
    model_file = f"{root}/vocab/{tokenizer_lib.MODEL_FILE}"
    assert tokenizer_lib.vocabulary_file(f"{root}/vocab") == model_file
    again = tokenizer_lib.load_or_train(f"{root}/vocab", 300, seed=0, sentences=lambda: 1 / 0,
                                        expected_sha256=first.sha256)  # read back, not retrained
    assert again.sha256 == first.sha256
    imported = tokenizer_lib.HuggingFaceTokenizer(
        b'{"version": "1.0", "model": {"type": "WordLevel", '
        b'"vocab": {"<pad>": 0, "a": 1, "</s>": 2}, '
        b'"unk_token": "a"}}', bos_id=2, eos_id=2, pad_id=0)
    imported.save(f"{root}/imported")
    assert files()[:2] == ["gs://bucket/run/imported/special_ids.json",
                           "gs://bucket/run/imported/tokenizer.json"]
    for loaded in (tokenizer_lib.load(f"{root}/imported"),
                   tokenizer_lib.read_given(f"{root}/imported/tokenizer.json")):
        assert loaded.sha256 == imported.sha256 and (loaded.bos_id, loaded.pad_id) == (2, 0)
    assert tokenizer_lib.read_given(model_file).sha256 == first.sha256
