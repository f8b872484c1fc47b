"""The top-level config (transformer/config.py): every check runs before device work and is
one line naming the key; `resolve` fills defaults, sizes accumulation, types the model."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env
from ml_collections import ConfigDict

from configs import common, default_2026_12_02, holders
from transformer.config import TOP_LEVEL, SpikeConfig, resolve, spike_config
from transformer.model.transformer import TransformerConfig
from transformer.parallel import sharding
from transformer.training import optim

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_config(load_config):
    return lambda **overrides: load_config("tiny.py", **{"data.batch_size": 16, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.data": 3, "mesh.fsdp": -1}, "mesh.data=3, mesh.fsdp=-1, mesh.tensor=1 cannot fill"),
    ({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 1}, "needs 4 devices, but 8"),
    ({"mesh.data": -1, "mesh.tensor": 8}, "mesh.tensor=8 does not divide num_heads=4"),
    ({"mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": -1}, "at most one mesh axis may be -1"),
    ({"data.batch_size": 12}, "data.batch_size=12 is not divisible"),
    ({"num_train_steps": -5}, "num_train_steps=-5 must be >= 1"),
    ({"model.num_heads": 3}, "num_heads"),
    ({"init_from_exclude": "("}, "init_from_exclude='(' is not a regular expression"),
])
def test_bad_config_fails_before_device_work(overrides, message, tiny_config):
    cfg = tiny_config(**overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        resolve(cfg, 8)
    assert "\n" not in str(error.value)


def test_a_negative_worker_count_is_one_line_before_device_work(load_config):
    cfg = load_config("default.py", **{"data.workers": -1})
    with pytest.raises(ValueError, match=r"^data.workers=-1 must be >= 0 \(0: the training "
                                         r"loop produces each batch itself\)$"):
        resolve(cfg, 8)


NEEDS_A_RUN = {"configs/finetune.py"}  # test_huggingface fine-tunes an imported run with it
POD_DEVICES = {"configs/mixtral_8x7b.py": 64}  # a fixed mesh (expert 8 x fsdp 8): its pod's
CONFIG_FILES = sorted(str(p.relative_to(ROOT)) for p in [
    *(ROOT / "configs").glob("*.py"), *(ROOT / "benchmarks" / "workloads").glob("*.py")]
    if "def get_config" in p.read_text() and str(p.relative_to(ROOT)) not in NEEDS_A_RUN)


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_every_config_file_validates(path, load_config):
    """No config in configs/ or benchmarks/workloads/ sets a key the project does not know (or
    a value it refuses); on one device, which every mesh of them fills but a pod's own."""
    cfg = load_config(path)
    resolve(cfg, POD_DEVICES.get(path, 1), config_file=path)


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES if p.startswith("configs/")])
def test_every_config_takes_data_workers_from_the_command_line(path, load_config):
    """`--config.data.workers=2` reaches every config in configs/ (every source makes a batch
    from its index alone): the flags set only keys the file holds, as a locked ConfigDict."""
    cfg = load_config(path)
    cfg.lock()
    cfg.data.workers = 2
    assert resolve(cfg, POD_DEVICES.get(path, 1), config_file=path).config.data.workers == 2


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES if p.startswith("configs/")])
def test_every_config_takes_spike_skipping_from_the_command_line(path, load_config):
    """`--config.optimizer.skip_spikes=True` and its settings reach every config in configs/
    (docs/reliability.md), with SpikeConfig's defaults until set."""
    cfg = load_config(path)
    cfg.lock()
    cfg.optimizer.skip_spikes = True
    cfg.optimizer.spike_threshold = 4.0
    resolved = resolve(cfg, POD_DEVICES.get(path, 1), config_file=path).config
    assert spike_config(resolved.optimizer) == SpikeConfig(threshold=4.0)


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES if p.startswith("configs/")])
def test_every_config_takes_the_wsd_and_muon_keys_from_the_command_line(path, load_config):
    """`--config.optimizer.decay_fraction=0.1` and Muon's keys reach every config in configs/,
    with optim.py's defaults until set."""
    cfg = load_config(path)
    cfg.lock()
    cfg.optimizer.decay_fraction = 0.1
    cfg.optimizer.muon_rms = 0.3
    resolved = resolve(cfg, POD_DEVICES.get(path, 1), config_file=path).config.optimizer
    assert (resolved.decay_fraction, resolved.muon_beta, resolved.muon_rms) == (
        0.1, optim.MUON_BETA, 0.3)


