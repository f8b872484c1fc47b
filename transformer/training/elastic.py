"""Elastic restart: a resumed run fitted to the devices it has now (`elastic=True`).

A run resumed on fewer (or more) devices than its workdir's config.json records keeps the
recorded global batch (`data.batch_size`, rows per update) and the recorded rows per device
per microbatch (what bounds activation memory): `fit` keeps the config's mesh where it fits
the devices, else shrinks (or grows) the recorded `mesh.data` x `mesh.fsdp` to the devices
that the model axes (`mesh.context`, `tensor`, `expert`) leave, and sets `grad_accum_steps` to
the fewest microbatches that keep each device's rows within the recorded ones. The examples of
each update are the same (the data order is a function of the global batch index), so the
losses are an uninterrupted run's up to the order of the sums (docs/reliability.md).
"""

from __future__ import annotations

import logging
import math

from ml_collections import ConfigDict

from transformer.checkpoint import layout
from transformer.parallel import sharding

log = logging.getLogger("transformer")
FITTED_AXES = ("data", "fsdp")  # the axes elastic resizes; the model axes stay as recorded


def fit(cfg: ConfigDict, workdir: str, num_devices: int) -> ConfigDict:
    """`cfg` for `num_devices` devices, where `cfg.elastic` is set and `workdir` holds a run's
    config.json (else `cfg` unchanged). Logs one line when the mesh or the accumulation
    changes; a device count or batch that cannot be fitted is one line (ValueError)."""
    if not cfg.get("elastic", False):
        return cfg
    recorded = layout.read_config_file(workdir)
    if recorded is None or "mesh_shape" not in recorded.get("provenance", {}):
        return cfg  # a fresh run: its config's mesh as given
    was = {k: int(v) for k, v in recorded["provenance"]["mesh_shape"].items()}
    was_accum = int(recorded["grad_accum_steps"])
    was_devices = math.prod(was.values())
    batch = int(cfg.data.batch_size)
    shape = _fitted_mesh(cfg.mesh, was, num_devices)
    shards = sharding.batch_shards(shape)
    was_rows = int(recorded["data"]["batch_size"]) // (was_accum * sharding.batch_shards(was))
    if batch % shards:
        raise ValueError(f"elastic: data.batch_size={batch} does not split over mesh.data x "
                         f"mesh.fsdp x mesh.expert={shards} on the {num_devices} devices left; "
                         f"resume on a device count whose data-parallel size divides it")
    per_device = batch // shards
    accum = next(a for a in range(1, per_device + 1)
                 if per_device % a == 0 and per_device // a <= was_rows)
    fitted = cfg.copy_and_resolve_references()
    with fitted.unlocked():
        for axis, size in shape.items():
            fitted.mesh[axis] = size
        fitted.grad_accum_steps = accum
    changed = [f"mesh.{axis} {was[axis]} -> {shape[axis]}" for axis in FITTED_AXES
               if was.get(axis) != shape[axis]]
    if accum != was_accum:
        changed.append(f"grad_accum_steps {was_accum} -> {accum}")
    if changed:
        log.info("elastic: %d devices (recorded: %d): %s; %d rows per update as recorded, %d "
                 "per device per microbatch", num_devices, was_devices, ", ".join(changed),
                 batch, per_device // accum)
    return fitted


def _fitted_mesh(mesh_cfg, was: dict[str, int], num_devices: int) -> dict[str, int]:
    """The config's mesh on `num_devices` where it fits; else the recorded model axes with
    data x fsdp taking the devices they leave (fsdp the largest divisor of the recorded fsdp
    that divides them, so that it still divides the parameters it shards)."""
    try:
        return sharding.mesh_shape(mesh_cfg, num_devices)
    except ValueError:
        pass
    kept = {axis: size for axis, size in was.items() if axis not in FITTED_AXES}
    model_devices = math.prod(kept.values())
    if num_devices % model_devices:
        sizes = ", ".join(f"mesh.{axis}={size}" for axis, size in kept.items() if size > 1)
        raise ValueError(f"elastic: {num_devices} devices cannot hold the recorded "
                         f"{sizes or 'mesh'} (a multiple of {model_devices} devices is needed); "
                         f"resume on such a count or set those axes to divide {num_devices}")
    batch_devices = num_devices // model_devices
    fsdp = math.gcd(was.get("fsdp", 1), batch_devices)
    return {"data": batch_devices // fsdp, "fsdp": fsdp} | kept
