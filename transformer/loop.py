"""The training loop: validate, build the mesh, init or resume, train, evaluate, checkpoint.

`train_and_evaluate(cfg, workdir)` is what `train.py` runs. Rerunning it on the same workdir
resumes from the latest checkpoint; on the same mesh the losses continue bit for bit. SIGTERM
saves a checkpoint and returns cleanly.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import signal
import subprocess
import time
from importlib import metadata
from typing import NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer import data as data_lib
from transformer import evaluation, flops, metrics, optim, sharding, train_lib
from transformer.checkpoint import Checkpointer, ParamsSeries
from transformer.data import make_source
from transformer.model import TransformerConfig
from transformer.translator import Translator

log = logging.getLogger("transformer")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformer")


_KINDS = {"int": int, "float": (int, float), "str": str, "bool": bool}
# Top-level keys and the types validate_config reads them as (a config file can set anything).
_TOP_LEVEL = {"seed": "int", "num_train_steps": "int", "keep_checkpoints": "int",
              "log_every_steps": "int", "grad_accum_steps": "int",
              "checkpoint_every_steps": "int", "eval_every_steps": "int",
              "bleu_every_steps": "int", "bleu_num_sentences": "int", "params_keep": "int",
              "checkpoint_every_minutes": "float", "params_every_minutes": "float",
              "label_smoothing": "float", "z_loss": "float", "loss_chunk_tokens": "int",
              "skip_nonfinite_updates": "bool", "profile_start_step": "int",
              "profile_num_steps": "int", "data.batch_size": "int"}
# The sections beside them and the keys each may hold: the model's fields, the mesh axes, any
# data source's keys, and what optim.make_optimizer, the Translator (decode), the Generator
# (generate) and distributed.initialize read. Any other key is refused (_check_keys).
_SECTIONS = {
    "model": frozenset(f.name for f in dataclasses.fields(TransformerConfig)),
    "mesh": frozenset(sharding.MESH_AXES),
    "data": data_lib.CONFIG_KEYS,
    "optimizer": frozenset({"name", "schedule", "learning_rate", "warmup_steps", "end_fraction",
                            "b1", "b2", "eps", "weight_decay", "clip_norm"}),
    "decode": frozenset({"beam_size", "alpha", "max_extra_length"}),
    "generate": frozenset({"max_new_tokens", "temperature", "top_k", "top_p"}),
    "distributed": frozenset({"initialization_timeout_seconds", "heartbeat_timeout_seconds"}),
}
_KNOWN = frozenset(k for k in _TOP_LEVEL if "." not in k) | frozenset(_SECTIONS)


def _check_keys(cfg, config_file: str | None = None) -> None:
    """A key the project does not read (a typo such as `optimiser`, `optimizer.warmup_step`)
    is one line naming it, the config file and the closest known key, instead of being
    silently ignored. `--config.<key>` flags cannot add keys (train.py refuses them)."""
    for key, value in cfg.items():
        if key not in _KNOWN:
            _unknown_key(key, _KNOWN, config_file)
        if key in _SECTIONS and hasattr(value, "items"):
            for name in value:
                if name not in _SECTIONS[key]:
                    _unknown_key(f"{key}.{name}", _SECTIONS[key], config_file)


def _unknown_key(key: str, known, config_file: str | None) -> NoReturn:
    section, _, name = key.rpartition(".")
    if section:
        close = [f"{section}.{k}" for k in difflib.get_close_matches(name, sorted(known), n=1)]
    else:  # a section's key set at the top level, or a typo
        close = ([f"{s}.{name}" for s, keys in _SECTIONS.items() if name in keys]
                 or difflib.get_close_matches(name, sorted(known), n=1))
    where = f" in {config_file}" if config_file else ""
    hint = (f"did you mean {' or '.join(repr(k) for k in close)}?" if close else
            f"known: {', '.join(sorted(known))}")
    raise ValueError(f"unknown config key {key!r}{where}; {hint}")


def _check_types(cfg) -> None:
    """A value of the wrong type (e.g. `d_model = "512"` in a config file) is one line naming
    the key, instead of an error deep inside the model."""
    fields = {f"model.{f.name}": str(f.type) for f in dataclasses.fields(TransformerConfig)}
    flat = {f"model.{k}": v for k, v in cfg.model.items()}
    flat |= {k: cfg.get(k) for k in _TOP_LEVEL if "." not in k and k in cfg}
    flat["data.batch_size"] = cfg.data.get("batch_size")
    for key, value in flat.items():
        kinds = (fields.get(key) or _TOP_LEVEL.get(key, "")).split(" | ")
        if (value is None and key.startswith("model.")) or kinds == [""]:
            continue  # None: a model default; unknown keys: _check_keys named them
        if not any(isinstance(value, _KINDS[k]) and (k == "bool") == isinstance(value, bool)
                   for k in kinds if k in _KINDS):
            raise ValueError(f"{key}={value!r} must be {' or '.join(kinds)}, not "
                             f"{type(value).__name__}")


def validate_config(cfg, num_devices: int, *,
                    config_file: str | None = None) -> tuple[int, int, int]:
    """Checks everything that can be checked before touching devices; returns the mesh shape.

    Each problem is one line naming the key and what would fix it (and for a key the project
    does not know, `config_file`, the file that set it)."""
    _check_keys(cfg, config_file)
    _check_types(cfg)
    model_cfg = TransformerConfig.from_dict(cfg.model)
    optim.make_optimizer(cfg.optimizer, d_model=model_cfg.d_model,  # its checks; no arrays
                         total_steps=int(cfg.num_train_steps))
    for key in ("num_train_steps", "keep_checkpoints", "log_every_steps"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key}={cfg[key]} must be >= 1")
    if int(cfg.grad_accum_steps) < 0:
        raise ValueError(f"grad_accum_steps={cfg.grad_accum_steps} must be >= 1, or 0 to size "
                         f"it from the device count (data.max_rows_per_device)")
    for key in ("checkpoint_every_steps", "checkpoint_every_minutes", "eval_every_steps",
                "bleu_every_steps", "params_every_minutes"):
        if cfg.get(key, 0) < 0:
            raise ValueError(f"{key}={cfg[key]} must be >= 0 (0 turns it off)")
    if cfg.get("bleu_every_steps", 0) and int(cfg.bleu_num_sentences) < 1:
        raise ValueError(f"bleu_num_sentences={cfg.bleu_num_sentences} must be >= 1 when "
                         f"bleu_every_steps={cfg.bleu_every_steps} (0 turns BLEU off)")
    if cfg.get("params_every_minutes", 0) and int(cfg.params_keep) < 1:
        raise ValueError(f"params_keep={cfg.params_keep} must be >= 1 when "
                         f"params_every_minutes={cfg.params_every_minutes}")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={cfg.label_smoothing} must be in [0, 1)")
    if cfg.get("loss_chunk_tokens", -1) < -1:
        raise ValueError(f"loss_chunk_tokens={cfg.loss_chunk_tokens} must be >= 0 (0: the logits "
                         f"whole), or -1 to size chunks by backend")
    shape = sharding.mesh_shape(cfg.mesh, num_devices)
    sharding.validate_mesh_for_model(shape, model_cfg)
    batch_shards = shape[0] * shape[1]
    per_update = int(cfg.data.batch_size)
    accum = grad_accum_steps(cfg, batch_shards)
    if per_update % (accum * batch_shards):
        raise ValueError(f"data.batch_size={per_update} is not divisible by grad_accum_steps="
                         f"{accum} x mesh.data x mesh.fsdp={batch_shards}")
    return shape


def grad_accum_steps(cfg, batch_shards: int) -> int:
    """`grad_accum_steps`, or where it is 0 the fewest microbatches that give each of the
    `batch_shards` (mesh.data x mesh.fsdp) devices at most `data.max_rows_per_device` rows and
    split `data.batch_size` evenly: the tokens per update stay the paper's on any device count."""
    if int(cfg.grad_accum_steps):
        return int(cfg.grad_accum_steps)
    rows, most = int(cfg.data.batch_size), int(cfg.data.get("max_rows_per_device") or 0)
    if most < 1:
        raise ValueError("grad_accum_steps=0 sizes accumulation from data.max_rows_per_device, "
                         "which must then be >= 1")
    if rows % batch_shards:
        raise ValueError(f"data.batch_size={rows} is not divisible by mesh.data x mesh.fsdp="
                         f"{batch_shards}")
    per_device = rows // batch_shards
    return next(a for a in range(-(-per_device // most), per_device + 1) if per_device % a == 0)


def resolve_grad_accum(cfg, num_devices: int):
    """A copy of `cfg` with `grad_accum_steps` resolved for `num_devices` (see above)."""
    shape = sharding.mesh_shape(cfg.mesh, num_devices)
    resolved = cfg.copy_and_resolve_references()
    resolved.grad_accum_steps = grad_accum_steps(cfg, shape[0] * shape[1])
    return resolved


def _prepared_source(cfg, workdir: str, *, batch_shards: int):
    """The data source; with several processes, process 0 prepares the dataset and vocabulary
    first and the others then reuse them. Its batch rows must split over data x fsdp."""
    if jax.process_index() == 0:
        source = make_source(cfg, workdir)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("data prepared")
    if jax.process_index() != 0:
        source = make_source(cfg, workdir)
    for key, rows in (("data.batch_size", source.rows_per_batch),
                      ("data.eval_batch_size", source.eval_rows_per_batch)):
        if rows % batch_shards:
            raise ValueError(f"{key}: batches of {rows} rows do not split over mesh.data x "
                             f"mesh.fsdp = {batch_shards} devices; make it a multiple")
    return source


def _provenance(cfg, mesh, source) -> dict:
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    device = jax.devices()[0]
    return {
        "packages": {name: version(name) for name in PACKAGES},
        "git_sha": sha,
        "mesh_shape": dict(mesh.shape),
        "devices": {"count": jax.device_count(), "platform": device.platform,
                    "kind": device.device_kind, "processes": jax.process_count()},
        "dataset": source.fingerprint(),
        "vocabulary": source.vocabulary_fingerprint(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _write_config(cfg, workdir: str, mesh, source) -> None:
    """config.json: the resolved config and provenance. On resume the model must not change."""
    path = os.path.join(workdir, "config.json")
    resolved = cfg.to_dict()
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        changed = sorted(k for k in set(previous.get("model", {})) | set(resolved["model"])
                         if previous["model"].get(k) != resolved["model"].get(k))
        if changed:
            raise ValueError(f"{path} was written with other model settings ({', '.join(changed)})"
                             f"; resume with the same model or use a new --workdir")
        return
    if jax.process_index() == 0:  # atomically: other processes may read it meanwhile
        with open(f"{path}.tmp", "w") as f:
            json.dump(resolved | {"provenance": _provenance(cfg, mesh, source)}, f, indent=2)
        os.replace(f"{path}.tmp", path)


class _Preemption:
    """SIGTERM sets a flag; the loop saves a checkpoint at the next step and returns."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        log.warning("SIGTERM: saving a checkpoint after this step, then exiting")
        self.requested = True

    def agreed(self, step: int, every: int) -> bool:
        """True on every process if any process was signalled. With several processes they
        compare notes (a collective) only every `every` steps."""
        if jax.process_count() == 1:
            return self.requested
        if step % every:
            return False
        return bool(multihost_utils.process_allgather(np.array(self.requested)).any())

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def evaluate(trainer, eval_step, params, source, rows, split="validation") -> dict:
    """Unsmoothed eval loss and perplexity over the source's eval batches of `split`."""
    totals = {"nll_sum": 0.0, "tokens": 0.0}
    for local in source.eval_batches(split, rows):
        sums = jax.device_get(eval_step(params, train_lib.global_batch(trainer.mesh, local)))
        totals = {k: totals[k] + float(sums[k]) for k in totals}
    return train_lib.eval_metrics(totals)


def validation_bleu(translator: Translator, source, num_sentences: int, target_lang: str,
                    split: str = "validation") -> dict:
    """Both BLEUs of the translations (the config's beam search) of the first `num_sentences`
    pairs of `split`."""
    pairs = source.raw_pairs(split, num_sentences)
    hypotheses = translator.translate([s for s, _ in pairs])
    return evaluation.bleu(hypotheses, [t for _, t in pairs], target_lang=target_lang)


def _check_bleu_source(cfg, source) -> None:
    if cfg.get("bleu_every_steps", 0) and not hasattr(source, "raw_pairs"):
        raise ValueError(f"bleu_every_steps={cfg.bleu_every_steps} needs a translation dataset "
                         f"(data.dataset={cfg.data.dataset!r} gives no sentence pairs); set it "
                         f"to 0")


def train_and_evaluate(cfg, workdir: str, *,
                       config_file: str | None = None) -> train_lib.TrainState:
    """Trains `cfg` in `workdir` (resuming if it holds a checkpoint); returns the final state.
    `config_file`, where `cfg` came from, is named in errors about its keys."""
    shape = validate_config(cfg, jax.device_count(), config_file=config_file)
    if not int(cfg.grad_accum_steps):
        cfg = resolve_grad_accum(cfg, jax.device_count())
        log.info("grad_accum_steps=0: %d microbatches of %d rows per update on %d devices",
                 cfg.grad_accum_steps, cfg.data.batch_size // cfg.grad_accum_steps,
                 jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    source = _prepared_source(cfg, workdir, batch_shards=shape[0] * shape[1])
    _check_bleu_source(cfg, source)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train_lib.build_trainer(cfg, mesh)
    _write_config(cfg, workdir, mesh, source)
    checkpointer = Checkpointer(workdir, keep=int(cfg.keep_checkpoints))
    series = (ParamsSeries(workdir, every_minutes=float(cfg.params_every_minutes),
                           keep=int(cfg.params_keep))
              if cfg.get("params_every_minutes", 0) else None)
    restored = checkpointer.restore_latest(trainer.abstract_state)
    if restored is None:
        latest, state, next_batch = None, train_lib.init_state(trainer, int(cfg.seed)), 0
    else:
        latest, state, data_state = restored
        log.info("resuming from %s/%d", checkpointer.directory, latest)
        next_batch = int(data_state["next_batch_index"])
    step = int(jax.device_get(state.step))
    rows = train_lib.process_rows(mesh, source.rows_per_batch)
    eval_rows = train_lib.process_rows(mesh, source.eval_rows_per_batch)
    train_step = _compile(train_lib.make_train_step(trainer, cfg), "train step",
                          state, train_lib.global_batch(mesh, source.train_batch(0, rows)))
    eval_step = train_lib.make_eval_step(trainer)
    eval_split = source.validation_split  # a language model's data.eval_split (lm1b: "test")
    translator = (Translator(cfg, state.params, source.tokenizer)
                  if cfg.get("bleu_every_steps", 0) else None)
    writer = metrics.MetricWriter(workdir)
    preemption = _Preemption()
    total = int(cfg.num_train_steps)
    flops_per_token = flops.train_flops_per_token(
        TransformerConfig.from_dict(cfg.model), source_length=source.source_length,
        target_length=source.target_length)
    peak = metrics.peak_flops_per_device()
    progress = metrics.Progress(step, total)
    pending: list[tuple[int, dict]] = []
    last_save_time, last_saved = time.monotonic(), latest
    profile_start, profile_steps = int(cfg.profile_start_step), int(cfg.profile_num_steps)
    try:
        while step < total:
            if profile_steps and step == profile_start:
                jax.profiler.start_trace(os.path.join(workdir, "profile"))
            started = time.perf_counter()
            batch = train_lib.global_batch(mesh, source.train_batch(next_batch, rows))
            progress.add_step(time.perf_counter() - started)
            state, step_metrics = train_step(state, batch)
            step, next_batch = step + 1, next_batch + 1
            pending.append((step, step_metrics))
            if profile_steps and step == profile_start + profile_steps:
                jax.profiler.stop_trace()
            preempted = preemption.agreed(step, cfg.log_every_steps)
            if step % cfg.log_every_steps == 0 or step == total or preempted:
                _flush(pending, progress, writer, step, total, flops_per_token, peak, cfg,
                       last_saved)
                pending = []
            due_loss = _due(cfg.eval_every_steps, step, total)
            due_bleu = translator is not None and _due(cfg.bleu_every_steps, step, total)
            if due_loss or due_bleu:
                started = time.perf_counter()
                figures = (evaluate(trainer, eval_step, state.params, source, eval_rows,
                                    eval_split) if due_loss else {})
                if due_bleu:
                    translator.params = state.params
                    figures |= validation_bleu(translator, source, int(cfg.bleu_num_sentences),
                                               cfg.data.target_lang, eval_split)
                writer.write(step, eval_split, figures)
                metrics.log_evaluation(step, eval_split, figures,
                                       time.perf_counter() - started)
                progress.exclude(time.perf_counter() - started)
            if _should_save(cfg, step, total, last_save_time) or preempted:
                checkpointer.save(step, state, {"next_batch_index": next_batch})
                last_save_time, last_saved = time.monotonic(), step
            if series is not None:
                if step == total or preempted:
                    series.save(step, state.params)
                else:
                    series.maybe_save(step, state.params)
            if preempted:
                log.warning("preempted: checkpoint %d saved, exiting", step)
                break
    finally:  # the checkpointer last: a failed save raises there, after the rest is closed
        writer.close()
        preemption.restore()
        if series is not None:
            series.close()
        checkpointer.close()
    return state


def _compile(jitted, what: str, *example_args):
    """Compiles ahead of time (timed, logged) and, with several processes, waits until every
    process has: a process still compiling must not leave the others waiting in a collective
    past its timeout."""
    started = time.perf_counter()
    compiled = jitted.lower(*example_args).compile()
    log.info("%s compiled in %.1f s", what, time.perf_counter() - started)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"{what} compiled")
    return compiled


def _due(every: int, step: int, total: int) -> bool:
    """Every `every` steps (0: never) and at the last step."""
    return bool(every) and (step % every == 0 or step == total)


def _should_save(cfg, step: int, total: int, last_save_time: float) -> bool:
    """Every `checkpoint_every_steps`, every `checkpoint_every_minutes` (process 0's clock),
    and at the end."""
    due = step == total or bool(cfg.checkpoint_every_steps
                                and step % cfg.checkpoint_every_steps == 0)
    if cfg.checkpoint_every_minutes:
        elapsed = time.monotonic() - last_save_time >= 60 * cfg.checkpoint_every_minutes
        if jax.process_count() > 1:
            elapsed = bool(multihost_utils.broadcast_one_to_all(np.array(elapsed)))
        due = due or elapsed
    return due


class NonFiniteLoss(RuntimeError):
    """The loss or gradient was not finite (the update was not applied)."""


def _flush(pending, progress, writer, step, total, flops_per_token, peak, cfg, last_saved):
    """Fetches the pending step metrics, writes one train line per step, logs progress."""
    fetched = jax.device_get([m for _, m in pending])
    tokens = sum(float(m["sequence_tokens"]) for m in fetched)
    progress.add_tokens(tokens)
    window = progress.report(step)
    if peak is not None:
        window["mfu"] = flops_per_token * window["tokens_per_sec"] / (peak * jax.device_count())
    for (s, _), m in zip(pending, fetched, strict=True):
        if bool(m["nonfinite"]) and not cfg.skip_nonfinite_updates:
            last = f"checkpoint {last_saved}" if last_saved else "no checkpoint yet"
            raise NonFiniteLoss(f"step {s}: loss {float(m['loss'])} or gradient norm "
                                f"{float(m['grad_norm'])} is not finite; the update was not "
                                f"applied. Last good checkpoint: {last}. Lower the learning rate"
                                f" or set clip_norm, or skip_nonfinite_updates=True")
        line = {"loss": m["loss"], "learning_rate": m["learning_rate"],
                "grad_norm": m["grad_norm"], "tokens_per_sec": window["tokens_per_sec"],
                "data_wait_fraction": window["data_wait_fraction"],
                "target_tokens_per_update": m["target_tokens"],
                "nonfinite_skipped": int(m["nonfinite"])}
        if "mfu" in window:
            line["mfu"] = window["mfu"]
        writer.write(s, "train", line)
    metrics.log_progress(step, total, fetched[-1] | window)
