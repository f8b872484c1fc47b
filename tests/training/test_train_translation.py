"""Training on real translation data (the offline corpus fixture): validation BLEU during
training, the params-only series for averaging, the evaluate CLI agreeing with both, and the
scoring after training (`train.py --score_split`) with the ETA that counts it."""

import json
import math
import pathlib
import runpy
import shutil
import subprocess
import sys

import numpy as np
import pytest
import scipy.special
from conftest import SHRUNK_DEFAULT  # noqa: E402

import transformer  # noqa: E402
from transformer.checkpoint import averaging, layout  # noqa: E402
from transformer.checkpoint.checkpointer import list_steps  # noqa: E402
from transformer.config import resolve  # noqa: E402
from transformer.data import make_source  # noqa: E402
from transformer.data.synthetic import FIRST_TOKEN, SyntheticTask  # noqa: E402
from transformer.data.tokenizer import EOS_ID  # noqa: E402
from transformer.inference.translator import Translator  # noqa: E402
from transformer.model.transformer import Transformer  # noqa: E402
from transformer.training import evaluation, metrics, scores  # noqa: E402
from transformer.training.loop import train_and_evaluate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


class RecordedProgress(metrics.Progress):
    """The loop's Progress, keeping each report's figures and the evaluations measured then."""

    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reports = []
        RecordedProgress.made.append(self)

    def report(self, step):
        figures = super().report(step)
        self.reports.append((step, figures, dict(self.measured), dict(self.compiled)))
        return figures


@pytest.fixture(scope="module")
def run(offline_fixture_data_dir, tmp_path_factory, load_config):
    """4 updates, evaluated every 2, with the test split to score after them (the ETA counts
    it; `score_trained_run` scores it)."""
    workdir = tmp_path_factory.mktemp("run")
    cfg = load_config("default.py", **SHRUNK_DEFAULT, **{
        "data.data_dir": str(offline_fixture_data_dir), "num_train_steps": 4,
        "log_every_steps": 2, "params_every_minutes": 1e-6,  # a params save after every update
        "params_keep": 3})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics, "Progress", RecordedProgress)
        train_and_evaluate(cfg, str(workdir), score_split="test")
    return workdir


def test_the_eta_counts_each_evaluation_and_the_test_scoring_to_come(run):
    """At step 2 nothing is timed yet; at step 4 (before its evaluation) the ETA is its
    validation pass and BLEU decode as step 2's took less their compiling, then the test
    split: its 6 sentences at step 2's seconds per validation sentence (2 of them), its 8
    decoded rows (6 padded to a power of two) at step 2's seconds per row (2), each plus the
    compiling step 2 did."""
    (progress,) = RecordedProgress.made
    assert progress.every == {"validation pass": 2, "BLEU decode": 2}
    assert progress.final == {"test pass": ("validation pass", 6),
                              "test decode": ("BLEU decode", 8)}
    (step2, first, _, _), (step4, last, measured, compiled) = progress.reports
    assert (step2, step4) == (2, 4)
    assert first["eta_untimed"] == ["validation pass", "BLEU decode", "test pass",
                                    "test decode"]
    assert last["eta_untimed"] == []
    assert {kind: (step, items) for kind, (step, _, items) in measured.items()} == {
        "validation pass": (2, 2), "BLEU decode": (2, 2)}
    assert compiled["validation pass"] > 0 and compiled["BLEU decode"] > 0
    passed, decoded = measured["validation pass"][1], measured["BLEU decode"][1]
    assert last["eta_seconds"] == pytest.approx(
        passed * (1 + 6 / 2) + decoded * (1 + 8 / 2) + sum(compiled.values()), rel=1e-12)
    assert {kind: step for kind, (step, _, _) in progress.measured.items()} == {
        "validation pass": 4, "BLEU decode": 4}


