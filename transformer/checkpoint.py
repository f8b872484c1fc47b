"""Checkpoints: orbax wiring, and the conversion between scanned and per-layer parameters.

Layout (DESIGN.md): `<workdir>/checkpoints/<step>/` is an orbax Composite with item "state"
(params, opt_state, step) and item "data" (the input iterator: the next global batch index).
Restoring into abstract arrays that carry new shardings moves a checkpoint onto another mesh or
device count.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

_LAYER = re.compile(r"^layers_(\d+)$")


class Checkpointer:
    """Async saves of (state, data) under `<workdir>/checkpoints`, keeping the last `keep`."""

    def __init__(self, workdir: str, *, keep: int, use_async: bool = True):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=use_async,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, item_names=("state", "data"),
                                              options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Starts an async save of step `step` (waits for the previous save first)."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, placed as `abstract_state`'s shardings, and the data state."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
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
    out, layers = {}, {}
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
