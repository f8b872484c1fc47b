"""The top-level config: the keys it may hold and their types, its checks, and `resolve`.

Every entry point (train.py, --compile_only, --summary, evaluate, translate, generate) calls
`resolve` once. Everything downstream takes the `Resolved` it returns: the checked config with
the defaults of optional keys filled in, the typed `TransformerConfig`, and the mesh shape.
Checks run before any device work, and each problem is one line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import NoReturn

from ml_collections import ConfigDict

from transformer import data
from transformer.data import workers
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding
from transformer.training import optim
from transformer.util import trackers

_REQUIRED = object()
# Top-level keys: the type each is read as and, for the optional ones, the default.
TOP_LEVEL: dict[str, tuple[type | tuple[type, ...], object]] = {
    "seed": (int, _REQUIRED),
    "num_train_steps": (int, _REQUIRED),
    "grad_accum_steps": (int, _REQUIRED),  # 0: sized from the device count
    "keep_checkpoints": (int, _REQUIRED),
    "log_every_steps": (int, _REQUIRED),
    "checkpoint_every_steps": (int, _REQUIRED),
    "checkpoint_every_minutes": ((int, float), 0.0),
    # checkpoint/tiers.py: a frequent local tier beside checkpoints/ ("": off)
    "checkpoint_local_dir": (str, ""),
    "checkpoint_local_every_steps": (int, 0),
    "keep_local_checkpoints": (int, 2),
    "eval_every_steps": (int, _REQUIRED),
    "label_smoothing": ((int, float), _REQUIRED),
    "bleu_every_steps": (int, 0),
    "bleu_num_sentences": (int, 0),
    # inference/harness.py: lm-eval tasks, defined by the task files (yaml) in lm_eval_path,
    # scored every lm_eval_every_steps (0: off) on their first lm_eval_limit documents (0: all)
    "lm_eval_every_steps": (int, 0),
    "lm_eval_tasks": (str, ""),  # task names, comma-separated
    "lm_eval_path": (str, ""),
    "lm_eval_limit": (int, 0),
    "params_every_minutes": ((int, float), 0.0),
    "params_keep": (int, 0),
    "z_loss": ((int, float), 0.0),
    # Target tokens per device whose logits the loss computes at once: 0 all, -1 by backend
    # (train_state.resolve_loss_chunk_tokens).
    "loss_chunk_tokens": (int, -1),
    "skip_nonfinite_updates": (bool, False),
    # training/elastic.py: a resumed run fitted to the devices it has now (data x fsdp and
    # grad_accum_steps), the recorded global batch and rows per device kept
    "elastic": (bool, False),
    # training/watchdog.py: a step this many times the median dumps the stacks (0: off); a
    # step not ended after this many seconds ends the run naming who did not arrive (0: off)
    "slow_step_factor": ((int, float), 0.0),
    "step_timeout_seconds": ((int, float), 0.0),
    "profile_start_step": (int, 0),
    "profile_num_steps": (int, 0),
    "init_from": (str, ""),  # a run to start from (transformer/training/transfer.py); "": scratch
    "init_from_exclude": (str, ""),  # a regex: parameter paths init_from leaves fresh
}
# The `finetune` section's adapters (model/lora.py), copied into the model config's fields.
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
DPO_BETA = 0.1  # finetune.dpo_beta's default, trl's (training/dpo.py)
# The sections beside them and the keys each may hold: the model's fields, the mesh axes, any
# data source's keys, and what optim.make_optimizer, the Translator (decode), the Generator
# (generate) and distributed.initialize read.
SECTIONS: dict[str, frozenset[str]] = {
    "model": frozenset(f.name for f in dataclasses.fields(TransformerConfig)) - set(LORA_KEYS)
    - set(sharding.PIPELINE_KEYS),  # mesh.pipeline_*: copied into the model's fields
    "mesh": sharding.CONFIG_KEYS,
    "data": data.CONFIG_KEYS,
    "optimizer": frozenset({"name", "schedule", "learning_rate", "warmup_steps", "end_fraction",
                            "decay_fraction",  # schedule "wsd"
                            "b1", "b2", "eps", "weight_decay", "clip_norm",
                            "moments_dtype",  # adam, adamw: float32 or bfloat16
                            "decay_rate", "min_dim_size_to_factor",  # adafactor
                            "muon_beta", "muon_rms",  # muon
                            "loss_scale_initial", "loss_scale_period",  # float16 runs
                            "skip_spikes", "spike_window", "spike_threshold",  # spikes
                            "max_skipped_in_a_row"}),
    "decode": frozenset({"beam_size", "alpha", "max_extra_length", "drop_decided"}),
    "generate": frozenset({"max_new_tokens", "temperature", "top_k", "top_p"}),
    "distributed": frozenset({"initialization_timeout_seconds", "heartbeat_timeout_seconds"}),
    "metrics": frozenset({"tracker"}),  # util/trackers.py; no section: "tensorboard"
    "finetune": frozenset(LORA_KEYS) | {"dpo_beta"},  # model/lora.py; training/dpo.py
}
_KNOWN = frozenset(TOP_LEVEL) | frozenset(SECTIONS)
_MODEL_TYPES = typing.get_type_hints(TransformerConfig)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A checked config and what follows from it."""

    config: ConfigDict  # optional keys filled in; grad_accum_steps resolved with a device count
    model: TransformerConfig
    mesh_shape: dict[str, int] | None  # {"data": .., "fsdp": .., "tensor": ..}; None: no devices


