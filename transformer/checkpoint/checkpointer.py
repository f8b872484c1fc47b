"""Checkpoints: orbax wiring and checksums, and the conversion between scanned and per-layer
parameters (averaging and reading a run's params: `averaging`).

Layout (docs/architecture.md, "The workdir"): `<workdir>/checkpoints/<step>/` is an orbax
Composite with item "state" (params, opt_state, step) and item "data" (the input iterator: the
next global batch index; and a checksum of each array of the state, checked on restore).
Restoring into abstract arrays that carry new shardings moves a checkpoint onto another mesh or
device count.

Faults. Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it into place last, so
a save cut short is never listed as a step (the next run removes it, at the latest before its
first save).
`Checkpointer.restore_latest` skips a checkpoint that fails to restore (a corrupted or truncated
file), moving it to `<workdir>/skipped_checkpoints/<step>` with one log line saying why, and
resumes from the one before. A save that fails (a full disk) raises `CheckpointSaveError`, one
line naming the step and the checkpoint still intact.

Fault injection for tests and the filters of orbax's log noise live beside this module, in
`faults`, and are installed when a Checkpointer is created.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from transformer.checkpoint import faults
from transformer.checkpoint.layout import CHECKPOINTS, SKIPPED_CHECKPOINTS, absolute, is_remote

_LAYER = re.compile(r"^layers_(\d+)$")
CHECKSUMS = "state_checksums"  # key of the data item: `checksums` of the saved state
log = logging.getLogger("transformer")


class CheckpointSaveError(ValueError):
    """A checkpoint could not be written (e.g. the disk is full). The message is one line."""


@jax.jit
def _leaf_checksums(state: Any) -> jax.Array:
    """One uint32 per leaf of `state`: the sum, modulo 2**32, of each element's bits times an
    odd weight from its position. Integer sums do not depend on the order of addition, so every
    mesh gives the same digests. Any single changed element changes its leaf's."""
    sums = []
    for leaf in jax.tree.leaves(state):
        unsigned = jnp.dtype(f"uint{8 * leaf.dtype.itemsize}")
        bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
        index = jnp.zeros(leaf.shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(leaf.ndim)):
            index = index + jax.lax.broadcasted_iota(jnp.uint32, leaf.shape, axis) * stride
            stride = stride * leaf.shape[axis] % 2**32
        sums.append(jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32))
    return jnp.stack(sums)


def checksums(state: Any) -> list[int]:
    """`_leaf_checksums` as plain ints (on every process)."""
    digest = _leaf_checksums(state)
    if jax.process_count() > 1:
        digest = multihost_utils.process_allgather(digest, tiled=True)
    return [int(x) for x in np.asarray(digest)]


def one_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:limit]