def test_the_wsd_and_muon_keys_of_the_configs_hold_optims_defaults():
    assert common.WSD_AND_MUON == dict(decay_fraction=optim.DECAY_FRACTION,
                                       muon_beta=optim.MUON_BETA, muon_rms=optim.MUON_RMS)


CONFIGS = [p for p in CONFIG_FILES if p.startswith("configs/")]
SPLITS_EXPERTS = {"configs/lm_moe.py", "configs/mixtral_8x7b.py"}


def test_the_mesh_section_of_the_configs_is_the_meshs():
    """configs/common.py's `mesh()` holds every key that sharding reads, with its defaults."""
    section = common.mesh()
    assert common.MESH_AXES == ((sharding.STAGE_AXIS,) + sharding.MESH_AXES
                                + (sharding.EXPERT_AXIS,))
    assert set(section) == sharding.CONFIG_KEYS
    for key, default in {**sharding.MESH_DEFAULTS, **sharding.DCN_DEFAULTS}.items():
        assert section[key] == default


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_holds_every_mesh_key(path, load_config):
    """`--config.mesh.expert` and the `dcn_` keys reach every config, and the mesh shape of a
    config that does not split experts leaves the expert axis out, as before every config
    declared it."""
    cfg = load_config(path)
    assert set(cfg.mesh) == sharding.CONFIG_KEYS
    shape = resolve(cfg, POD_DEVICES.get(path, 1), config_file=path).mesh_shape
    assert ("expert" in shape) == (path in SPLITS_EXPERTS)


FILE_KEYS = {"language model": common.language_model_files,
             "translation": common.translation_files,
             "classification": common.classification_files}


def _source(cfg) -> str | None:
    """The kind of source a config's data builds (`transformer.data.make_source`), where it
    can read files: None for images and the synthetic task."""
    objective = cfg.data.get("objective")
    if objective == "classification":
        return "classification"
    if objective:
        return "language model"
    if cfg.model.architecture == "vision" or cfg.data.dataset == "synthetic":
        return None
    return "translation"


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_holds_the_file_keys_of_its_source(path, load_config):
    """`--config.data.text_field` reaches every language model, not only lm_files.py, and the
    translation and classification configs hold their own keys of files."""
    cfg = load_config(path)
    source = _source(cfg)
    expected = set(FILE_KEYS[source]()) if source else set()
    assert expected <= set(cfg.data), f"{path} ({source}) lacks {expected - set(cfg.data)}"


def test_every_kind_of_source_has_a_config(load_config):
    """The test above checks every kind of source's keys on at least one config."""
    assert set(FILE_KEYS) <= {_source(load_config(path)) for path in CONFIGS}


def test_the_language_model_default_takes_the_expert_axis_and_the_text_field(load_config):
    """The issue's two flags on configs/lm_default.py, as a locked config takes them."""
    cfg = load_config("lm_default.py")
    cfg.lock()
    cfg.mesh.expert = 2
    cfg.data.text_field = "body"
    run = resolve(cfg, 8, config_file="configs/lm_default.py")
    assert run.mesh_shape == {"data": 4, "fsdp": 1, "context": 1, "tensor": 1, "expert": 2}
    assert run.config.data.text_field == "body"


def test_no_config_runs_another_by_path():
    """Configs import what they share as modules (`from configs import common`)."""
    assert [p.name for p in (ROOT / "configs").glob("*.py") if "runpy" in p.read_text()] == []


