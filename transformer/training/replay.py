"""Replaying a training step: "was it the data or the machine?".

`replay(workdir, step)` restores the newest checkpoint M before step N, runs steps M+1..N with
the batches and dropout keys the run had (the batch of a step is a pure function of its index,
which the checkpoint records; the dropout key folds in the step: `train_state.make_train_step`)
and returns the loss of each replayed step beside the one `metrics.jsonl` logged. On the mesh
the run trained on, the losses are equal bit for bit: a difference there points at the machine,
the same loss at the data (`batch_examples` lists batch N's examples).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import jax
import numpy as np
from ml_collections import ConfigDict

from transformer.checkpoint import layout
from transformer.checkpoint.checkpointer import Checkpointer, list_steps
from transformer.config import resolve
from transformer.data import listing, make_source
from transformer.data.workers import TrainBatches
from transformer.parallel import sharding
from transformer.training import train_state


@dataclasses.dataclass(frozen=True)
class Replayed:
    """What a replay found."""

    step: int  # the step replayed (N)
    restored: int  # the checkpoint it started from (M < N)
    batch_index: int  # the global batch index of step N
    losses: dict[int, float]  # replayed loss of steps M+1..N (float32 values)
    logged: dict[int, float | str]  # metrics.jsonl's train loss of those steps that have one
    examples: list[listing.Example]  # batch N's examples
    mesh: dict[str, int]  # the mesh replayed on
    run_mesh: dict[str, int] | None  # the mesh the run trained on (config.json's provenance)

    @property
    def loss(self) -> float:
        return self.losses[self.step]

    def equal(self, step: int) -> bool | None:
        """Whether step `step`'s replayed loss equals the logged one bit for bit (NaN equal to
        NaN); None when it was not logged."""
        if step not in self.logged:
            return None
        logged, replayed = self.logged[step], self.losses[step]
        if isinstance(logged, str):  # non-finite values are logged as "nan", "inf"
            return not math.isfinite(replayed) and str(replayed) == logged
        return np.float32(logged).tobytes() == np.float32(replayed).tobytes()


def logged_losses(workdir: str) -> dict[int, float | str]:
    """The train loss metrics.jsonl holds per step (the last line of a step: a resumed run
    logs again the steps after its checkpoint). Empty without the file."""
    path = layout.path(workdir, layout.METRICS)
    losses = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a kill
                    continue
                if record.get("split") == "train" and "loss" in record:
                    losses[int(record["step"])] = record["loss"]
    except FileNotFoundError:
        pass
    return losses


def check_step(workdir: str, step: int) -> int:
    """The checkpoint to replay step `step` from: the newest before it. One line when the
    workdir holds no run, the step is beyond the run's last step or no checkpoint precedes it."""
    values = layout.read_run_config(workdir)  # one line: not a run's workdir
    checkpoints = list_steps(layout.path(workdir, layout.CHECKPOINTS))
    logged = logged_losses(workdir)
    last = max([*checkpoints, *logged], default=0)
    if step < 1:
        raise ValueError(f"--step={step}: steps count from 1 (the first update)")
    if step > last:
        planned = values.get("num_train_steps")
        raise ValueError(f"--step={step} is beyond the last step of the run in {workdir} "
                         f"({last}, of num_train_steps={planned}): give a step it trained")
    before = [s for s in checkpoints if s < step]
    if not before:
        first = f"its first is step {checkpoints[0]}" if checkpoints else "it has none"
        raise ValueError(f"--step={step}: no checkpoint of the run in {workdir} precedes it "
                         f"({first}); replay a later step")
    return before[-1]


def replay(workdir: str, step: int, *,
           adjust: Callable[[train_state.TrainState], train_state.TrainState] | None = None
           ) -> Replayed:
    """Replays step `step` of the run in `workdir` from the newest checkpoint before it, on a
    mesh of this process's devices shaped as the run's config says. `adjust` changes the
    restored state first (what-if: a perturbed parameter must change the loss)."""
    start = check_step(workdir, step)
    values = layout.read_run_config(workdir)
    provenance = values.pop("provenance", {})
    values.pop("metrics", None)  # a replay logs nothing: its tracker's package is not needed
    run = resolve(ConfigDict(values), jax.device_count())
    cfg = run.config
    source = make_source(cfg, workdir)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train_state.build_trainer(run, mesh)
    checkpointer = Checkpointer(workdir, keep=int(cfg.keep_checkpoints), use_async=False)
    try:
        state, data_state = checkpointer.restore(start, trainer.abstract_state)
    finally:
        checkpointer.close()
    if adjust is not None:
        state = adjust(state)
    first = int(data_state["next_batch_index"])
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    batches = TrainBatches(source, cfg, workdir, rows, start=first, count=step - start,
                           workers=0)  # the same batches as the run's data.workers gave
    train_step = train_state.make_train_step(trainer, cfg)
    losses = {}
    for s in range(start + 1, step + 1):
        state, metrics = train_step(state, train_state.global_batch(mesh, next(batches)))
        losses[s] = float(jax.device_get(metrics["loss"]))
    batches.close()
    index = first + step - start - 1
    logged = logged_losses(workdir)
    return Replayed(step, start, index, losses,
                    {s: logged[s] for s in losses if s in logged},
                    listing.batch_examples(source, index), dict(mesh.shape),
                    provenance.get("mesh_shape"))