def path_name(path) -> str:
    """A pytree key path as the names the checkpoint layout uses: `encoder/layers_0/ffn/...`."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def _shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): tuple(leaf.shape) for path, leaf in leaves}


class Checkpointer:
    """Async saves of (state, data) under `<workdir>/checkpoints`, keeping the last `keep`."""

    def __init__(self, workdir: str, *, keep: int, use_async: bool = True,
                 directory: str | None = None, skipped: str | None = None):
        """`directory` and `skipped` (where damaged steps go) default to the workdir's
        `checkpoints/` and `skipped_checkpoints/` (the local tier gives its own: `tiers`)."""
        self.directory = directory or os.path.join(absolute(workdir), CHECKPOINTS)  # or gs://
        self._skipped = skipped or os.path.join(os.path.dirname(self.directory),
                                                SKIPPED_CHECKPOINTS)
        self.skipped: list[str] = []  # "step (why)" of each step restore_latest moved aside
        faults.install_log_filters()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=use_async,
            cleanup_tmp_directories=True,
            temporary_path_class=faults.fault_injecting_path_class(),
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler()})
        self._saving: int | None = None  # the step of the save in flight
        self._abandoned = False  # a failed save left orbax's threads waiting on the others

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Starts an async save of step `step` (waits for the previous save first)."""
        self.wait()
        faults.take_save_failure()  # none is in flight: forget any older one
        self._saving = step
        data_state = data_state | {CHECKSUMS: checksums(state)}
        with self._save_errors():
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
                force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, placed as `abstract_state`'s shardings, and the data state.
        Raises ValueError naming the first array that does not match its saved checksum."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        state = restored["state"]
        data_state = dict(restored["data"])
        saved = data_state.pop(CHECKSUMS, None)
        if saved is not None:
            paths = list(_shapes(state))
            for path, want, got in zip(paths, saved, checksums(state), strict=True):
                if want != got:
                    raise ValueError(f"{path} does not match the checksum saved with it")
        return state, data_state

    def shape_problem(self, step: int, abstract_state: Any) -> str | None:
        """How checkpoint `step` disagrees with `abstract_state` (the config's): the first array
        whose shape differs, with both shapes; None if they agree. Reading a damaged
        checkpoint's metadata raises."""
        faults.quiet_failed_restores(self.directory)  # its stray reads, as restore_latest's
        saved = _shapes(self._manager.item_metadata(step)["state"])
        wanted = _shapes(abstract_state)
        problems = [f"has no {path} (the config's shape {shape})" if path not in saved else
                    f"holds {path} with shape {saved[path]} but the config gives {shape}"
                    for path, shape in wanted.items() if saved.get(path) != shape]
        problems += [f"holds {path} {shape}, which the config does not have"
                     for path, shape in saved.items() if path not in wanted]
        if not problems:
            return None
        return (f"checkpoint {step} in {self.directory} {problems[0]}: resume with the config "
                f"it was trained with (its config.json) or use a new --workdir")

    def restore_latest(self, abstract_state: Any, steps: list[int] | None = None, *,
                       last_resort: bool = True) -> tuple[int, Any, dict] | None:
        """(step, state, data state) of the newest checkpoint that restores (among `steps`,
        the same list on every process; default: all); None when there is none. One that fails
        to restore is moved to `<workdir>/skipped_checkpoints/` with a warning naming it and
        why; when all fail, the `last_resort` raises one line listing them. One whose shapes
        disagree with the config raises ValueError."""
        skipped = []
        # Before any attempt: a failing restore's stray callbacks can fire before it raises.
        faults.quiet_failed_restores(self.directory)
        for step in sorted(self.all_steps() if steps is None else steps, reverse=True):
            failure = problem = None
            try:
                problem = self.shape_problem(step, abstract_state)
                if problem is None:
                    state, data_state = self.restore(step, abstract_state)
            except Exception as error:  # any failure to read it back: a damaged checkpoint
                failure = error
            if jax.process_count() > 1:  # all processes skip it, or none does
                elsewhere = multihost_utils.process_allgather(np.array(failure is not None))
                if failure is None and elsewhere.any():
                    failure = RuntimeError("another process could not restore it")
            if problem is not None:
                raise ValueError(problem)
            if failure is None:
                return step, state, data_state
            skipped.append(f"{step} ({one_line(failure, 120)})")
            moved = self._move_aside(step)
            log.warning("checkpoint %d does not restore (%s): moved to %s; trying the "
                        "previous one", step, one_line(failure), moved)
        self.skipped += skipped
        if skipped and last_resort:
            raise ValueError(f"no checkpoint in {self.directory} restores: {'; '.join(skipped)};"
                             f" they were moved to {self._skipped_dir()}; start afresh with a new"
                             f" --workdir")
        return None

    def _skipped_dir(self) -> str:
        return self._skipped

    def _move_aside(self, step: int) -> str:
        """Moves checkpoint `step` to `skipped_checkpoints/` (process 0; all processes wait)."""
        skipped = epath.Path(self._skipped_dir())  # local or gs://
        target = skipped / str(step)
        suffix = 1
        while target.exists():
            target, suffix = skipped / f"{step}.{suffix}", suffix + 1
        if jax.process_index() == 0 and (epath.Path(self.directory) / str(step)).exists():
            _move_tree(epath.Path(self.directory) / str(step), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
        self._manager.reload()
        return os.fspath(target)

    @contextlib.contextmanager
    def _save_errors(self):
        """An OSError of the save of step `self._saving` becomes a one-line CheckpointSaveError."""
        try:
            yield
        except OSError as error:
            steps = list_steps(self.directory)
            intact = f"checkpoint {steps[-1]} is intact" if steps else "no checkpoint was saved"
            what, fix = (("disk full", "free space") if error.errno == errno.ENOSPC
                         else (one_line(error), "fix that"))
            raise CheckpointSaveError(
                f"{what} while saving checkpoint {self._saving} in {self.directory}; {fix} "
                f"(or use another --workdir) and rerun to resume: {intact}") from error

    def wait(self) -> None:
        """Waits for the save in flight. A failed one raises CheckpointSaveError.

        With several processes, a save that fails in one process must raise there at once:
        orbax's finalize thread would first wait in a barrier for the others, which wait in
        another for this process's commit, until `AsyncOptions.timeout_secs` (10 minutes).
        Raising lets `distributed.FailureNotices` stop every process within a second. The
        stuck orbax threads end with the process."""
        with self._save_errors():
            if jax.process_count() > 1:
                while self._manager.is_saving_in_progress():
                    failure = faults.take_save_failure()
                    if failure is not None:
                        self._abandoned = True
                        raise failure
                    time.sleep(0.1)
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight (a failed one raises CheckpointSaveError) and closes.
        After a save abandoned by `wait`, closes nothing (the process is ending)."""
        if self._abandoned:
            return
        self.wait()
        with self._save_errors():
            self._manager.close()


def unstack_layers(params: dict) -> dict:
    """Scanned layout (`layers` with a leading L axis) -> `layers_0 .. layers_{L-1}`."""
    out = {}
    for key, value in params.items():
        if key == "layers" and isinstance(value, dict):
            num = jax.tree.leaves(value)[0].shape[0]
            out.update({f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], value)
                        for i in range(num)})
        elif isinstance(value, dict):
            out[key] = unstack_layers(value)
        else:
            out[key] = value
    return out


def stack_layers(params: dict) -> dict:
    """Per-layer layout `layers_{i}` -> scanned layout (`layers` with a leading L axis)."""
    out = {}
    layers = {}
    for key, value in params.items():
        match = _LAYER.match(key)
        if match:
            layers[int(match.group(1))] = value
        elif isinstance(value, dict):
            out[key] = stack_layers(value)
        else:
            out[key] = value
    if layers:
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"layer indices {sorted(layers)} are not 0..{len(layers) - 1}")
        ordered = [layers[i] for i in range(len(layers))]
        out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *ordered)
    return out


def _move_tree(source: epath.Path, target: epath.Path) -> None:
    """Moves directory `source` to `target`: a rename on a local disk. In a bucket (gs://),
    which has no directories to rename, its files copied and then the source removed (a move cut
    short leaves the source whole)."""
    if is_remote(os.fspath(source)):
        _copy_tree(source, target)
        source.rmtree()
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)


def _copy_tree(source: epath.Path, target: epath.Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.is_dir():
            _copy_tree(entry, target / entry.name)
        else:
            entry.copy(target / entry.name)


def list_steps(directory: str) -> list[int]:
    """The finished orbax steps under `directory` (temporary, unfinished saves excluded)."""
    if not epath.Path(directory).is_dir():  # local or remote (gs://)
        return []
    return sorted(ocp.utils.checkpoint_steps(directory))