def test_a_config_loads_by_path_from_any_directory(tmp_path):
    """convert.py and the benchmarks load a config by its path, from wherever they run: its
    `from configs import ...` then needs the installed package (pyproject.toml)."""
    config = ROOT / "configs" / "lm_files.py"
    code = f"import runpy; runpy.run_path({str(config)!r})['get_config']('125m')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, (
        f"{result.stderr.strip().splitlines()[-1]}: install the project again "
        f"(pip install -e .) so that the configs package imports")


def test_train_py_takes_the_flags_from_another_directory(tmp_path):
    """`--config.mesh.expert`, `--config.data.text_field` and `--config.data.sources` on
    configs/lm_default.py, given to train.py by absolute paths from another directory."""
    sources = '({"dataset": "jsonl:web/*.zst", "weight": 0.7},)'
    flags = ["--config.mesh.expert=2", "--config.data.text_field=body",
             f"--config.data.sources={sources}"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs/lm_default.py'}",
         "--summary", *flags],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "total_params:" in result.stdout


def test_a_key_names_the_configs_that_hold_it():
    """`configs.holders`, for the line that says the config in use lacks a key."""
    assert holders("data.label_field") == "configs/help_topics.py holds it"
    assert holders("data.source_field").startswith("configs/default.py, ")
    assert holders("data.source_field").endswith(" more hold it")
    assert holders("data.no_such_key") == ""


@pytest.mark.parametrize("key, value, message", [
    ("optimiser", {"name": "adam"}, "unknown config key 'optimiser' in configs/typo.py; did you "
                                    "mean 'optimizer'?"),
    ("optimizer.warmup_step", 10, "unknown config key 'optimizer.warmup_step' in "
                                  "configs/typo.py; did you mean 'optimizer.warmup_steps'?"),
    ("data.batchsize", 16, "unknown config key 'data.batchsize' in configs/typo.py; did you "
                           "mean 'data.batch_size'?"),
    ("model.d_modle", 64, "did you mean 'model.d_model'?"),
    ("learning_rate", 1e-3, "did you mean 'optimizer.learning_rate'?"),  # in the wrong place
    ("vocab_size", 64, "did you mean 'model.vocab_size' or 'data.vocab_size'?"),
    ("mesh.model", 2, "unknown config key 'mesh.model' in configs/typo.py; known: context, "
                      "data, dcn_context, dcn_data, dcn_expert, dcn_fsdp, dcn_stage, "
                      "dcn_tensor, expert, fsdp, pipeline_microbatches, pipeline_repeats, "
                      "stage, tensor"),
])
def test_unknown_config_keys_are_named_with_the_closest_known_key(key, value, message,
                                                                   tiny_config):
    cfg = tiny_config()
    *path, last = key.split(".")
    (cfg[path[0]] if path else cfg)[last] = value
    with pytest.raises(ValueError) as error:
        resolve(cfg, 8, config_file="configs/typo.py")
    assert message in str(error.value) and "\n" not in str(error.value)
    cfg = tiny_config()  # without the file: the same line, less its name
    (cfg[path[0]] if path else cfg)[last] = value
    with pytest.raises(ValueError, match=f"^unknown config key '{key}'; "):
        resolve(cfg, 8)


@pytest.mark.parametrize("devices, accum", [(1, 4), (2, 2), (4, 1), (8, 1)])
def test_paper_configs_size_accumulation_from_the_device_count(devices, accum, load_config):
    cfg = load_config("wmt14_ende_base.py")
    assert cfg.grad_accum_steps == 0
    run = resolve(cfg, devices)
    resolved = run.config
    assert resolved.grad_accum_steps == accum and cfg.grad_accum_steps == 0
    assert run.mesh_shape == {"data": devices, "fsdp": 1, "context": 1, "tensor": 1}
    rows_per_device = cfg.data.batch_size // (accum * devices)
    assert rows_per_device * accum * devices == 104
    assert rows_per_device <= cfg.data.max_rows_per_device
    assert resolved.model.vocab_size == resolved.data.vocab_size == run.model.vocab_size == 37_000


