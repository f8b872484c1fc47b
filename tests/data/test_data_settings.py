"""The text sources (translation, language model, text classification) refuse a bad setting
in one and the same line: rows that hold no token and EOS or do not split into microbatches
(`settings.check_rows`), a model that does not fit the data (`settings.check_model_fits`),
files without files to evaluate on (`file_specs.eval_spec`), a vocabulary of another size
(`settings.check_vocab_size`). The first three are checked before any data is read."""

import functools
import types

import ml_collections
import pytest

from transformer.data import file_specs, language_model, text_classification, translation

SOURCES = {
    "translation": functools.partial(translation.TranslationSource, source_lang="en",
                                     target_lang="de"),
    "language_model": functools.partial(language_model.LanguageModelSource,
                                        objective="causal"),
    "text_classification": text_classification.TextClassificationSource,
}
FROM_CONFIG = {"translation": (translation.from_config, {}),
               "language_model": (language_model.from_config, {"objective": "causal"}),
               "text_classification": (text_classification.from_config, {})}
ARCHITECTURE = {"translation": "encoder_decoder", "language_model": "decoder",
                "text_classification": "classifier"}


@pytest.mark.parametrize("kind", SOURCES)
def test_rows_that_cannot_be_packed_are_one_line(kind):
    make = SOURCES[kind]
    with pytest.raises(ValueError, match=r"^data.max_length=1 must be >= 2 \(a token and EOS\)$"):
        make("nowhere", vocab_size=8, max_length=1, batch_size=4)
    with pytest.raises(ValueError, match=r"^data.batch_size=6 \(rows per update\) must be a "
                                         r"positive multiple of grad_accum_steps=4$"):
        make("nowhere", vocab_size=8, max_length=8, batch_size=6, grad_accum_steps=4)


@pytest.mark.parametrize("kind", SOURCES)
def test_a_model_that_does_not_fit_the_data_is_one_line(kind):
    from_config, data = FROM_CONFIG[kind]
    cfg = ml_collections.ConfigDict({
        "data": {"dataset": "nowhere", "vocab_size": 8, "max_length": 32, **data},
        "model": {"vocab_size": 8, "max_len": 16, "positional": "sinusoidal",
                  "architecture": ARCHITECTURE[kind]},
        "grad_accum_steps": 1, "seed": 0})
    with pytest.raises(ValueError, match=r"^data.max_length=32 exceeds model.max_len=16$"):
        from_config(cfg)
    cfg.model.update(max_len=32, vocab_size=9)
    with pytest.raises(ValueError, match=r"^model.vocab_size=9 differs from data.vocab_size=8$"):
        from_config(cfg)


def test_a_vocabulary_of_another_size_is_one_line():
    from transformer.data import settings, tokenizer

    settings.check_vocab_size(types.SimpleNamespace(vocab_size=12), 12)
    with pytest.raises(tokenizer.VocabularyMismatch,
                       match=r"^the tokenizer has 10 pieces but data.vocab_size=12$"):
        settings.check_vocab_size(types.SimpleNamespace(vocab_size=10), 12)


def test_files_without_files_to_evaluate_on_are_one_line(tmp_path):
    assert file_specs.eval_spec("jsonl:a/*.jsonl", "jsonl:b.jsonl", "validation") == (
        "jsonl:b.jsonl")
    (tmp_path / "validation-00000-of-00001.parquet").write_bytes(b"")
    assert file_specs.eval_spec(str(tmp_path), None, "validation") == (
        f"parquet:{tmp_path}/validation-*.parquet")
    with pytest.raises(ValueError, match=r"^data.dataset='jsonl:a/\*.jsonl' is files: set "
                                         r"data.eval_dataset to the files to evaluate on"):
        file_specs.eval_spec("jsonl:a/*.jsonl", None, "validation")