def resolve(cfg: ConfigDict, num_devices: int | None = None, *,
            config_file: str | None = None, num_slices: int = 1) -> Resolved:
    """Checks `cfg` and resolves it for `num_devices` in `num_slices` TPU slices (None: the
    model alone, e.g. a finished run's config.json for decoding). `config_file`, where `cfg`
    came from, is named in errors about its keys."""
    _check_keys(cfg, config_file)
    cfg = _with_defaults(cfg)
    _check_types(cfg)
    model = TransformerConfig.from_dict(dict(cfg.model) | finetune_fields(cfg)
                                        | sharding.pipeline_fields(cfg.get("mesh") or {}))
    _check_values(cfg, model)
    if num_devices is None:
        return Resolved(cfg, model, None)
    trackers.check_tracker((cfg.get("metrics") or {}).get("tracker", "tensorboard"))
    shape = sharding.mesh_shape(cfg.mesh, num_devices, num_slices)
    sharding.validate_mesh_for_model(shape, model)
    shards = sharding.batch_shards(shape)
    cfg.grad_accum_steps = grad_accum_steps(cfg, shards)
    if int(cfg.data.batch_size) % (cfg.grad_accum_steps * shards):
        raise ValueError(f"data.batch_size={cfg.data.batch_size} is not divisible by "
                         f"grad_accum_steps={cfg.grad_accum_steps} x {_batch_axes(shape)}="
                         f"{shards}")
    return Resolved(cfg, model, shape)


def finetune_fields(cfg: ConfigDict) -> dict:
    """The `finetune` section as `model.lora_*` fields (`lora_targets` a list or a
    comma-separated string)."""
    fields = {k: v for k, v in (cfg.get("finetune") or {}).items() if k in LORA_KEYS}
    targets = fields.get("lora_targets")
    if targets is not None and not isinstance(targets, str):
        fields["lora_targets"] = ",".join(targets)
    return fields


def _batch_axes(mesh) -> str:
    """The mesh axes that split the batch, as a user sets them: "mesh.data x mesh.fsdp", with
    " x mesh.expert" where experts are split."""
    return " x ".join(f"mesh.{axis}" for axis in sharding.BATCH_AXES
                      if axis != sharding.EXPERT_AXIS or int(mesh.get(axis, 1) or 1) != 1)


@dataclasses.dataclass(frozen=True)
class SpikeConfig:
    """`optimizer.spike_window`, `spike_threshold`, `max_skipped_in_a_row`, read where
    `optimizer.skip_spikes` (training/spikes.py)."""

    window: int = 100  # the applied updates whose mean and spread judge the next
    threshold: float = 6.0  # standard deviations above the mean that make a spike
    max_in_a_row: int = 10  # spikes skipped in a row that stop the run