def test_scoring_after_training_writes_what_evaluate_writes(run, tmp_path):
    """`train.py --score_split=test`'s scoring in one process: `evaluate_run`'s test line at
    the last step, its files, and the line the evaluate CLI prints."""
    workdir = pathlib.Path(shutil.copytree(run, tmp_path / "run"))
    figures = evaluation.score_trained_run(str(workdir), "test")
    line = metrics_lines(workdir)[-1]
    assert (line["step"], line["split"], line["checkpoint"]) == (4, "test", "latest")
    assert line["bleu_num_sentences"] == figures["bleu_num_sentences"] == 6
    assert line["perplexity"] == figures["perplexity"]
    assert len(eval_file(workdir, "test.latest.translation.txt")) == 6
    assert evaluation.scores_line("test", figures).startswith(
        f"test: perplexity {figures['perplexity']:.2f} | sacreBLEU {figures['bleu']:.2f} (")


def validation_lines(workdir):
    with open(workdir / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return [line for line in lines if line["split"] == "validation"]


def test_validation_lines_carry_loss_and_both_bleus(run, tmp_path):
    lines = validation_lines(run)
    assert [line["step"] for line in lines] == [2, 4]
    for line in lines:
        assert line["perplexity"] == pytest.approx(math.exp(line["loss"]), rel=1e-6)
        assert line["bleu_num_sentences"] == 2
        assert line["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    # The translations scored during training are those evaluate writes; their BLEU rescored.
    workdir = pathlib.Path(shutil.copytree(run, tmp_path / "run"))
    figures = evaluation.evaluate_run(str(workdir), "validation", step=4, num_sentences=2)
    hypotheses = eval_file(workdir, "validation.step4.translation.txt")
    references = eval_file(workdir, "validation.step4.reference.txt")
    rescored = scores.bleu(hypotheses, references, target_lang="de")
    for key in ("bleu", "bleu_tok_compound"):
        assert lines[-1][key] == pytest.approx(rescored[key], abs=1e-9) == figures[key]


def test_validation_loss_is_the_mean_nll_of_each_pair_scored_alone(run):
    """The loss logged during training, from packed and sharded eval batches, against every
    validation pair run through the model alone (no packing, no padding) and its NLL summed
    in numpy: sum over pairs of -log softmax(logits)[target] / the number of target tokens."""
    translator = transformer.load(str(run), step=4)
    source = make_source(translator.config, str(run))
    data, _ = source.eval_split("validation")
    model = Transformer(translator.model_config)
    nll = 0.0
    tokens = 0
    for i in range(len(data)):
        inputs, targets = (np.asarray(x, np.int32)[None] for x in data.pair(i))
        logits = np.asarray(model.apply({"params": translator.params}, inputs, targets,
                                        deterministic=True), np.float64)[0]
        log_probs = logits - scipy.special.logsumexp(logits, axis=-1, keepdims=True)
        nll -= log_probs[np.arange(targets.shape[1]), targets[0]].sum()
        tokens += targets.shape[1]
    assert validation_lines(run)[-1]["loss"] == pytest.approx(nll / tokens, rel=1e-5)


def test_params_series_keeps_the_last_saves_and_the_final_step(run):
    assert list_steps(str(run / "params")) == [2, 3, 4]
    assert list_steps(str(run / "checkpoints")) == [4]


def test_evaluate_cli_reproduces_the_bleu_of_the_last_training_evaluation(run):
    during_training = validation_lines(run)[-1]
    figures = evaluation.evaluate_run(str(run), "validation", num_sentences=2)
    for key in ("loss", "bleu", "bleu_tok_compound", "bleu_num_sentences"):
        assert figures[key] == pytest.approx(during_training[key], rel=1e-6), key
    translations = (run / "eval" / "validation.latest.translation.txt").read_text()
    assert len(translations.splitlines()) == 2


def test_evaluate_searches_with_the_beam_and_alpha_it_is_given(run, tmp_path, monkeypatch):
    seen = {}
    translate = Translator.translate

    def spy(self, sentences, **settings):
        seen.update(settings)
        return translate(self, sentences, **settings)

    monkeypatch.setattr(Translator, "translate", spy)
    workdir = shutil.copytree(run, tmp_path / "run")
    evaluation.evaluate_run(str(workdir), "validation", num_sentences=2, beam_size=2, alpha=1.5)
    assert seen == {"beam_size": 2, "alpha": 1.5}


def metrics_lines(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def eval_file(workdir, name):
    return (workdir / "eval" / name).read_text().splitlines()


def test_evaluate_cli_with_average_prints_records_and_writes_the_same_figures(run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(run, workdir)  # evaluate appends to metrics.jsonl: leave `run` as trained
    before = len(metrics_lines(workdir))
    result = subprocess.run(
        [sys.executable, "-m", "transformer.evaluate", f"--workdir={workdir}",
         "--split=validation", "--average=3", "--num_sentences=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (line,) = metrics_lines(workdir)[before:]
    assert {k for k in line if "/" not in k} == {  # and the per-layer eval health keys
        "step", "split", "loss", "perplexity", "bleu", "bleu_signature", "bleu_tok_compound",
        "bleu_num_sentences", "bleu_num_truncated", "checkpoint"}
    assert "activation_rms/decoder/layers_0" in line
    # The average of params 2, 3 and 4 is recorded at the step it ends with, the latest.
    assert (line["step"], line["split"], line["checkpoint"]) == (4, "validation", "average3")
    assert line["perplexity"] == pytest.approx(math.exp(line["loss"]), rel=1e-6)
    # Step 4's own params score otherwise (not step 3's: the cosine schedule's last update has
    # learning rate 0, so params 3 and 4 are equal).
    assert line["loss"] != pytest.approx(validation_lines(run)[-1]["loss"], rel=1e-6)
    # The second validation pair is longer than the shrunk model's max_len=32 pieces.
    assert (line["bleu_num_sentences"], line["bleu_num_truncated"]) == (2, 1)
    assert result.stdout == (
        f"validation: perplexity {line['perplexity']:.2f} | sacreBLEU {line['bleu']:.2f} "
        f"({line['bleu_signature']}) | tokenized compound-split BLEU "
        f"{line['bleu_tok_compound']:.2f} | 2 sentences, 1 of them truncated to the model's "
        f"max_len (scored as translated)\n")
    # train.py --score_split prints this line with scores_line
    assert result.stdout == evaluation.scores_line("validation", line) + "\n"
    # The files it wrote are the ones it scored.
    sources, references, translations = (
        eval_file(workdir, f"validation.average3.{kind}.txt")
        for kind in ("source", "reference", "translation"))
    assert [len(sources), len(references), len(translations)] == [2, 2, 2]
    rescored = scores.bleu(translations, references, target_lang="de")
    for key in ("bleu", "bleu_tok_compound", "bleu_signature"):
        assert line[key] == rescored[key], key
    # translate --average=3 loads the same averaged params: the same translations.
    result = subprocess.run(
        [sys.executable, "-m", "transformer.translate", f"--workdir={workdir}", "--average=3",
         f"--input={workdir / 'eval' / 'validation.average3.source.txt'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == translations


def test_evaluate_at_a_step_of_the_params_series_reproduces_that_steps_evaluation(run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(run, workdir, ignore=shutil.ignore_patterns("eval"))  # other tests' files
    figures = evaluation.evaluate_run(str(workdir), "validation", step=2, num_sentences=2)
    line = metrics_lines(workdir)[-1]
    assert (line["step"], line["split"], line["checkpoint"]) == (2, "validation", "step2")
    assert {k: v for k, v in line.items() if k not in ("step", "split")} == figures
    during_training = validation_lines(run)[0]
    assert during_training["step"] == 2
    for key in ("loss", "perplexity", "bleu", "bleu_tok_compound", "bleu_num_sentences"):
        assert figures[key] == pytest.approx(during_training[key], rel=1e-6), key
    assert figures["loss"] != pytest.approx(validation_lines(run)[-1]["loss"], rel=1e-6)
    assert sorted(p.name for p in (workdir / "eval").iterdir()) == [
        f"validation.step2.{kind}.txt" for kind in ("reference", "source", "translation")]


def test_evaluate_records_the_step_of_the_params_it_scored(run, tmp_path):
    """The params series can be ahead of the full checkpoints (params_every_minutes saves more
    often, then a preemption): evaluate scores the latest params and must record their step."""
    workdir = tmp_path / "run"
    shutil.copytree(run, workdir, ignore=shutil.ignore_patterns("checkpoints"))
    figures = evaluation.evaluate_run(str(workdir), "validation", num_sentences=2)
    assert figures["loss"] == pytest.approx(validation_lines(run)[-1]["loss"], rel=1e-6)
    line = metrics_lines(workdir)[-1]
    assert (line["step"], line["checkpoint"]) == (4, "latest")  # params/4 scored


class IdTokenizer:
    """Token ids written as numbers, "5 9 4": the synthetic task's text, no SentencePiece."""

    eos_ids = (EOS_ID,)  # the ends a translation stops at

    def encode(self, sentences):
        return [[int(token) for token in sentence.split()] for sentence in sentences]

    def decode(self, ids):
        return " ".join(str(i) for i in ids if i >= FIRST_TOKEN)


def test_a_trained_tiny_model_translates(tmp_path, load_config):
    """BLEU of a model trained for seconds, through the Translator (beam search, the config's
    decode settings) and the evaluation's BLEU. The offline fixture cannot show it (56 training
    pairs: validation BLEU 0.0 after 4 updates and after 40), so configs/tiny.py shrunk to the
    copy task of short sequences, 100 updates."""
    task = SyntheticTask("copy", vocab_size=16, min_length=4, max_length=8, seed=0)
    steps = 100
    cfg = load_config("tiny.py", **{
        "data.task": task.task, "data.vocab_size": task.vocab_size,
        "data.min_length": task.min_length, "data.max_length": task.max_length,
        "seed": task.seed, "num_train_steps": steps, "checkpoint_every_steps": steps,
        "eval_every_steps": 0, "log_every_steps": steps, "model.num_encoder_layers": 1,
        "model.num_decoder_layers": 1, "model.dropout_rate": 0.0, "label_smoothing": 0.0,
        "optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 10})
    train_and_evaluate(cfg, str(tmp_path))
    run = resolve(layout.load_config(str(tmp_path)))
    translator = Translator(run.config, run.model, averaging.load_params(str(tmp_path)),
                            IdTokenizer())
    pairs = [task.example("test", i) for i in range(32)]
    sources = [" ".join(map(str, source)) for source, _ in pairs]
    references = [" ".join(map(str, target[:-1])) for _, target in pairs]  # without EOS
    result = scores.bleu(translator.translate(sources), references)
    # Measured: sacreBLEU 59.76 with beam 4 on these 32 test sequences (greedy: 49.07; greedy
    # after 50 updates: 12.5). The floor is about half the measurement.
    assert result["bleu"] > 30, result


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


def test_decode_peer_benchmark_decodes_what_we_decode(run):
    """benchmarks/peers/decode.py on a trained run: the PyTorch peer, given our weights,
    outputs exactly our greedy and beam translations, and both rates are measured."""
    compare = runpy.run_path(str(ROOT / "benchmarks" / "peers" / "decode.py"))["compare"]
    results = compare(str(run), "validation", 2, [2, 1], 1, 1)
    assert [r["beam_size"] for r in results] == [2, 1]
    for r in results:
        assert r["sentences"] == 2 and r["identical_outputs"] == 1.0
        assert r["ratio"] == pytest.approx(r["ours_sentences_per_sec"]
                                           / r["peer_sentences_per_sec"])
