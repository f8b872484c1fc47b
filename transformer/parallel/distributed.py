"""Joining the other processes of a multi-host run (one process per host).

TPU pods, SLURM and Open MPI are detected by `jax.distributed.initialize()` itself. Other
clusters (and several processes on one machine, as the tests run) pass the coordinator's address,
the number of processes and this process's index. A single process needs none of it.

Multi-controller JAX is fate-sharing: when a process dies, the survivors are stopped once the
coordination service misses its heartbeats for `distributed.heartbeat_timeout_seconds`, instead
of hanging in a collective. A process that stops on an error tells the others at once
(`FailureNotices`), so they stop too instead of waiting for its heartbeats to end.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

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
    """Calls `jax.distributed.initialize` when this is a multi-process run. Before any device
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


class FailureNotices:
    """Multi-process runs: a process that stops on an error tells the others, which stop too.

    Otherwise they would wait for it in their next collective or barrier until a timeout: it
    still sends heartbeats (it is exiting, not dead), and its exit waits for them in JAX's
    shutdown barrier. A failing process posts `<index><TAB><error>` under one key of the
    coordination service's key-value store. Every process watches that key from a thread and,
    when a peer posted, logs one line naming it and ends (`os._exit`: its main thread may be
    blocked in a collective). The failing process, once it has cleaned up, prints its error as
    train.py would and ends the same way, skipping JAX's shutdown barrier (which would wait for
    the peers that are gone).

    Process 0 hosts the coordination service, and a process whose service vanishes is aborted
    by JAX (SIGABRT, its error line unprinted). So every other process marks its end
    (`STOPPED_KEY/<index>`) just before it exits, and process 0 waits for those marks, at most
    `GRACE_S`, before it exits itself. A mark comes just before its peer's exit, not after it:
    process 0 lingers `LINGER_S` more, so a peer stalled between its mark and its exit (a loaded
    machine) still ends on its own status rather than on JAX's abort.
    """

    KEY = "transformer/failed_process"
    STOPPED_KEY = "transformer/stopped"
    POLL_MS = 1000
    GRACE_S = 10.0
    LINGER_S = 2.0

    def __init__(self, *, one_line_errors: tuple[type[BaseException], ...] = (ValueError,)):
        self._one_line_errors = one_line_errors  # printed as `error: <line>`, others in full
        self._client, self._thread, self._posted = None, None, False
        self._stop = threading.Event()
        if jax.process_count() > 1:
            from jax._src import distributed  # jax.distributed's client: no public handle

            self._client = distributed.global_state.client

    def __enter__(self):
        if self._client is not None:
            self._thread = threading.Thread(target=self._watch, name="failure notices",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind, error, tb):
        if error is not None:
            self.post(error)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.POLL_MS / 1000)
        if error is not None and self._client is not None:
            if isinstance(error, self._one_line_errors):
                print(f"error: {error}", file=sys.stderr, flush=True)
            else:
                traceback.print_exception(error)
                sys.stderr.flush()
            self._exit()

    def post(self, error: BaseException) -> None:
        """Tells the other processes that this one stops on `error` (once)."""
        if self._client is None or self._posted:
            return
        self._posted = True
        first_line = (str(error).strip().splitlines() or [""])[0]
        try:
            self._client.key_value_set(
                self.KEY, f"{jax.process_index()}\t{type(error).__name__}: {first_line}")
        except Exception:  # another process posted first, or the service is gone
            pass

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self._client.blocking_key_value_get(self.KEY, self.POLL_MS)
            except Exception as error:
                if "DEADLINE_EXCEEDED" in str(error):
                    continue
                return  # the coordination service is gone: JAX itself stops this process
            index, _, message = notice.partition("\t")
            if int(index) == jax.process_index():
                return
            log.error("error: process %s failed (%s); stopping process %d too", index, message,
                      jax.process_index())
            for handler in log.handlers:
                handler.flush()
            self._exit()

    def _exit(self) -> None:
        """Ends this process with status 1: process 0, which hosts the coordination service,
        after the others have marked their end (or `GRACE_S`). The others at once, marked."""
        index = jax.process_index()
        try:
            if index != 0:
                self._client.key_value_set(f"{self.STOPPED_KEY}/{index}", "1")
            else:
                deadline = time.monotonic() + self.GRACE_S
                for peer in range(1, jax.process_count()):
                    left_ms = int(1000 * (deadline - time.monotonic()))
                    if left_ms <= 0:
                        break
                    self._client.blocking_key_value_get(f"{self.STOPPED_KEY}/{peer}", left_ms)
                time.sleep(self.LINGER_S)
        except Exception:  # a peer that cannot mark its end (or a service already gone)
            pass
        os._exit(1)
