"""The training loop: validate, build the mesh, init or resume, train, evaluate, checkpoint.

`train_and_evaluate(cfg, workdir)` is what `train.py` runs. Rerunning it on the same workdir
resumes from the latest checkpoint. On the same mesh the losses continue bit for bit. SIGTERM
saves a checkpoint and returns cleanly. The metrics of every step a checkpoint covers are on disk
before its save starts (`metrics.MetricWriter.sync`), so a kill loses no line for good.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from importlib import metadata

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer.checkpoint import faults, layout, tiers
from transformer.checkpoint.averaging import ParamsSeries
from transformer.checkpoint.checkpointer import Checkpointer, list_steps
from transformer.config import resolve
from transformer.data import make_source
from transformer.data.workers import TrainBatches
from transformer.inference.translator import Translator
from transformer.parallel import distributed, sharding
from transformer.sizing import flops
from transformer.training import (
    dpo,
    elastic,
    evaluation,
    health,
    metrics,
    scores,
    spikes,
    train_state,
    transfer,
)
from transformer.training.goodput import STATE_KEY, Goodput, recomputed_seconds
from transformer.training.watchdog import Watchdog

log = logging.getLogger("transformer")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformer")


DATA_PREPARED_KEY = "transformer/data_prepared"
DATA_READY_KEY = "transformer/data_ready/{}"  # process p has its source
DATA_WAIT_LOG_S = 60  # the others say they are waiting once a minute


def _await_key(client, key: str, what: str) -> None:
    """Waits for `key` in the coordination service's key-value store, saying so each
    DATA_WAIT_LOG_S (no timeout: a failing peer stops this one, `distributed.FailureNotices`)."""
    waited = 0
    while True:
        try:
            client.blocking_key_value_get(key, DATA_WAIT_LOG_S * 1000)
            return
        except Exception as error:  # the deadline: go on waiting, saying so
            if "DEADLINE_EXCEEDED" not in str(error):
                raise
            waited += DATA_WAIT_LOG_S
            log.info("process %d: waiting %d s for %s", jax.process_index(), waited, what)


def _prepared_source(cfg, workdir: str, *, batch_shards: int):
    """The data source. With several processes, process 0 prepares the dataset and vocabulary
    first and the others then reuse them, and none goes on (to the collectives of restoring
    and compiling) before all have their source. They wait on keys of the coordination
    service's key-value store, not in a collective: a long preparation hits no barrier timeout,
    and a failure still stops them (`distributed.FailureNotices`). Its batch rows must split
    over data x fsdp."""
    client = None
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed  # no public handle to the client

        client = jax_distributed.global_state.client
    if jax.process_index() == 0:
        source = make_source(cfg, workdir)
        if client is not None:
            client.key_value_set(DATA_PREPARED_KEY, "1")
    else:
        _await_key(client, DATA_PREPARED_KEY, "process 0 to prepare the data")
        source = make_source(cfg, workdir)
    if client is not None:  # the others may still be reading their files (counting rows)
        client.key_value_set(DATA_READY_KEY.format(jax.process_index()), "1")
        for p in range(jax.process_count()):
            _await_key(client, DATA_READY_KEY.format(p), f"process {p} to open its data")
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
    } | ({"images": source.preprocessing()} if hasattr(source, "preprocessing") else {})


def _write_config(cfg, workdir: str, mesh, source) -> None:
    """config.json: the resolved config and provenance. On resume the model must not change."""
    resolved = cfg.to_dict()
    previous = layout.read_config_file(workdir)
    if previous is not None:
        changed = sorted(k for k in set(previous.get("model", {})) | set(resolved["model"])
                         if previous["model"].get(k) != resolved["model"].get(k))
        if changed:
            raise ValueError(f"{layout.path(workdir, layout.CONFIG)} was written with "
                             f"other model settings ({', '.join(changed)}); resume with the same "
                             f"model or use a new --workdir")
        return
    if jax.process_index() == 0:
        layout.write_config(workdir, resolved, _provenance(cfg, mesh, source))


class _Preemption:
    """SIGTERM sets a flag. The loop saves a checkpoint at the next step and returns."""

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


def validation_bleu(translator: Translator, source, num_sentences: int, target_lang: str,
                    split: str = "validation") -> dict:
    """Both BLEUs of the translations (the config's beam search) of the first `num_sentences`
    pairs of `split`, and `bleu_num_truncated`: how many sources were cut to the model's
    max_len (the others were translated whole)."""
    pairs = source.raw_pairs(split, num_sentences)
    sources = [s for s, _ in pairs]
    figures = scores.bleu(translator.translate(sources), [t for _, t in pairs],
                              target_lang=target_lang)
    return figures | {"bleu_num_truncated": translator.num_too_long(sources)}


def _check_bleu_source(cfg, source) -> None:
    if cfg.bleu_every_steps and not hasattr(source, "raw_pairs"):
        raise ValueError(f"bleu_every_steps={cfg.bleu_every_steps} needs a translation dataset "
                         f"(data.dataset={cfg.data.dataset!r} gives no sentence pairs); set it "
                         f"to 0")


def train_and_evaluate(cfg, workdir: str, *, config_file: str | None = None,
                       score_split: str | None = None) -> train_state.TrainState:
    """Trains `cfg` in `workdir` (resuming if it holds a checkpoint). Returns the final state.
    `config_file`, where `cfg` came from, is named in errors about its keys. `score_split`: the
    split that `evaluation.score_trained_run` scores next (train.py's --score_split), checked
    here first and counted in the ETA. With several processes, an error in one stops all within
    seconds, naming it (`distributed.FailureNotices`): each process prints its line and ends
    with status 1 instead of raising."""
    with distributed.FailureNotices(one_line_errors=(ValueError, NonFiniteLoss)) as notices:
        return _train(cfg, workdir, config_file, notices, score_split)


def _train(cfg, workdir: str, config_file: str | None, notices: distributed.FailureNotices,
           score_split: str | None) -> train_state.TrainState:
    cfg = elastic.fit(cfg, workdir, jax.device_count())  # elastic=True: the devices left
    run = resolve(cfg, jax.device_count(), config_file=config_file)
    if score_split:
        evaluation.check_scorable(run.model, score_split)
    clock = Goodput()  # this process's time by part; the run's totals carried over
    if not cfg.grad_accum_steps:
        log.info("grad_accum_steps=0: %d microbatches of %d rows per update on %d devices",
                 run.config.grad_accum_steps,
                 run.config.data.batch_size // run.config.grad_accum_steps, jax.device_count())
    cfg = run.config
    tiers.check_settings(cfg, workdir)  # the local tier's directory and interval
    starting = not list_steps(layout.path(workdir, layout.CHECKPOINTS))
    init = transfer.parse(cfg.init_from) if cfg.init_from and starting else None
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    if init is not None and cfg.data.dataset != "synthetic":  # before the data pipeline
        transfer.copy_vocabulary(init, workdir, int(cfg.data.vocab_size))  # trains its own
    source = _prepared_source(cfg, workdir, batch_shards=sharding.batch_shards(run.mesh_shape))
    _check_bleu_source(cfg, source)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train_state.build_trainer(run, mesh)
    _write_config(cfg, workdir, mesh, source)
    checkpointer = tiers.TwoTiers.for_run(cfg, workdir)  # checkpoints/ and the local tier
    series = (ParamsSeries(workdir, every_minutes=float(cfg.params_every_minutes),
                           keep=int(cfg.params_keep))
              if cfg.params_every_minutes else None)
    with clock.timed("checkpoint"):
        restored = _restore(checkpointer, trainer)
    if restored is None:
        latest = None
        state = train_state.init_state(trainer, int(cfg.seed))
        next_batch = 0
        if cfg.init_from:  # only before the run's own first checkpoint
            init = init or transfer.parse(cfg.init_from)
            params, _ = transfer.load(init, state.params, has_class_token=(
                run.model.architecture == "vision" and run.model.pooling == "cls"),
                exclude=cfg.init_from_exclude)
            state = state.replace(params=params)
    else:
        latest, state, data_state = restored
        log.info("resuming from %s/%d", checkpointer.directory, latest)
        clock.carry(data_state.get(STATE_KEY, {}), recomputed_seconds(
            layout.path(workdir, layout.METRICS), latest))
        next_batch = int(data_state["next_batch_index"])
    step = int(jax.device_get(state.step))
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    eval_rows = train_state.process_rows(mesh, source.eval_rows_per_batch)
    total = int(cfg.num_train_steps)
    batches = TrainBatches(source, cfg, workdir, rows, start=next_batch, count=total - step,
                           workers=int(cfg.data.get("workers") or 0))
    try:  # data.workers start up behind the compile
        with clock.timed("compile"):
            step_fn = train_state.make_train_step(trainer, cfg, faults.injected_spikes())
            train_step = _compile(step_fn, "train step", state,
                                  train_state.global_batch(mesh, source.train_batch(0, rows)))
    except BaseException:
        batches.close()
        raise
    eval_step = train_state.make_eval_step(trainer)
    eval_split = source.validation_split  # a language model's data.eval_split (lm1b: "test")
    translator = (Translator(cfg, run.model, state.params, source.tokenizer)
                  if cfg.bleu_every_steps else None)
    score_tasks = None
    if cfg.lm_eval_every_steps:  # lm-eval tasks from local files (the `eval` extra)
        from transformer.inference import harness
        score_tasks = harness.for_training(cfg, run.model, state.params, source.tokenizer)
    writer = metrics.MetricWriter(workdir, metrics.tracker_name(cfg), log_config=True)
    preemption = _Preemption()
    dog = Watchdog.for_run(cfg)  # slow steps and hangs named (off by default)
    flops_per_token = flops.train_flops_per_token(
        run.model, source_length=source.source_length,
        target_length=source.target_length) * dpo.flops_factor(cfg)
    peak = metrics.peak_flops_per_device()
    progress, eval_count = _progress(cfg, run.model, source, step, eval_split, score_split)
    pending: list[tuple[int, dict]] = []
    last_save_time = time.monotonic()
    last_saved = latest
    profile_start = int(cfg.profile_start_step)
    profile_steps = int(cfg.profile_num_steps)
    clock.start_training()  # the time so far, but restoring and compiling, was start-up
    try:
        while step < total:
            if profile_steps and step == profile_start:
                jax.profiler.start_trace(layout.path(workdir, layout.PROFILE))
            started = time.perf_counter()
            batch = train_state.global_batch(mesh, next(batches))
            progress.add_step(time.perf_counter() - started)
            clock.add("data_wait", time.perf_counter() - started)
            state, step_metrics = train_step(state, batch)
            step, next_batch = step + 1, next_batch + 1
            dog.beat(step, step_metrics)
            pending.append((step, step_metrics))
            faults.step_fault(step)
            if profile_steps and step == profile_start + profile_steps:
                jax.profiler.stop_trace()
            preempted = preemption.agreed(step, cfg.log_every_steps)
            if step % cfg.log_every_steps == 0 or step == total or preempted:
                _flush(pending, progress, writer, step, total, flops_per_token, peak, cfg,
                       last_saved, clock.figures())
                pending = []
            due_loss = _due(cfg.eval_every_steps, step, total)
            due_bleu = translator is not None and _due(cfg.bleu_every_steps, step, total)
            due_tasks = score_tasks is not None and _due(cfg.lm_eval_every_steps, step, total)
            if due_loss or due_bleu or due_tasks:
                started = time.perf_counter()
                figures = {}
                if due_loss:  # each kind timed for the ETA
                    with progress.timed("validation pass", step, eval_count):
                        figures = evaluation.evaluate(  # DPO: the reference too
                            trainer, eval_step, dpo.eval_params(trainer, state), source,
                            eval_rows, eval_split)
                if due_bleu:
                    with progress.timed("BLEU decode", step) as timing:
                        translator.params = state.params
                        figures |= validation_bleu(translator, source,
                                                   int(cfg.bleu_num_sentences),
                                                   cfg.data.target_lang, eval_split)
                        timing.items = evaluation.decoded_rows(figures["bleu_num_sentences"])
                if due_tasks:
                    with progress.timed("lm-eval tasks", step):
                        figures |= score_tasks(state.params)
                writer.write(step, eval_split, figures)
                metrics.log_evaluation(step, eval_split, figures,
                                       time.perf_counter() - started)
                progress.exclude(time.perf_counter() - started)
                clock.add("evaluation", time.perf_counter() - started)
                dog.rest()
            persistent = _should_save(cfg, step, total, last_save_time) or preempted
            if persistent or checkpointer.local_due(step):
                if pending:  # the lines of every step the checkpoint covers come first
                    _flush(pending, progress, writer, step, total, flops_per_token, peak, cfg,
                           last_saved, clock.figures())
                    pending = []
                with clock.timed("checkpoint"):
                    writer.sync(durable=persistent)  # a local save: to the OS, no fsync
                    checkpointer.save(step, state, {"next_batch_index": next_batch,
                                                    STATE_KEY: clock.state()},
                                      persistent=persistent)
                if persistent:
                    last_save_time = time.monotonic()
                    last_saved = step
                dog.rest()
            if series is not None:
                with clock.timed("checkpoint"):
                    if step == total or preempted:
                        series.save(step, state.params)
                    else:
                        series.maybe_save(step, state.params)
            if preempted:
                log.warning("preempted: checkpoint %d saved, exiting", step)
                break
        if step >= total and run.model.classifies:  # trained: score the test split
            with clock.timed("evaluation"):
                evaluation.evaluate_test_split(trainer, state.params, source, eval_rows, step,
                                               writer, workdir)
    except BaseException as error:  # the others learn of it before this process cleans up
        notices.post(error)
        raise
    finally:  # the checkpointer last: a failed save raises there, after the rest is closed
        batches.close()
        writer.close()
        dog.close()
        preemption.restore()
        if series is not None:
            series.close()
        with clock.timed("checkpoint"):
            checkpointer.close()  # waits for the last save
        log.info("%s", clock.summary())
    return state


def _restore(checkpointer: Checkpointer, trainer: train_state.Trainer):
    """`checkpointer.restore_latest` for the trainer's state. A run that turns
    `optimizer.skip_spikes` on resumes a checkpoint written without it, with an empty window."""
    abstract = trainer.abstract_state
    latest = checkpointer.latest_step()
    if trainer.spikes is not None and latest is not None:
        plain = train_state.without_spikes(abstract)
        try:
            fits = checkpointer.shape_problem(latest, plain) is None
        except Exception:  # a damaged checkpoint: restore_latest moves it aside
            fits = False
        restored = checkpointer.restore_latest(plain) if fits else None
        if restored is not None:
            step, state, data_state = restored
            log.info("checkpoint %d has no spike window (optimizer.skip_spikes was off): "
                     "starting an empty one", step)
            window = jax.tree.map(lambda value, like: jax.device_put(value, like.sharding),
                                  spikes.init_window(trainer.spikes), abstract.spikes)
            return step, train_state.with_spikes(state, window), data_state
    return checkpointer.restore_latest(abstract)


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


def _progress(cfg, model, source, step: int, eval_split: str, score_split: str | None):
    """(Progress, the sentences of `eval_split` or None): the ETA counts the evaluations due
    and the scoring after training, the loop's own test split of a classifier and
    `score_split`, timed by the validation pass (per sentence where counted) and BLEU decode
    (per row decoded)."""
    counted = bool(score_split) and hasattr(source, "num_pairs")
    final = {"test pass": ("validation pass", None)} if model.classifies else {}
    if score_split:
        scored = source.num_pairs(score_split) if counted else None
        final[f"{score_split} pass"] = ("validation pass", scored)
        if model.architecture == "encoder_decoder" and counted:
            final[f"{score_split} decode"] = ("BLEU decode", evaluation.decoded_rows(scored))
    every = {"validation pass": cfg.eval_every_steps, "BLEU decode": cfg.bleu_every_steps,
             "lm-eval tasks": cfg.lm_eval_every_steps}
    progress = metrics.Progress(step, int(cfg.num_train_steps), unit=_progress_unit(model),
                                every=every, final=final)
    return progress, source.num_pairs(eval_split) if counted else None


def _progress_unit(model) -> str:
    """What a train step's `sequence_tokens` count: images, examples or tokens."""
    return {"vision": "img", "classifier": "ex"}.get(model.architecture, "tok")


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


class LossSpikes(NonFiniteLoss):
    """`optimizer.max_skipped_in_a_row` updates in a row were skipped as loss spikes."""


def _flush(pending, progress, writer, step, total, flops_per_token, peak, cfg, last_saved,
           goodput: dict | None = None):
    """Fetches the pending step metrics, writes one train line per step (the last with the
    `goodput` figures), logs progress."""
    fetched = jax.device_get([m for _, m in pending])
    tokens = sum(float(m["sequence_tokens"]) for m in fetched)
    progress.add_tokens(tokens)
    window = progress.report(step)
    if peak is not None:
        window["mfu"] = flops_per_token * window["tokens_per_sec"] / (peak * jax.device_count())
    for (s, _), m in zip(pending, fetched, strict=True):
        last = f"checkpoint {last_saved}" if last_saved else "no checkpoint yet"
        if bool(m["nonfinite"]) and not cfg.skip_nonfinite_updates:
            where = health.locate_nonfinite(float(m["loss"]), m.get("health"))
            raise NonFiniteLoss(f"step {s}: loss {float(m['loss'])} or gradient norm "
                                f"{float(m['grad_norm'])} is not finite ({where}); the update "
                                f"was not applied. Last good checkpoint: {last}. Lower the "
                                f"learning rate or set clip_norm, or skip_nonfinite_updates=True")
        if bool(m.get("spike_stop", False)):
            count = int(m["spikes_in_a_row"])
            raise LossSpikes(f"steps {s - count + 1}..{s}: {count} updates in a row skipped as "
                             f"loss spikes (optimizer.max_skipped_in_a_row), none applied since "
                             f"step {s - count}. Last good checkpoint: {last}. Look at those "
                             f"batches, or raise optimizer.spike_threshold")
        line = {"loss": m["loss"], "learning_rate": m["learning_rate"],
                "grad_norm": m["grad_norm"], "tokens_per_sec": window["tokens_per_sec"],
                "steps_per_sec": window["steps_per_sec"],
                "data_wait_fraction": window["data_wait_fraction"],
                "target_tokens_per_update": m["target_tokens"],
                "nonfinite_skipped": int(m["nonfinite"])}
        if "mfu" in window:
            line["mfu"] = window["mfu"]
        line |= {k: m[k] for k in train_state.LOSS_SCALE_METRICS if k in m}  # float16 runs
        line |= {k: m[k] for k in train_state.MOE_METRICS if k in m}  # routed layers
        line |= {k: m[k] for k in train_state.SPIKE_METRICS if k in m}  # optimizer.skip_spikes
        line |= {k: m[k] for k in dpo.METRICS if k in m}  # data.objective="dpo"
        if bool(m.get("health_logged", False)):
            line |= health.line_figures(m["health"])
        if goodput and s == pending[-1][0]:
            line |= goodput
        writer.write(s, "train", line)
    metrics.log_progress(step, total, fetched[-1] | window, progress.unit)
