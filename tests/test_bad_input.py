"""Every mistake a user can make ends in one line naming the setting or file and the fix,
before expensive work, with nothing already written changed: configs, data, the files a run
reads back (config file, workdir, config.json, checkpoints, vocabulary), and the CLIs (`train.py`,
`python -m transformer.translate`, `.evaluate`, `.generate`, `.visualize`)."""

import hashlib
import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import pytest
from conftest import TRANSLATION_SENTENCES, subprocess_env
from ml_collections import ConfigDict

from transformer.data import tokenizer as tokenizer_lib
from transformer.training.loop import train_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tiny(**overrides) -> ConfigDict:
    """configs/tiny.py with `overrides` (dotted keys) set as a config file would: any type."""
    values = runpy.run_path(str(ROOT / "configs" / "tiny.py"))["get_config"]().to_dict()
    values.update({"num_train_steps": 4, "checkpoint_every_steps": 2, "eval_every_steps": 0,
                   "log_every_steps": 1})
    values["data"]["batch_size"] = 16
    for key, value in overrides.items():
        *path, last = key.split(".")
        target = values
        for name in path:
            target = target[name]
        target[last] = value
    return ConfigDict(values)


def snapshot(directory) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(directory).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run_workdir(tmp_path_factory):
    """A tiny run of 4 steps: config.json, metrics.jsonl, checkpoints 2 and 4."""
    workdir = tmp_path_factory.mktemp("bad_input") / "run"
    train_and_evaluate(tiny(), str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return workdir


BAD_CONFIGS = {
    "d_model not divisible by heads": ({"model.num_heads": 3},
                                       "model.num_heads=3 does not divide d_model=64; change it "
                                       "or set model.d_k"),
    "mesh does not match the devices": ({"mesh.data": 3, "mesh.fsdp": -1},
                                        "mesh.data=3, mesh.fsdp=-1, mesh.tensor=1 cannot fill"),
    "mesh needs other devices": ({"mesh.data": 2, "mesh.fsdp": 2}, "needs 4 devices, but 8"),
    "negative steps": ({"num_train_steps": -5}, "num_train_steps=-5 must be >= 1"),
    "warmup longer than the run": ({"optimizer.schedule": "cosine", "optimizer.warmup_steps": 10},
                                   "optimizer.warmup_steps=10 must be < num_train_steps=4"),
    "batch not divisible by data axes": ({"data.batch_size": 12},
                                         "data.batch_size=12 is not divisible by "
                                         "grad_accum_steps=1 x mesh.data x mesh.fsdp=8"),
    "unknown model key": ({"model.d_modle": 64}, "unknown config key 'model.d_modle'; did "
                                                 "you mean 'model.d_model'?"),
    "unknown top-level key": ({"optimiser": {"name": "adam"}}, "unknown config key "
                              "'optimiser'; did you mean 'optimizer'?"),
    "wrong type in a config file": ({"model.d_model": "64"},
                                    "model.d_model='64' must be int, not str"),
    "wrong type of a top-level key": ({"num_train_steps": 4.5},
                                      "num_train_steps=4.5 must be int, not float"),
    "other model on resume": ({"model.d_ff": 256}, "was written with other model settings "
                                                  "(d_ff); resume with the same model or use a "
                                                  "new --workdir"),
    "TFDS name with a typo": ({"data.dataset": "offline_de_eng"},
                              "data.dataset='offline_de_eng': Dataset offline_de_eng not found.; "
                              "did you mean 'offline_de_en'?"),
    "path to no file": ({"data.dataset": "no/such/dir/part-*"},
                        "data.dataset='no/such/dir/part-*' is not a TFDS name and no file "
                        "matches"),
    "path of TFDS's name shape to no file": ({"data.dataset": "no_such_dir/train"},
                                             "data.dataset='no_such_dir/train': Dataset "
                                             "no_such_dir not found."),
    "local layers without a window": ({"model.attention_pattern": "local,global"},
                                      "model.attention_pattern='local,global' has local layers: "
                                      "set model.attention_window (e.g. 256)"),
    "linear attention with a window": ({"model.attention_kind": "linear",
                                        "model.attention_window": 8,
                                        "model.attention_pattern": "local"},
                                       "model.attention_kind='linear' attends to every "
                                       "position: unset model.attention_window"),
    "float16 loss scale not a power of two": ({"optimizer.loss_scale_initial": 1000.0},
                                              "optimizer.loss_scale_initial=1000.0 must be a "
                                              "power of two >= 1"),
    "missing dataset": ({"data.dataset": "wmt14_translate/de-en", "data.source_lang": "de",
                         "data.target_lang": "en"},
                        "wmt14_translate/de-en is not prepared in"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_or_data_is_one_line_and_changes_nothing(run_workdir, case, tmp_path):
    overrides, message = BAD_CONFIGS[case]
    if "data.dataset" in overrides:
        overrides = {**overrides, "data.data_dir": str(tmp_path)}
    before = snapshot(run_workdir)
    with pytest.raises(ValueError) as error:
        train_and_evaluate(tiny(**overrides), str(run_workdir))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert snapshot(run_workdir) == before


def test_init_from_that_is_not_a_run_is_one_line_before_any_work(run_workdir, tmp_path):
    # A new workdir (init_from is read only before a run's first checkpoint): nothing created.
    workdir = tmp_path / "fine_tuned"
    for spec, message in ((str(tmp_path / "missing"), "is not a training workdir"),
                          (f"{run_workdir}/checkpoints", "give the workdir")):
        with pytest.raises(ValueError) as error:
            train_and_evaluate(tiny(init_from=spec), str(workdir))
        assert f"init_from={spec!r}" in str(error.value) and message in str(error.value)
        assert "\n" not in str(error.value) and not workdir.exists()


def test_a_read_only_local_tier_is_one_line_at_start(tmp_path):
    """`checkpoint_local_dir` not writable: said before the data or a compile, not at the first
    local save (a new workdir: nothing created)."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    if os.access(readonly, os.W_OK):  # root writes anyway: sysfs refuses root too
        readonly = pathlib.Path("/sys/transformer-local-tier")
    workdir = tmp_path / "run"
    with pytest.raises(ValueError) as error:
        train_and_evaluate(tiny(checkpoint_local_dir=str(readonly / "local"),
                                checkpoint_local_every_steps=1), str(workdir))
    assert f"checkpoint_local_dir={readonly / 'local'} is not writable" in str(error.value)
    assert "\n" not in str(error.value) and not workdir.exists()


def test_checkpoints_of_another_model_name_the_parameter_and_both_shapes(run_workdir,
                                                                          tmp_path):
    # Checkpoints copied into a new workdir, trained with another d_ff than the config's.
    workdir = tmp_path / "copied"
    shutil.copytree(run_workdir / "checkpoints", workdir / "checkpoints")
    before = snapshot(workdir / "checkpoints")
    with pytest.raises(ValueError) as error:
        train_and_evaluate(tiny(**{"model.d_ff": 256}), str(workdir))
    assert str(error.value) == (
        f"checkpoint 4 in {workdir / 'checkpoints'} holds "
        f"params/decoder/layers_0/ffn/ff_in/bias with shape (128,) but the config gives "
        f"(256,): resume with the config it was trained with (its config.json) or use a new "
        f"--workdir")
    assert snapshot(workdir / "checkpoints") == before


@pytest.mark.parametrize("kind", ["translation", "language model"])
def test_an_empty_training_split_is_named_before_any_work(kind, tmp_path):
    import tensorflow_datasets as tfds

    from transformer.data.language_model import LanguageModelSource
    from transformer.data.translation import TranslationSource

    with tfds.testing.mock_data(num_examples=0, policy=tfds.testing.MockPolicy.USE_CODE):
        with pytest.raises(ValueError) as error:
            if kind == "translation":
                TranslationSource("ted_hrlr_translate/pt_to_en", source_lang="pt",
                                  target_lang="en", vocab_size=100, max_length=16, batch_size=4,
                                  data_dir=str(tmp_path), workdir=str(tmp_path / "run"))
            else:
                LanguageModelSource("lm1b", objective="causal", vocab_size=100, max_length=16,
                                    batch_size=4, eval_split="test", data_dir=str(tmp_path),
                                    workdir=str(tmp_path / "run"))
    name = "ted_hrlr_translate/pt_to_en" if kind == "translation" else "lm1b"
    assert str(error.value).startswith(f"{name}: the 'train' split is empty; prepare the "
                                       f"dataset again")
    assert not (tmp_path / "run").exists()  # no vocabulary trained, nothing written


# --------------------------------------------------------------------------- the CLIs

def cli(*args, stdin: bytes = b""):
    env = subprocess_env()
    return subprocess.run([sys.executable, *args], input=stdin, cwd=ROOT, env=env,
                          capture_output=True, timeout=300)


def assert_one_line_error(result, message: str) -> None:
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "Traceback" not in stderr
    # absl ends a flag-parsing error with a hint line of its own.
    last = stderr.removesuffix("Pass --helpshort or --helpfull to see help on flags.\n")
    last = last.splitlines()[-1]
    assert last.startswith(("error: ", "FATAL Flags parsing error: ")), stderr[-2000:]
    assert message in last, stderr[-2000:]


@pytest.fixture
def translation_run(untrained_translation_workdir, tmp_path):
    """A copy of the untrained translation run (config.json, vocab/, checkpoint 1)."""
    return pathlib.Path(shutil.copytree(untrained_translation_workdir, tmp_path / "run"))


@pytest.mark.slow
def test_translate_truncates_a_line_too_long_for_the_model_with_a_warning(translation_run):
    before = snapshot(translation_run)
    long_line = " ".join(["Sie geht oft ins Kino."] * 200)
    result = cli("-m", "transformer.translate", f"--workdir={translation_run}",
                 "--beam_size=1", stdin=f"kurz\n{long_line}\n".encode())
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().count("\n") == 2
    warnings = [line for line in result.stderr.decode().splitlines() if "truncated" in line]
    assert warnings == ["1 of 2 sentences are longer than the model's max_len=24 pieces (EOS "
                        "included) and were truncated to it (sentence 2)"]  # one line for all
    assert snapshot(translation_run) == before


def _without_checkpoints(run):
    shutil.rmtree(run / "checkpoints")
    return f"no checkpoint in {run}: neither checkpoints/ nor params/ holds a finished step"


def _other_vocabulary(run):
    tokenizer_lib.train(TRANSLATION_SENTENCES, 80, seed=0).save(str(run / "vocab"))
    return (f"{run / 'vocab' / tokenizer_lib.MODEL_FILE} (80 pieces, sha256 ")


def _binary_input(run):
    (run.parent / "input.txt").write_bytes(b"ok\n\x89PNG\r\n\x1a\n\x00\x00")
    return f"{run.parent / 'input.txt'} line 2 is not UTF-8 (invalid start byte at byte 0)"


@pytest.mark.slow
@pytest.mark.parametrize("mistake", [_without_checkpoints, _other_vocabulary, _binary_input])
def test_translate_errors_leave_the_workdir_and_the_output_file_alone(translation_run, mistake):
    message = mistake(translation_run)
    output = translation_run.parent / "out.txt"
    output.write_text("translations of an earlier run\n")
    before = snapshot(translation_run.parent)
    result = cli("-m", "transformer.translate", f"--workdir={translation_run}",
                 f"--input={translation_run.parent / 'input.txt'}", f"--output={output}")
    if not (translation_run.parent / "input.txt").exists():  # the mistake is not the input
        (translation_run.parent / "input.txt").write_text("Hallo.\n")
        before = snapshot(translation_run.parent)
        result = cli("-m", "transformer.translate", f"--workdir={translation_run}",
                     f"--input={translation_run.parent / 'input.txt'}", f"--output={output}")
    assert_one_line_error(result, message)
    assert snapshot(translation_run.parent) == before


@pytest.mark.slow
def test_evaluate_a_workdir_without_a_checkpoint(translation_run):
    _without_checkpoints(translation_run)
    before = snapshot(translation_run)
    result = cli("-m", "transformer.evaluate", f"--workdir={translation_run}")
    assert_one_line_error(result, f"no checkpoint in {translation_run}")
    assert snapshot(translation_run) == before  # no eval/, no metrics.jsonl line


def test_evaluate_a_run_of_the_synthetic_task(run_workdir):
    """A run without a vocabulary has no text to translate: one line before any scoring."""
    before = snapshot(run_workdir)
    result = cli("-m", "transformer.evaluate", f"--workdir={run_workdir}")
    assert_one_line_error(result, "is missing: this run has no vocabulary (was it trained on "
                                  "text, not the synthetic task?)")
    assert snapshot(run_workdir) == before


def test_train_py_names_the_config_file_that_sets_an_unknown_key(tmp_path):
    config = tmp_path / "typo.py"
    config.write_text(f"import runpy\n\n\ndef get_config():\n"
                      f"    cfg = runpy.run_path({str(ROOT / 'configs' / 'tiny.py')!r})"
                      f"['get_config']()\n"
                      f"    cfg.optimizer.warmup_step = 10\n"
                      f"    return cfg\n")
    result = cli("train.py", f"--config={config}", f"--workdir={tmp_path / 'run'}")
    assert_one_line_error(result, f"error: unknown config key 'optimizer.warmup_step' in "
                                  f"{config}; did you mean 'optimizer.warmup_steps'?")
    assert not (tmp_path / "run").exists()


TRAIN_FLAG_MISTAKES = {
    "impossible value": ("--config.num_train_steps=-3", "error: num_train_steps=-3 must be >= 1"),
    "wrong type": ("--config.model.d_model=1.5", "flag --config.model.d_model=1.5: invalid "
                                                 "literal for int() with base 10: '1.5'"),
    "unknown key": ("--config.num_train_step=3", "error: --config.num_train_step: the config "
                    "has no key 'num_train_step'; Did you mean \"num_train_steps\" instead of "
                    "\"num_train_step\"?"),
    "key of other configs": ("--config.model.context_load_balance=False",
                             "error: --config.model.context_load_balance: the config has no key "
                             "'context_load_balance'; configs/wmt14_ende_base.py, "
                             "configs/wmt14_ende_big.py, configs/wmt14_enfr_big.py hold it"),
}


@pytest.mark.slow
@pytest.mark.parametrize("flag, message", list(TRAIN_FLAG_MISTAKES.values()),
                         ids=list(TRAIN_FLAG_MISTAKES))
def test_train_py_flag_mistakes_are_one_line_and_change_nothing(run_workdir, flag, message):
    before = snapshot(run_workdir)
    result = cli("train.py", "--config=configs/tiny.py", f"--workdir={run_workdir}", flag)
    assert_one_line_error(result, message)
    assert snapshot(run_workdir) == before
    assert json.loads((run_workdir / "config.json").read_text())["num_train_steps"] == 4


FLAG_OUT_OF_RANGE = {
    "translate beam size": (["-m", "transformer.translate", "--beam_size=0"],
                            "flag --beam_size=0: 0 is not a positive integer"),
    "translate alpha": (["-m", "transformer.translate", "--alpha=-1"],
                        "flag --alpha=-1: -1.0 is not a non-negative number"),
    "translate batch size": (["-m", "transformer.translate", "--batch_size=0"],
                             "flag --batch_size=0: 0 is not a positive integer"),
    "translate average": (["-m", "transformer.translate", "--average=0"],
                          "flag --average=0: 0 is not a positive integer"),
    "translate step": (["-m", "transformer.translate", "--step=-1"],
                       "flag --step=-1: -1 is not a non-negative integer"),
    "generate temperature": (["-m", "transformer.generate", "--temperature=-0.5"],
                             "flag --temperature=-0.5: -0.5 is not a non-negative number"),
    "generate top_k": (["-m", "transformer.generate", "--top_k=-1"],
                       "flag --top_k=-1: -1 is not a non-negative integer"),
    "generate top_p": (["-m", "transformer.generate", "--top_p=1.5"],
                       "flag --top_p=1.5: 1.5 is not a number in the range [0.0, 1.0]"),
    "generate token count": (["-m", "transformer.generate", "--max_new_tokens=0"],
                             "flag --max_new_tokens=0: 0 is not a positive integer"),
    "evaluate sentence count": (["-m", "transformer.evaluate", "--num_sentences=0"],
                                "flag --num_sentences=0: 0 is not a positive integer"),
    "evaluate beam size": (["-m", "transformer.evaluate", "--beam_size=-2"],
                           "flag --beam_size=-2: -2 is not a positive integer"),
}


@pytest.mark.parametrize("args, message", list(FLAG_OUT_OF_RANGE.values()),
                         ids=list(FLAG_OUT_OF_RANGE))
def test_numeric_flags_out_of_range_are_one_line_before_any_work(args, message, tmp_path):
    result = cli(*args, f"--workdir={tmp_path}", stdin=b"Hallo.\n")
    assert_one_line_error(result, message)
    assert os.listdir(tmp_path) == []


def _workdir_is_a_file(tmp_path):
    (tmp_path / "run").write_text("not a workdir\n")
    return f"--workdir={tmp_path / 'run'} is not a directory: give a training run's workdir"


def _config_json_damaged(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"model": ')
    return f"{tmp_path / 'run' / 'config.json'} is damaged (Expecting value at line 1)"


def _config_json_a_directory(tmp_path):
    (tmp_path / "run" / "config.json").mkdir(parents=True)
    return f"{tmp_path / 'run' / 'config.json'} is not a file: remove it or use another --workdir"


def _no_config_json(tmp_path):
    (tmp_path / "run").mkdir()
    return f"{tmp_path / 'run'} has no config.json: not a training workdir"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["translate", "generate", "evaluate"])
@pytest.mark.parametrize("mistake", [_workdir_is_a_file, _config_json_damaged,
                                     _config_json_a_directory, _no_config_json])
def test_a_workdir_that_is_not_a_run_is_one_line(command, mistake, tmp_path):
    message = mistake(tmp_path)
    before = snapshot(tmp_path)
    result = cli("-m", f"transformer.{command}", f"--workdir={tmp_path / 'run'}",
                 stdin=b"Hallo.\n")
    assert_one_line_error(result, message)
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- damaged files

def _truncated_array_files(run):
    for data in (run / "checkpoints" / "1" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])
    return f"{run / 'checkpoints' / '1'} does not restore (ValueError: OUT_OF_RANGE: "


def _garbled_vocabulary(run):
    (run / "vocab" / tokenizer_lib.MODEL_FILE).write_bytes(bytes(range(256)) * 4)
    return (f"{run / 'vocab' / tokenizer_lib.MODEL_FILE} is damaged (not a SentencePiece "
            f"model): restore the run's vocab/ directory from a copy")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["translate", "evaluate", "generate"])
@pytest.mark.parametrize("damage", [_truncated_array_files, _garbled_vocabulary])
def test_a_damaged_checkpoint_or_vocabulary_is_one_line(command, damage, tmp_path,
                                                        untrained_translation_workdir,
                                                        untrained_lm_workdir):
    trained = untrained_lm_workdir if command == "generate" else untrained_translation_workdir
    run = pathlib.Path(shutil.copytree(trained, tmp_path / "run"))
    message = damage(run)
    before = snapshot(tmp_path)
    result = cli("-m", f"transformer.{command}", f"--workdir={run}", stdin=b"Hallo.\n")
    assert_one_line_error(result, message)
    assert snapshot(tmp_path) == before
    if damage is _truncated_array_files:
        assert "restore it from a copy, or load another step (--step; checkpoints/ holds [1])" \
            in result.stderr.decode()


# --------------------------------------------------------------------------- train.py's files

def _no_config_file(tmp_path):
    return tmp_path / "missing.py", (f"error: --config={tmp_path / 'missing.py'}: no such file; "
                                     f"give a config file, e.g. --config=configs/default.py")


def _config_is_a_directory(tmp_path):
    return tmp_path, (f"error: --config={tmp_path} is not a file; give a config file, e.g. "
                      f"--config=configs/default.py")


def _config_syntax_error(tmp_path):
    (tmp_path / "broken.py").write_text("def get_config(:\n    pass\n")
    return tmp_path / "broken.py", (f"error: --config={tmp_path / 'broken.py'} line 1: invalid "
                                    f"syntax; fix the config file")


def _config_without_get_config(tmp_path):
    (tmp_path / "plain.py").write_text("d_model = 64\n")
    return tmp_path / "plain.py", (f"error: --config={tmp_path / 'plain.py'} defines no "
                                   f"get_config(): a config file returns its ConfigDict from "
                                   f"get_config(), as configs/default.py does")


def _table3_row_unknown(tmp_path):
    return "configs/table3.py:Z_h3", ("error: configs/table3.py: unknown row 'Z_h3'; rows: base, "
                                      "A_h1")


def _vit_size_unknown(tmp_path):
    return "configs/vit.py:X/16", ("error: ViT size 'X' is not one of Ti, S, B, L, H (e.g. "
                                   "--config=configs/vit.py:B/16)")


@pytest.mark.slow
@pytest.mark.parametrize("mistake", [_no_config_file, _config_is_a_directory,
                                     _config_syntax_error, _config_without_get_config,
                                     _table3_row_unknown, _vit_size_unknown])
def test_train_py_config_file_that_does_not_load_is_one_line(mistake, tmp_path):
    config, message = mistake(tmp_path)
    before = snapshot(tmp_path)
    result = cli("train.py", f"--config={config}", f"--workdir={tmp_path / 'run'}")
    assert_one_line_error(result, message)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("below", ["", "run"])
def test_train_py_workdir_that_is_a_file_is_one_line(below, tmp_path):
    (tmp_path / "notes.txt").write_text("not a directory\n")
    workdir = tmp_path / "notes.txt" / below
    result = cli("train.py", "--config=configs/tiny.py", f"--workdir={workdir}")
    assert_one_line_error(result, f"error: --workdir={workdir}: "
                                  f"{tmp_path / 'notes.txt'} is a file, not a directory; give a "
                                  f"new directory to train in (or a run's workdir to resume it)")
    assert os.listdir(tmp_path) == ["notes.txt"]


# --------------------------------------------------------------------------- visualize

VISUALIZE_MISTAKES = {
    "length zero": (["positions", "--length=0"], "error: --length=0 must be from 2 to 4096"),
    "length too long": (["positions", "--length=100000"],
                        "error: --length=100000 must be from 2 to 4096 positions"),
    "odd d_model": (["positions", "--d_model=63"], "error: --d_model=63 must be even, from 2 "
                                                   "to 8192"),
    "d_model not a number": (["positions", "--d_model=abc"],
                             "flag --d_model=abc: invalid literal for int() with base 10: 'abc'"),
    "no command": ([], "error: give a command: attention, image_attention, curves, positions "
                       "(--help lists the flags)"),
    "flag of another command": (["positions", "--workdir={tmp}"],
                                "error: positions takes no --workdir; its flags: --d_model, "
                                "--length, --out"),
    "attention without a source": (["attention", "--workdir={tmp}"],
                                   "error: attention needs --source"),
    "curves of a missing workdir": (["curves", "--workdir={tmp}/missing"],
                                    "error: --workdir={tmp}/missing is not a directory: give a "
                                    "training run's workdir"),
    "attention of a missing workdir": (["attention", "--workdir={tmp}/missing", "--source=Hi"],
                                       "error: --workdir={tmp}/missing is not a directory"),
}


@pytest.mark.slow
@pytest.mark.parametrize("args, message", list(VISUALIZE_MISTAKES.values()),
                         ids=list(VISUALIZE_MISTAKES))
def test_visualize_mistakes_are_one_line_and_write_nothing(args, message, tmp_path):
    env = subprocess_env()
    result = subprocess.run([sys.executable, "-m", "transformer.visualize",
                             *(a.format(tmp=tmp_path) for a in args)], cwd=tmp_path, env=env,
                            capture_output=True, timeout=300)
    assert_one_line_error(result, message.format(tmp=tmp_path))
    assert os.listdir(tmp_path) == []
