"""Two tiers of checkpoints: the persistent one (`<workdir>/checkpoints`) and, when
`checkpoint_local_dir` is set, a frequent local one on host disk or a RAM disk, saved every
`checkpoint_local_every_steps` and keeping the last `keep_local_checkpoints`
(docs/reliability.md, "Two tiers of checkpoints").

The local tier is a second `Checkpointer` (an orbax CheckpointManager) on its own directory, with
the same checksums and the same handling of a damaged step (moved to `<local dir>/skipped/`).
Restore takes the newest step that restores across both tiers; a local tier that is gone (a
wiped directory, a new host) or damaged falls back to the persistent tier. With several
processes every process tries the same steps (the local ones that every process holds) and all
restore the same one (a step that one process cannot read is skipped by all). Orbax's
emergency checkpoint managers are not used: why is in docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer.checkpoint.checkpointer import Checkpointer, one_line
from transformer.checkpoint.layout import CHECKPOINTS, absolute, is_remote

SKIPPED = "skipped"  # <local dir>/skipped/<step>: damaged local steps, moved aside
MAX_AGREED_STEPS = 64  # local steps compared across processes on restore (the newest)
DEFAULT_KEEP_LOCAL = 2
log = logging.getLogger("transformer")


def check_settings(cfg, workdir: str) -> None:
    """The local tier's settings, one line each, before any training work: the directory must
    be writable and outside the workdir's checkpoints, the interval smaller than the persistent
    one. Creates the directory."""
    local = str(cfg.get("checkpoint_local_dir") or "")
    every = int(cfg.get("checkpoint_local_every_steps") or 0)
    keep = int(cfg.get("keep_local_checkpoints", DEFAULT_KEEP_LOCAL))
    if not local:
        return
    if every < 1:
        raise ValueError(f"checkpoint_local_every_steps={every} must be >= 1 when "
                         f"checkpoint_local_dir is set (or set checkpoint_local_dir='')")
    if keep < 1:
        raise ValueError(f"keep_local_checkpoints={keep} must be >= 1")
    persistent = int(cfg.checkpoint_every_steps)
    if persistent and every >= persistent:
        raise ValueError(f"checkpoint_local_every_steps={every} must be smaller than "
                         f"checkpoint_every_steps={persistent}: the local tier is the frequent "
                         f"one (or set checkpoint_local_dir='' to turn it off)")
    if is_remote(local):
        raise ValueError(f"checkpoint_local_dir={local} is a URL: give a directory on this "
                         f"host's disk or a RAM disk (the persistent tier is the workdir)")
    checkpoints = os.path.join(absolute(workdir), CHECKPOINTS)
    here = os.path.realpath(local)
    if not is_remote(workdir) and (here + os.sep).startswith(os.path.realpath(checkpoints)
                                                             + os.sep):
        raise ValueError(f"checkpoint_local_dir={local} is inside the workdir's {checkpoints}: "
                         f"give a directory of its own (e.g. /dev/shm/<run>)")
    try:
        os.makedirs(local, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=local, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ValueError(f"checkpoint_local_dir={local} is not writable ({one_line(error)}): "
                         f"give a writable directory on host disk or a RAM disk, or '' to "
                         f"turn the local tier off") from None


class TwoTiers:
    """The persistent Checkpointer and, optionally, the local one, as one checkpointer."""

    def __init__(self, workdir: str, *, keep: int, local_dir: str = "", local_every: int = 0,
                 keep_local: int = DEFAULT_KEEP_LOCAL, use_async: bool = True):
        self.persistent = Checkpointer(workdir, keep=keep, use_async=use_async)
        self.directory = self.persistent.directory  # the restored step's tier, after a restore
        self.local_every = int(local_every) if local_dir else 0
        self.local = None
        if local_dir:
            directory = os.path.abspath(local_dir)
            self.local = Checkpointer(workdir, keep=keep_local, use_async=use_async,
                                      directory=directory,
                                      skipped=os.path.join(directory, SKIPPED))

    @classmethod
    def for_run(cls, cfg, workdir: str) -> TwoTiers:
        """The checkpointer of a training run's settings (check them with `check_settings`)."""
        return cls(workdir, keep=int(cfg.keep_checkpoints),
                   local_dir=str(cfg.get("checkpoint_local_dir") or ""),
                   local_every=int(cfg.get("checkpoint_local_every_steps") or 0),
                   keep_local=int(cfg.get("keep_local_checkpoints", DEFAULT_KEEP_LOCAL)))

    def local_due(self, step: int) -> bool:
        """Whether the local tier saves after step `step`."""
        return bool(self.local_every) and step % self.local_every == 0

    def _tier(self, step: int) -> Checkpointer:
        """The tier holding `step`, the persistent one first."""
        if self.local is not None and step not in self.persistent.all_steps() \
                and step in self.local.all_steps():
            return self.local
        return self.persistent

    def latest_step(self) -> int | None:
        """The newest step in either tier (this process's view)."""
        steps = self.persistent.all_steps() + (self.local.all_steps() if self.local else [])
        return max(steps, default=None)

    def all_steps(self) -> list[int]:
        return sorted(set(self.persistent.all_steps()
                          + (self.local.all_steps() if self.local else [])))

    def shape_problem(self, step: int, abstract_state: Any) -> str | None:
        return self._tier(step).shape_problem(step, abstract_state)

    def save(self, step: int, state: Any, data_state: dict, *, persistent: bool = True) -> None:
        """Saves `step` to the persistent tier, or (`persistent=False`) to the local one. One
        save is in flight at a time: the other tier's is waited for first."""
        tier, other = ((self.persistent, self.local) if persistent or self.local is None
                       else (self.local, self.persistent))
        if other is not None:
            other.wait()
        tier.save(step, state, data_state)

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """(step, state, data state) of the newest step that restores in either tier; None
        when neither holds one. A damaged step is moved aside in its tier, as the persistent
        tier does, and the next newest is tried; when none restores, one line lists each."""
        while True:
            newest = self.persistent.latest_step()
            local = [s for s in self._agreed_local_steps() if newest is None or s > newest]
            if local:
                restored = self.local.restore_latest(abstract_state, local, last_resort=False)
                if restored is not None:
                    log.info("restoring step %d from the local tier %s (the persistent tier's "
                             "newest: %s)", restored[0], self.local.directory, newest)
                    self.directory = self.local.directory
                    return restored
                continue  # they were moved aside: the persistent tier may be newest now
            if newest is None:
                break
            restored = self.persistent.restore_latest(abstract_state, [newest],
                                                      last_resort=False)
            if restored is not None:
                return restored
        skipped = sorted(self.persistent.skipped + [f"local {line}" for line in (
            self.local.skipped if self.local else [])],
            key=lambda line: -int(line.removeprefix("local ").split()[0]))
        if skipped:
            where = self.persistent.directory + (f" or {self.local.directory}"
                                                 if self.local else "")
            raise ValueError(f"no checkpoint in {where} restores: {'; '.join(skipped)}; they "
                             f"were moved aside (skipped_checkpoints/, {SKIPPED}/); start "
                             f"afresh with a new --workdir")
        return None

    def _agreed_local_steps(self) -> list[int]:
        """The local steps (the newest MAX_AGREED_STEPS) that every process holds: a process
        whose local tier is gone makes the others fall back with it (orbax's restore ends in a
        barrier that a process without the step would never reach)."""
        steps = sorted(self.local.all_steps(), reverse=True)[:MAX_AGREED_STEPS] \
            if self.local is not None else []
        if jax.process_count() == 1:
            return steps
        padded = np.full(MAX_AGREED_STEPS, -1, np.int64)
        padded[:len(steps)] = steps
        gathered = np.asarray(multihost_utils.process_allgather(padded))
        held = [{int(s) for s in row if s >= 0} for row in gathered.reshape(-1, MAX_AGREED_STEPS)]
        return sorted(set.intersection(*held), reverse=True)

    def wait(self) -> None:
        self.persistent.wait()
        if self.local is not None:
            self.local.wait()

    def close(self) -> None:
        """Closes both tiers (a failed save raises CheckpointSaveError), the persistent last."""
        try:
            if self.local is not None:
                self.local.close()
        finally:
            self.persistent.close()


def remove_local_tier(directory: str) -> None:
    """Deletes a local tier's steps (as a lost host does): for tests and the soak."""
    path = epath.Path(directory)
    if path.exists():
        path.rmtree()
