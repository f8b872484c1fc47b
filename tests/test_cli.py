"""What the CLIs share: quiet native logs unless asked, progress on stderr, the BLEU line."""

import io
import logging
import os
import re

import pytest

import transformer
from transformer.training import loop, metrics
from transformer.training.metrics import sentences_scored
from transformer.util import cli, progress


def test_native_logs_are_quiet_by_default_and_user_settings_win(monkeypatch):
    for name in cli.QUIET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    cli.quiet_native_logs(["prog"])
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"  # the user's own setting
    assert os.environ["GRPC_VERBOSITY"] == "ERROR" and os.environ["TPU_MIN_LOG_LEVEL"] == "2"


def test_verbosity_flag_or_environment_brings_the_logs_back(monkeypatch):
    monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
    assert not cli.verbose(["prog", "--workdir=w"])
    assert cli.verbose(["prog", "--verbosity=1"]) and cli.verbose(["prog", "-v", "1"])
    monkeypatch.setenv(cli.VERBOSE_ENV, "1")
    assert cli.verbose(["prog"])
    monkeypatch.setenv(cli.VERBOSE_ENV, "0")
    assert not cli.verbose(["prog"])


def test_progress_prints_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    with progress.bar(10, "translating", unit="sentence", interval=0.0, stream=stream) as bar:
        bar.update(4)
        bar.update(6)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\d\d:\d\d:\d\d translating: 4/10 sentences \(40%\), ETA \d:\d\d:\d\d, "
                        r"[\d,.]+/s", lines[0]), lines
    assert "10/10 sentences (100%)" in lines[1]


def test_progress_is_silent_when_short_or_not_shown():
    stream = io.StringIO()
    with progress.bar(10, "translating", stream=stream) as bar:  # done within 30 s
        bar.update(10)
    with progress.bar(None, "reading", interval=0.0, show=False, stream=stream) as bar:
        bar.update(3)
    assert stream.getvalue() == ""


def test_progress_of_an_unknown_total_counts_without_an_eta():
    stream = io.StringIO()
    with progress.bar(None, "reading", unit="sentence", interval=0.0, stream=stream) as bar:
        bar.update(3)
    assert re.fullmatch(r"\d\d:\d\d:\d\d reading: 3 sentences, [\d,.]+/s\n", stream.getvalue())


def test_the_bleu_line_says_how_many_sentences_were_translated_whole():
    assert sentences_scored({"bleu_num_sentences": 2117, "bleu_num_truncated": 0}) == \
        "2117 sentences, all translated whole"
    assert sentences_scored({"bleu_num_sentences": 2117, "bleu_num_truncated": 4}) == \
        "2117 sentences, 4 of them truncated to the model's max_len (scored as translated)"


class Pairs:
    """A source whose validation split is a short and a long sentence."""

    def __init__(self, *sources):
        self.pairs = [(s, s) for s in sources]

    def raw_pairs(self, split, limit=None):
        return self.pairs[:limit]


def test_the_bleu_line_during_training_says_how_many_were_translated_whole(
        untrained_translation_workdir, caplog):
    translator = transformer.load(str(untrained_translation_workdir))
    long = " ".join(["Sie geht oft ins Kino."] * 20)  # more than the model's max_len=24 pieces
    figures = loop.validation_bleu(translator, Pairs("Hallo.", long, "Kino."), 3, "de")
    assert figures["bleu_num_sentences"] == 3 and figures["bleu_num_truncated"] == 1
    assert loop.validation_bleu(translator, Pairs("Hallo.", long), 1, "de")[
        "bleu_num_truncated"] == 0
    caplog.set_level(logging.INFO, logger="transformer")
    metrics.log_evaluation(4, "validation", figures, 3.2)
    assert caplog.messages[-1].endswith(
        " | 3 sentences, 1 of them truncated to the model's max_len (scored as translated) | 3 s")


@pytest.mark.parametrize("installed, device_files, expected", [
    ({"libtpu"}, [], "cpu"),  # libtpu for --compile_only on a CPU machine: no probe
    ({"libtpu"}, ["/dev/accel0"], None),  # a TPU VM
    ({"libtpu", "jax_cuda13_plugin"}, [], None),  # a GPU machine decides for itself
    (set(), [], None),  # no libtpu: nothing to avoid
])
def test_jax_stays_on_the_cpu_only_where_libtpu_has_no_tpu_to_drive(
        monkeypatch, installed, device_files, expected):
    import glob
    import importlib.util

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name in installed else None)
    monkeypatch.setattr(glob, "glob", lambda pattern: [f for f in device_files
                                                       if f.startswith(pattern[:9])])
    cli.cpu_unless_an_accelerator()
    assert os.environ.get("JAX_PLATFORMS") == expected
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    cli.cpu_unless_an_accelerator()
    assert os.environ["JAX_PLATFORMS"] == "cuda"  # the user's choice is kept
