"""Checkpoint averaging (the paper averages the last 5 or 20 checkpoints) and reading a run's
params.

`<workdir>/params/<step>/`   the params-only series (ParamsSeries): item "params", pruned to K
`<workdir>/averaged/<name>/` averaged params: one orbax PyTree, never resumed from or pruned

Everything here reads into host memory as numpy arrays, so it works whatever mesh or device
count wrote the checkpoints, and from a process with a single CPU device. The workdir may be
remote (gs://): orbax reads and writes it natively, and the rest goes through etils.epath.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from transformer.checkpoint import faults
from transformer.checkpoint.checkpointer import list_steps, one_line
from transformer.checkpoint.layout import AVERAGED, CHECKPOINTS, PARAMS_SERIES, absolute
from transformer.util import progress


class ParamsSeries:
    """Params-only saves every `every_minutes` into `<workdir>/params/<step>/`, keeping `keep`.

    The paper averages the last 5 (base) or 20 (big) checkpoints written at 10-minute intervals.
    A params-only series gives those without 20 optimizer states on disk. Call `maybe_save`
    after each update (it decides on process 0's clock, so all processes agree) and `save` for
    the final step; `average_checkpoints` prefers this series when it exists.
    """

    def __init__(self, workdir: str, *, every_minutes: float, keep: int, use_async: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        if every_minutes <= 0 or keep < 1:
            raise ValueError(f"ParamsSeries needs every_minutes > 0 and keep >= 1, got "
                             f"every_minutes={every_minutes}, keep={keep}")
        self.directory = os.path.join(absolute(workdir), PARAMS_SERIES)
        self.every_seconds, self._clock = 60.0 * every_minutes, clock
        self._last_time = clock()
        faults.install_log_filters()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=use_async, cleanup_tmp_directories=True,
            # orbax names its multi-host barriers by step: without a prefix of its own, saving
            # a step that `Checkpointer` saves too joins the same barrier twice and times out.
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=PARAMS_SERIES))
        self._manager = ocp.CheckpointManager(self.directory, item_names=("params",),
                                              options=options)

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def maybe_save(self, step: int, params: Any) -> bool:
        """Saves `params` as step `step` if `every_minutes` have passed since the last save."""
        due = self._clock() - self._last_time >= self.every_seconds
        if jax.process_count() > 1:
            due = bool(multihost_utils.broadcast_one_to_all(np.array(due)))
        if due:
            self.save(step, params)
        return due

    def save(self, step: int, params: Any) -> None:
        """Starts an async params-only save of step `step` (a step already saved is skipped)."""
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                           force=True)
        self._last_time = self._clock()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _as_numpy(metadata: Any) -> Any:
    return jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)


def _restore_params(workdir: str, source: str, step: int) -> dict:
    """The params of `<workdir>/<source>/<step>` as a host numpy tree (nothing else is read). One
    that does not read back (a damaged or missing file) is a one-line ValueError naming it."""
    faults.quiet_failed_restores(os.path.join(workdir, source))
    try:
        return _read_params(workdir, source, step)
    except Exception as error:  # any failure to read it back: a damaged checkpoint
        why = one_line(error, 400).split(" [tensorstore_spec=")[0]
        raise ValueError(f"{os.path.join(workdir, source, str(step))} does not restore ({why}):"
                         f" restore it from a copy, or load another step (--step; {source}/ "
                         f"holds {list_steps(os.path.join(workdir, source))})") from None


def _read_params(workdir: str, source: str, step: int) -> dict:
    item = "state" if source == CHECKPOINTS else "params"
    handlers = {item: ocp.PyTreeCheckpointHandler()}
    if source == CHECKPOINTS:
        handlers["data"] = ocp.JsonCheckpointHandler()  # known, so orbax does not warn; not read
    faults.install_log_filters()
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    with ocp.CheckpointManager(os.path.join(workdir, source), options=options,
                               item_handlers=handlers) as manager:
        metadata = manager.item_metadata(step)[item]
        if item == "state":  # a partial restore: only the params of the train state
            tree = {"params": metadata["params"]}
            args = ocp.args.PyTreeRestore(item=tree, restore_args=_as_numpy(tree),
                                          partial_restore=True)
            return manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]
        args = ocp.args.PyTreeRestore(item=metadata, restore_args=_as_numpy(metadata))
        return manager.restore(step, args=ocp.args.Composite(params=args))["params"]


def _no_checkpoint(workdir: str) -> ValueError:
    return ValueError(f"no checkpoint in {workdir}: neither {CHECKPOINTS}/ nor {PARAMS_SERIES}/ "
                      f"holds a finished step; train first (python train.py --workdir={workdir})")


def _average_source(workdir: str) -> tuple[str, list[int]]:
    """The params series when it holds a step, else the full checkpoints, with its steps."""
    series = list_steps(os.path.join(workdir, PARAMS_SERIES))
    if series:
        return PARAMS_SERIES, series
    steps = list_steps(os.path.join(workdir, CHECKPOINTS))
    if not steps:
        raise _no_checkpoint(workdir)
    return CHECKPOINTS, steps


def _default_name(last: int, steps: list[int]) -> str:
    return f"last{last}_step{steps[-1]}"


def average_checkpoints(workdir: str, *, last: int, name: str | None = None) -> str:
    """Averages the params of the last `last` saved steps into `<workdir>/averaged/<name>/`.

    Reads the params-only series `<workdir>/params/` when it exists (see ParamsSeries), else
    the params of the full checkpoints `<workdir>/checkpoints/`. The mean is taken in float64
    and cast back to each leaf's dtype. The result is an orbax PyTree of the params alone (its
    custom metadata records the source and steps); `name` defaults to `last{N}_step{latest}`.
    Returns the directory written.
    """
    workdir = absolute(workdir)
    if last < 1:
        raise ValueError(f"last={last}: average at least one checkpoint")
    source, steps = _average_source(workdir)
    if len(steps) < last:
        raise ValueError(f"cannot average the last {last} checkpoints: "
                         f"{os.path.join(workdir, source)} holds {len(steps)} (steps "
                         f"{', '.join(map(str, steps))})")
    name = _default_name(last, steps) if name is None else name
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"name={name!r} must be a plain directory name")
    chosen = steps[-last:]
    total = None
    first = None
    dtypes = None
    with progress.bar(last, f"averaging {source}/ steps {chosen[0]}-{chosen[-1]}",
                      unit="checkpoint", show=last > 1) as bar:
        for step in chosen:
            params = _restore_params(workdir, source, step)
            structure = jax.tree.structure(params)
            if first is None:
                first = structure
                dtypes = [leaf.dtype for leaf in jax.tree.leaves(params)]
                total = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
            elif structure != first:
                raise ValueError(f"{source}/{step} has another parameter tree than "
                                 f"{source}/{chosen[0]}: cannot average them")
            else:
                total = jax.tree.map(lambda acc, x: np.add(acc, x, out=acc), total, params)
            bar.update()
    leaves = [(leaf / last).astype(dtype)
              for leaf, dtype in zip(jax.tree.leaves(total), dtypes, strict=True)]
    average = jax.tree.unflatten(first, leaves)
    path = os.path.join(workdir, AVERAGED, name)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(average), force=True,
                          custom_metadata={"source": source, "steps": chosen})
    return path


def load_averaged(path: str) -> dict:
    """The params in an `averaged/<name>` directory as a host numpy tree."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path).item_metadata
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            item=metadata, restore_args=_as_numpy(metadata)))


