"""Joining the other processes of a multi-host run (one process per host).

TPU pods, SLURM and Open MPI are detected by `jax.distributed.initialize()` itself; other
clusters (and several processes on one machine, as the tests run) pass the coordinator's address,
the number of processes and this process's index. A single process needs none of it.

Multi-controller JAX is fate-sharing: when a process dies, the survivors are stopped once the
coordination service misses its heartbeats for `distributed.heartbeat_timeout_seconds`, instead
of hanging in a collective.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("transformer")


def cluster_detected() -> bool:
    """True where jax.distributed can find its peers on its own: a TPU pod slice with several
    workers, a SLURM job step or an Open MPI run with several tasks."""
    env = os.environ
    return (len(env.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1
            or int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))) > 1
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)


def initialize(dist_cfg, *, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None) -> None:
    """Calls `jax.distributed.initialize` when this is a multi-process run; before any device
    use. `dist_cfg` holds `initialization_timeout_seconds` and `heartbeat_timeout_seconds`."""
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise ValueError("--coordinator_address, --num_processes and --process_id go together; "
                         "pass all three (or none on a TPU pod, under SLURM or Open MPI)")
    if coordinator_address is None and not cluster_detected():
        return
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process_id={process_id} must be in [0, {num_processes})")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(dist_cfg.initialization_timeout_seconds),
        heartbeat_timeout_seconds=int(dist_cfg.heartbeat_timeout_seconds))
    log.info("process %d of %d joined; %d local of %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
