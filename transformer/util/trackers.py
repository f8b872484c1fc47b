"""Experiment trackers besides metrics.jsonl: `metrics.tracker` = "tensorboard" (the default,
written by `training.metrics.MetricWriter` itself), "wandb" (Weights & Biases) or "trackio"
(Hugging Face's local-first tracker). Each gets every numeric figure of every line, keyed
`<split>/<name>` at its step, and the run's config once.

Weights & Biases logs where `WANDB_MODE` says (`offline`: files under `<workdir>/wandb/`, to
`wandb sync` later; its service writes them whole when the process ends); its project is
`WANDB_PROJECT` (default "transformer"). Trackio writes its
SQLite database under `TRACKIO_DIR` (trackio's default `~/.cache/huggingface/trackio`) in project
`TRACKIO_PROJECT` (default "transformer"); `trackio show` serves it. A resumed run continues the
same tracker run: its id follows from the workdir and the time config.json records the run
started, so a new run in the same path gets a new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os

log = logging.getLogger("transformer")

TRACKERS = ("tensorboard", "wandb", "trackio")
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "trackio": "trackio"}
EXTRAS = {"tensorboard": None, "wandb": "wandb", "trackio": "trackio"}  # pyproject's extras


def check_tracker(name: str, *, installed: bool = True) -> str:
    """`name` when it names a tracker (whose package is installed, where `installed`); else
    one line."""
    if name not in TRACKERS:
        raise ValueError(f"metrics.tracker={name!r} is not one of {', '.join(TRACKERS)}")
    if installed and importlib.util.find_spec(PACKAGES[name]) is None:
        raise ValueError(f"metrics.tracker={name!r} needs the {PACKAGES[name]} package: pip "
                         f"install -e '.[{EXTRAS[name]}]', or set metrics.tracker='tensorboard'")
    return name


def run_id(workdir: str, started: str | None) -> str:
    """A tracker run's id: the same for every resume of the run in `workdir` (started at
    `started`, config.json's provenance)."""
    return hashlib.sha256(f"{os.path.abspath(workdir)}|{started}".encode()).hexdigest()[:16]


def numeric(values: dict) -> dict[str, float]:
    """The int and float figures of a line (strings such as "nan" or a BLEU signature are
    left to metrics.jsonl)."""
    return {k: v for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


class Wandb:
    """A Weights & Biases run (resumed where it exists)."""

    def __init__(self, workdir: str, config: dict, identity: str, local_dir: str | None):
        import wandb

        name = os.path.basename(os.path.normpath(workdir))
        if local_dir is not None:
            os.makedirs(local_dir, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "transformer"),
                               name=name, id=identity, resume="allow", dir=local_dir,
                               config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class Trackio:
    """A trackio run (resumed where it exists). Its banners on stdout become one log line."""

    def __init__(self, workdir: str, config: dict, identity: str, local_dir: str | None):
        import trackio
        from trackio import utils

        self.project = os.environ.get("TRACKIO_PROJECT", "transformer")
        self.name = f"{os.path.basename(os.path.normpath(workdir))}-{identity[:8]}"
        with contextlib.redirect_stdout(io.StringIO()):
            self._run = trackio.init(project=self.project, name=self.name, config=config,
                                     resume="allow", embed=False, auto_log_gpu=False,
                                     auto_log_cpu=False)
        log.info("trackio: run %s of project %s in %s (trackio show --project %s)", self.name,
                 self.project, utils.TRACKIO_DIR, self.project)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self._run.finish()


def open_tracker(name: str, workdir: str, config: dict, identity: str,
                 local_dir: str | None):
    """The tracker `name` ("wandb" or "trackio") for the run in `workdir`: `log(step, values)`,
    `close()`. `local_dir` holds its local files where it keeps some (None: its default)."""
    kind = {"wandb": Wandb, "trackio": Trackio}[check_tracker(name)]
    return kind(workdir, config, identity, local_dir)