def params_step(workdir: str, *, step: int | None = None, average: int | None = None) -> int:
    """The training step of the params `load_params` returns for the same arguments: `step`,
    the last step averaged, or the latest step of `checkpoints/` and `params/`."""
    if step is not None:
        return step
    if average is not None:
        return _average_source(workdir)[1][-1]
    steps = list_steps(os.path.join(workdir, CHECKPOINTS))[-1:]
    steps += list_steps(os.path.join(workdir, PARAMS_SERIES))[-1:]
    if not steps:
        raise _no_checkpoint(workdir)
    return max(steps)


def load_params(workdir: str, *, step: int | None = None, average: int | None = None) -> dict:
    """The params of a workdir as a host numpy tree, whatever mesh wrote them.

    `step`: that step of `checkpoints/` (or of the params series `params/`). By default the
    latest step. `average=N`: the average of the last N (`averaged/last{N}_step{latest}`,
    computed by `average_checkpoints` when missing).
    """
    workdir = absolute(workdir)
    if step is not None and average is not None:
        raise ValueError("give step= or average=, not both")
    if average is not None:
        _, steps = _average_source(workdir)
        path = os.path.join(workdir, AVERAGED, _default_name(average, steps))
        if not epath.Path(path).is_dir() or not ocp.utils.is_checkpoint_finalized(path):
            path = average_checkpoints(workdir, last=average)
        return load_averaged(path)
    step = params_step(workdir, step=step)
    checkpoints = list_steps(os.path.join(workdir, CHECKPOINTS))
    series = list_steps(os.path.join(workdir, PARAMS_SERIES))
    if step in checkpoints:
        return _restore_params(workdir, CHECKPOINTS, step)
    if step in series:
        return _restore_params(workdir, PARAMS_SERIES, step)
    raise ValueError(f"step={step} is not saved in {workdir}: {CHECKPOINTS}/ holds "
                     f"{checkpoints or 'nothing'}, {PARAMS_SERIES}/ holds {series or 'nothing'}")