def spike_config(opt_cfg) -> SpikeConfig | None:
    """The spike settings of an `optimizer` section; None when `skip_spikes` is off. A bad
    value is one line naming its key."""
    if not opt_cfg.get("skip_spikes", False):
        return None
    default = SpikeConfig()
    window = opt_cfg.get("spike_window", default.window)
    threshold = opt_cfg.get("spike_threshold", default.threshold)
    in_a_row = opt_cfg.get("max_skipped_in_a_row", default.max_in_a_row)
    for key, value, least in (("spike_window", window, 2), ("max_skipped_in_a_row", in_a_row, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"optimizer.{key}={value!r} must be an int >= {least} "
                             f"(optimizer.skip_spikes=True, docs/reliability.md)")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not (
            threshold > 0):
        raise ValueError(f"optimizer.spike_threshold={threshold!r} must be > 0: the standard "
                         f"deviations above the window's mean that make a spike (e.g. 6.0)")
    return SpikeConfig(window, float(threshold), in_a_row)


def grad_accum_steps(cfg: ConfigDict, batch_shards: int) -> int:
    """`grad_accum_steps`, or where it is 0 the fewest microbatches that give each of the
    `batch_shards` (mesh.data x mesh.fsdp) devices at most `data.max_rows_per_device` rows and
    split `data.batch_size` evenly: the tokens per update stay the paper's on any device count."""
    if int(cfg.grad_accum_steps):
        return int(cfg.grad_accum_steps)
    rows = int(cfg.data.batch_size)
    most = int(cfg.data.get("max_rows_per_device") or 0)
    if most < 1:
        raise ValueError("grad_accum_steps=0 sizes accumulation from data.max_rows_per_device, "
                         "which must then be >= 1")
    if rows % batch_shards:
        raise ValueError(f"data.batch_size={rows} is not divisible by {_batch_axes(cfg.mesh)}="
                         f"{batch_shards}")
    per_device = rows // batch_shards
    return next(a for a in range(-(-per_device // most), per_device + 1) if per_device % a == 0)


def _with_defaults(cfg: ConfigDict) -> ConfigDict:
    """A copy of `cfg` (references resolved) with every optional key that it lacks set."""
    resolved = cfg.copy_and_resolve_references()
    for key, (_, default) in TOP_LEVEL.items():
        if key in resolved:
            continue
        if default is _REQUIRED:
            raise ValueError(f"the config has no {key!r}; every config sets it "
                             f"(see configs/common.py)")
        with resolved.unlocked():  # a config file's dict arrives locked from config_flags
            resolved[key] = default
    return resolved


def _check_keys(cfg: ConfigDict, config_file: str | None) -> None:
    """A key the project does not read (a typo such as `optimiser`, `optimizer.warmup_step`)
    is one line naming it, the config file and the closest known key, instead of being
    silently ignored. `--config.<key>` flags cannot add keys (train.py refuses them)."""
    for key, value in cfg.items():
        if key not in _KNOWN:
            _unknown_key(key, _KNOWN, config_file)
        if key in SECTIONS and hasattr(value, "items"):
            for name in value:
                if name not in SECTIONS[key]:
                    _unknown_key(f"{key}.{name}", SECTIONS[key], config_file)


def _unknown_key(key: str, known, config_file: str | None) -> NoReturn:
    section, _, name = key.rpartition(".")
    if section:
        close = [f"{section}.{k}" for k in difflib.get_close_matches(name, sorted(known), n=1)]
    else:  # a section's key set at the top level, or a typo
        close = ([f"{s}.{name}" for s, keys in SECTIONS.items() if name in keys]
                 or difflib.get_close_matches(name, sorted(known), n=1))
    where = f" in {config_file}" if config_file else ""
    hint = (f"did you mean {' or '.join(repr(k) for k in close)}?" if close else
            f"known: {', '.join(sorted(known))}")
    raise ValueError(f"unknown config key {key!r}{where}; {hint}")


def _accepted(annotation) -> tuple[type, ...]:
    """The runtime types a field annotation admits (`int | None` -> (int, NoneType)). A float
    field also takes an int."""
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (
        annotation,)
    return tuple(kinds) + ((int,) if float in kinds else ())


def _check_types(cfg: ConfigDict) -> None:
    """A value of the wrong type (e.g. `d_model = "512"` in a config file) is one line naming
    the key, instead of an error deep inside the model."""
    expected = {f"model.{name}": _accepted(kind) for name, kind in _MODEL_TYPES.items()}
    expected |= {key: kind if isinstance(kind, tuple) else (kind,)
                 for key, (kind, _) in TOP_LEVEL.items()}
    expected["data.batch_size"] = (int,)
    values = {f"model.{k}": v for k, v in cfg.model.items()}
    values |= {k: cfg[k] for k in TOP_LEVEL}
    values["data.batch_size"] = cfg.data.get("batch_size")
    for key, value in values.items():
        if value is None and key.startswith("model."):
            continue  # a model default
        kinds = expected[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds if k is not type(None))
            raise ValueError(f"{key}={value!r} must be {names}, not {type(value).__name__}")


def _check_values(cfg: ConfigDict, model: TransformerConfig) -> None:
    optim.make_optimizer(cfg.optimizer, d_model=model.d_model,  # its checks; no arrays
                         total_steps=int(cfg.num_train_steps))
    optim.loss_scale_config(cfg.optimizer)
    spike_config(cfg.optimizer)
    for key in ("num_train_steps", "keep_checkpoints", "log_every_steps"):
        if cfg[key] < 1:
            raise ValueError(f"{key}={cfg[key]} must be >= 1")
    if cfg.grad_accum_steps < 0:
        raise ValueError(f"grad_accum_steps={cfg.grad_accum_steps} must be >= 1, or 0 to size "
                         f"it from the device count (data.max_rows_per_device)")
    for key in ("checkpoint_every_steps", "checkpoint_every_minutes", "eval_every_steps",
                "bleu_every_steps", "params_every_minutes", "lm_eval_every_steps"):
        if cfg[key] < 0:
            raise ValueError(f"{key}={cfg[key]} must be >= 0 (0 turns it off)")
    workers.check_workers(int(cfg.data.get("workers") or 0))
    trackers.check_tracker((cfg.get("metrics") or {}).get("tracker", "tensorboard"),
                           installed=False)  # the package: where a run trains (resolve)
    if cfg.bleu_every_steps and cfg.bleu_num_sentences < 1:
        raise ValueError(f"bleu_num_sentences={cfg.bleu_num_sentences} must be >= 1 when "
                         f"bleu_every_steps={cfg.bleu_every_steps} (0 turns BLEU off)")
    if cfg.lm_eval_every_steps and not (cfg.lm_eval_tasks and cfg.lm_eval_path):
        raise ValueError(f"lm_eval_every_steps={cfg.lm_eval_every_steps} needs lm_eval_tasks "
                         f"(task names) and lm_eval_path (the folder of their task files)")
    if cfg.params_every_minutes and cfg.params_keep < 1:
        raise ValueError(f"params_keep={cfg.params_keep} must be >= 1 when "
                         f"params_every_minutes={cfg.params_every_minutes}")
    try:
        re.compile(cfg.init_from_exclude)
    except re.error as error:
        raise ValueError(f"init_from_exclude={cfg.init_from_exclude!r} is not a regular "
                         f"expression ({error}); give one that matches parameter paths, e.g. "
                         f"'decoder/logits'") from None
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={cfg.label_smoothing} must be in [0, 1)")
    if cfg.slow_step_factor != 0 and not cfg.slow_step_factor > 1:
        raise ValueError(f"slow_step_factor={cfg.slow_step_factor} must be > 1 (a step that "
                         f"many times the median is slow), or 0 for no check")
    if cfg.step_timeout_seconds < 0:
        raise ValueError(f"step_timeout_seconds={cfg.step_timeout_seconds} must be >= 0 (0: "
                         f"no timeout)")
    _check_dpo(cfg, model)
    if cfg.loss_chunk_tokens < -1:
        raise ValueError(f"loss_chunk_tokens={cfg.loss_chunk_tokens} must be >= 0 (0: the logits "
                         f"whole), or -1 to size chunks by backend")


def _check_dpo(cfg: ConfigDict, model: TransformerConfig) -> None:
    """`data.objective="dpo"` (training/dpo.py): beta > 0 and a dense decoder, else one line."""
    if cfg.data.get("objective") != "dpo":
        return
    beta = (cfg.get("finetune") or {}).get("dpo_beta", DPO_BETA)
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta > 0:
        raise ValueError(f"finetune.dpo_beta={beta!r} must be a number > 0 (trl's default: "
                         f"{DPO_BETA})")
    if model.architecture != "decoder" or model.num_experts:
        raise ValueError(f"data.objective='dpo' trains a dense decoder, not model.architecture="
                         f"{model.architecture!r} with num_experts={model.num_experts}")