def test_automatic_accumulation_needs_rows_that_split_over_the_devices(load_config):
    cfg = load_config("wmt14_ende_base.py")
    with pytest.raises(ValueError, match="data.batch_size=104 is not divisible by mesh.data x "
                                         "mesh.fsdp=16"):
        resolve(cfg, 16)


def test_resolve_types_the_model_and_fills_optional_keys(tiny_config):
    cfg = tiny_config()
    del cfg["loss_chunk_tokens"], cfg["z_loss"]
    run = resolve(cfg)
    assert isinstance(run.model, TransformerConfig) and run.mesh_shape is None
    assert run.model.d_model == cfg.model.d_model
    assert run.config.loss_chunk_tokens == TOP_LEVEL["loss_chunk_tokens"][1] == -1
    assert run.config.z_loss == 0.0 and "z_loss" not in cfg  # the input is left alone


@pytest.mark.parametrize("key, value, message", [
    ("model.d_model", "512", "model.d_model='512' must be int, not str"),
    ("model.d_k", 1.5, "model.d_k=1.5 must be int, not float"),
    ("model.dropout_rate", True, "model.dropout_rate=True must be float or int, not bool"),
    ("label_smoothing", "0.1", "label_smoothing='0.1' must be int or float, not str"),
    ("skip_nonfinite_updates", 1, "skip_nonfinite_updates=1 must be bool, not int"),
])
def test_values_of_the_wrong_type_are_one_line(key, value, message, tiny_config):
    values = tiny_config().to_dict()  # as a config file may write them (no type-safe setter)
    *section, name = key.split(".")
    (values[section[0]] if section else values)[name] = value
    with pytest.raises(ValueError) as error:
        resolve(ConfigDict(values), 8)
    assert str(error.value) == message


def test_a_missing_required_key_is_named(tiny_config):
    cfg = tiny_config()
    del cfg["num_train_steps"]
    with pytest.raises(ValueError, match="^the config has no 'num_train_steps'"):
        resolve(cfg)


def test_defaults_fill_a_locked_config(tiny_config):
    """A config file's dict arrives locked (config_flags); an optional key it lacks still gets
    its default."""
    cfg = tiny_config()
    assert "init_from_exclude" not in cfg
    cfg.lock()
    assert resolve(cfg, 8).config.init_from_exclude == TOP_LEVEL["init_from_exclude"][1] == ""


@pytest.mark.parametrize("path", ["configs/lm_default.py", "configs/mlm_default.py",
                                  "configs/lm_125m.py"])
def test_language_model_configs_take_the_expert_keys_from_the_command_line(path, load_config):
    """`--config.model.num_experts=8` routes any language model: the flags set only keys the
    config file holds (as a locked ConfigDict does), and lm_common.py holds them, dense."""
    cfg = load_config(path)
    assert resolve(cfg, 1, config_file=path).model.num_experts == 0
    cfg.lock()
    cfg.model.num_experts, cfg.model.moe_capacity_factor = 8, 1.25
    model = resolve(cfg, 1, config_file=path).model
    assert (model.num_experts, model.experts_per_token, model.moe_capacity_factor) == (8, 2, 1.25)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_previous_default_is_the_config_its_record_ran():
    """configs/default_2026_12_02.py derives from default.py: a later change to default.py must
    pin the old value there, or the side-by-side of 2026-12-06 could no longer be rerun."""
    record = ROOT / "docs/results/records/2026-12-06-default-dropout-off"
    ran = _flat(json.loads((record / "default_2026_12_02/config.json").read_text()))
    ran |= ADDED_SINCE_2026_12_06
    config = _flat(json.loads(default_2026_12_02.get_config().to_json()))
    assert {key: value for key, value in config.items() if value != ran.get(key)} == {}


# Keys added after that record, with the value that does what the run did.
ADDED_SINCE_2026_12_06 = {"decode.drop_decided": True, "model.quantization": "none",
                          "model.quantized_matmuls": "attention,feed_forward,experts",
                          "optimizer.decay_fraction": 0.2, "optimizer.muon_beta": 0.95,
                          "optimizer.muon_rms": 0.2}
