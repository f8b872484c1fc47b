"""Training on real translation data (the offline corpus fixture): validation BLEU during
training, the params-only series for averaging, and the evaluate CLI agreeing with both."""

import json
import pathlib
import runpy

import pytest
from conftest import SHRUNK_DEFAULT  # noqa: E402

from transformer import evaluate as evaluate_cli  # noqa: E402
from transformer.checkpoint import list_steps  # noqa: E402
from transformer.loop import train_and_evaluate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(offline_fixture_data_dir, tmp_path_factory, load_config):
    workdir = tmp_path_factory.mktemp("run")
    cfg = load_config("default.py", **SHRUNK_DEFAULT, **{
        "data.data_dir": str(offline_fixture_data_dir), "num_train_steps": 4,
        "log_every_steps": 2, "params_every_minutes": 1e-6,  # a params save after every update
        "params_keep": 2})
    train_and_evaluate(cfg, str(workdir))
    return workdir


def validation_lines(workdir):
    with open(workdir / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return [line for line in lines if line["split"] == "validation"]


def test_validation_lines_carry_loss_and_both_bleus(run):
    lines = validation_lines(run)
    assert [line["step"] for line in lines] == [2, 4]
    for line in lines:
        assert line["loss"] > 0 and line["perplexity"] > 1
        assert 0 <= line["bleu"] <= 100 and 0 <= line["bleu_tok_compound"] <= 100
        assert line["bleu_num_sentences"] == 2
        assert line["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")


def test_params_series_keeps_the_last_saves_and_the_final_step(run):
    assert list_steps(str(run / "params")) == [3, 4]
    assert list_steps(str(run / "checkpoints")) == [4]


def test_evaluate_cli_reproduces_the_bleu_of_the_last_training_evaluation(run):
    during_training = validation_lines(run)[-1]
    figures = evaluate_cli.evaluate(str(run), "validation", num_sentences=2)
    for key in ("loss", "bleu", "bleu_tok_compound", "bleu_num_sentences"):
        assert figures[key] == pytest.approx(during_training[key], rel=1e-6), key
    translations = (run / "eval" / "validation.latest.translation.txt").read_text()
    assert len(translations.splitlines()) == 2


def test_bleu_during_training_needs_a_translation_dataset(tmp_path, load_config):
    cfg = load_config("tiny.py", bleu_every_steps=10, bleu_num_sentences=5)
    with pytest.raises(ValueError, match="bleu_every_steps=10 needs a translation dataset"):
        train_and_evaluate(cfg, str(tmp_path))


def test_decode_benchmark_reports_both_searches(run):
    benchmark = runpy.run_path(str(ROOT / "benchmarks" / "decode.py"))["benchmark"]
    rows = benchmark(str(run), "validation", 2, [2, 1], 2)
    assert [r["beam_size"] for r in rows] == [2, 1]
    for r in rows:
        assert r["sentences"] == 2 and r["seconds"] > 0
        assert r["sentences_per_sec"] == pytest.approx(2 / r["seconds"])
        assert r["generated_tokens"] >= 0
