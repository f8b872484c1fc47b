"""What `checkpoint` installs around orbax: fault injection for tests, and filters for the
noise orbax and tensorstore print about failures that `Checkpointer` already reports in one line.

Fault injection (`TRANSFORMER_FAULT_INJECT=<fault>@<step>`, read when a Checkpointer is created):
`kill@<step>` makes the process SIGKILL itself while saving step <step>, after every file is
written and before the rename that completes it; `enospc@<step>` makes that save fail there with
`OSError(ENOSPC)` instead; `killafter@<step>` SIGKILLs right after the rename (the checkpoint is
complete, the run has not gone on); `error@<step>` makes `train.py` fail with a ValueError just
after update <step> (the training loop asks `step_fault`), as a process of a multi-process run
does that stops on an error while the others go on. `spike@<step>[,<step>...][*<factor>]`
multiplies the loss of those updates by <factor> (default 1e3), and so their gradients, inside
the jitted train step (`train_state.make_train_step`, given `injected_spikes()` by the loop): a
loss spike tied to the step number, so a resumed run spikes the same updates. Several faults
join with `;` (`spike@30,60;kill@45`), at most one of each kind.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import sys

import jax.numpy as jnp
import orbax.checkpoint as ocp

from transformer.checkpoint.layout import absolute

FAULT_ENV = "TRANSFORMER_FAULT_INJECT"
FAULTS = ("kill", "enospc", "killafter", "error", "spike")
SPIKE_FACTOR = 1e3  # what `spike@N` multiplies update N's loss by
_FORMS = ("expected kill@<step> or enospc@<step> (or killafter@<step>, error@<step>, "
          "spike@<step>[,<step>...][*<factor>]; several joined by ';')")


@dataclasses.dataclass(frozen=True)
class Spikes:
    """Injected loss spikes: the updates (1-based, as `state.step` after them) whose loss, and
    so gradient, is multiplied by `factor`."""

    steps: tuple[int, ...]
    factor: float = SPIKE_FACTOR


def _parsed() -> dict[str, tuple[tuple[int, ...], float]]:
    """{fault: (steps, factor)} from `$TRANSFORMER_FAULT_INJECT`; ValueError naming the forms."""
    spec = os.environ.get(FAULT_ENV)
    found: dict[str, tuple[tuple[int, ...], float]] = {}
    for part in (spec or "").split(";") if spec else ():
        fault, _, where = part.strip().partition("@")
        steps, star, factor = where.partition("*")
        numbers = steps.split(",")
        if (fault not in FAULTS or fault in found or not all(n.isdigit() for n in numbers)
                or (fault != "spike" and (len(numbers) > 1 or star))):
            raise ValueError(f"{FAULT_ENV}={spec!r}: {_FORMS}")
        try:
            scale = float(factor) if star else SPIKE_FACTOR
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={spec!r}: {_FORMS}") from None
        found[fault] = (tuple(int(n) for n in numbers), scale)
    if len(set(found) - {"spike"}) > 1:
        raise ValueError(f"{FAULT_ENV}={spec!r}: one of kill, enospc, killafter and error at a "
                         f"time (spike@... may join it)")
    return found


def injected_fault() -> tuple[str, int] | None:
    """(fault, step) of the process-level fault in `$TRANSFORMER_FAULT_INJECT` (kill, enospc,
    killafter or error), None when there is none. A malformed value raises ValueError naming
    the forms it takes."""
    faults = [(fault, steps[0]) for fault, (steps, _) in _parsed().items() if fault != "spike"]
    return faults[0] if faults else None


def injected_spikes() -> Spikes | None:
    """The `spike@...` part of `$TRANSFORMER_FAULT_INJECT`, None when there is none."""
    spike = _parsed().get("spike")
    return Spikes(*spike) if spike else None


def step_fault(step: int) -> None:
    """Raises the injected `error@<step>` after update `step`."""
    if injected_fault() == ("error", step):
        raise ValueError(f"injected fault after step {step} ({FAULT_ENV}=error@{step})")


def fault_injecting_path_class() -> type | None:
    """Orbax's atomic-rename temporary path, failing as `$TRANSFORMER_FAULT_INJECT` says when
    step N's directory is renamed into place (`kill@N`, `enospc@N`: before; `killafter@N`:
    after); None when no such fault is set."""
    injected = injected_fault()
    if injected is None or injected[0] == "error":
        return None
    fault = injected[0]
    step = str(injected[1])

    class FaultInjecting(ocp.path.atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            doomed = self.get_final().name == step
            if doomed and fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if doomed and fault == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))
            await super().finalize(*args, **kwargs)
            if doomed:  # killafter
                os.kill(os.getpid(), signal.SIGKILL)

    return FaultInjecting


_failed_saves: list[OSError] = []  # errors of background saves, as orbax logged them


class _ReraisedSaveErrors(logging.Filter):
    """Drops orbax's tracebacks of a failed background save (Checkpointer raises it as one line)
    and keeps the error for `take_save_failure`."""

    def filter(self, record):
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, OSError) and "save" in record.getMessage().lower():
            _failed_saves.append(error)
            return False
        return True


def take_save_failure() -> OSError | None:
    """The error of a background save that failed in this process since the last call, the
    moment orbax logs it (with several processes, orbax itself only raises it once the others
    pass a barrier that they never reach)."""
    failures = _failed_saves[:]
    _failed_saves.clear()
    return failures[0] if failures else None


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's warning that a manager opened read-only (to read params) is read-only."""

    def filter(self, record):
        return not record.getMessage().startswith("Given directory is read only")


class _DropOrphanedReads(logging.Filter):
    """After a restore under `directory` fails, tensorstore still completes its other reads:
    asyncio logs "Task exception was never retrieved" for each, one traceback per array."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = absolute(directory)  # as the reads name it: a path, or gs://...

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Task exception was never retrieved")
                    and self.directory in message)


def _add_once(logger: logging.Logger, new: logging.Filter, same) -> None:
    if not any(same(existing) for existing in logger.filters):
        logger.addFilter(new)


def install_log_filters() -> None:
    """Orbax's save-failure tracebacks and read-only notices off the absl log (idempotent)."""
    absl = logging.getLogger("absl")
    for kind in (_ReraisedSaveErrors, _ReadOnlyNotice):
        _add_once(absl, kind(), lambda f, kind=kind: isinstance(f, kind))


def _drop_closed_loop_callbacks(unraisable, previous=sys.unraisablehook) -> None:
    """The same reads' results posted to orbax's event loop, closed by then: one `Event loop is
    closed` traceback per array, carrying no news."""
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        previous(unraisable)


def quiet_failed_restores(directory: str) -> None:
    """Silences the stray reads of a restore from `directory` that fails (install before the
    first attempt: their callbacks can fire before the failure is raised)."""
    sys.unraisablehook = _drop_closed_loop_callbacks
    _add_once(logging.getLogger("asyncio"), _DropOrphanedReads(directory),
              lambda f: isinstance(f, _DropOrphanedReads)
              and f.directory == absolute(directory))


def spike_factor(injected: Spikes | None, step):
    """The factor on update `step`'s loss (traced): `injected.factor` on its spiked updates,
    1 on the others, so a resumed run spikes the same updates. None when nothing is injected."""
    if injected is None:
        return None
    return jnp.where(jnp.isin(step, jnp.asarray(injected.steps)), jnp.float32(injected.factor),
                     jnp.float32(1.0))
