"""`data.workers`: this process's training batches from Grain worker processes.

With `data.workers=k > 0`, k processes (Grain's `mp_prefetch`, started by spawn) each build the
source from the config and the workdir (the vocabulary and row counts the main process wrote)
and produce every k-th batch of `start, start + 1, ...`. The main process reads them back in
order, each worker one batch ahead. A batch is a pure function of its index, so the batches are
those of `data.workers=0` (the loop calling `train_batch` itself) and a resumed run starts at
its checkpoint's index. A worker's error ends the run as one line naming the worker and batch.
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import signal
from collections.abc import Iterator

import numpy as np

from transformer.data import Batch


class WorkerError(ValueError):
    """A worker process failed to produce a batch."""


class _Batch:
    """Batch `index`'s rows `rows` of the source `cfg` names: picklable, it builds the source
    once in each worker process."""

    def __init__(self, cfg, workdir: str | None, rows: tuple[int, int]):
        self.cfg, self.workdir, self.rows = cfg, workdir, rows
        self._source = None

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def __call__(self, index: int) -> Batch:
        if self._source is None:
            from transformer.data import make_source

            self._source = make_source(self.cfg, self.workdir)
        return self._source.train_batch(int(index), self.rows)


def _start_worker(worker: int, workers: int) -> None:
    """Keeps JAX in a worker (Grain imports it) off the accelerator the trainer holds, and
    leaves SIGTERM (a preemption, often sent to every process) to the main process, which
    saves a checkpoint at its next step and then stops the workers."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def check_workers(workers: int) -> None:
    """`data.workers` is a count of processes, or 0. Else one line."""
    if workers < 0:
        raise ValueError(f"data.workers={workers} must be >= 0 (0: the training loop "
                         f"produces each batch itself)")


def _unlink_dropped_batches() -> None:
    """Unlinks the shared memory of the batches Grain's closed iterator dropped.

    Each of Grain's prefetch threads ends on an exception whose traceback holds the last batch
    it fetched: a reference cycle that only the garbage collector frees. Collected here, the
    batch's arrays queue their unlinking on Grain's deletion thread, which is then waited for.
    Left to the exit, the shared memory stays linked and Python's resource tracker warns.
    """
    from grain.multiprocessing import SharedMemoryArray

    gc.collect()
    # Grain's one deletion thread, started with the workers (private: absent, nothing to wait on)
    deletions = getattr(SharedMemoryArray, "_del_thread_pool", None)
    if deletions is not None:
        deletions.apply(int)  # returns once the deletions queued before it are done


class TrainBatches(Iterator[Batch]):
    """Batches `start`, `start + 1`, ... (`count` of them) of this process's `rows`: from the
    source itself when `workers` is 0, else from `workers` Grain processes, started (and each
    producing its first batch) as soon as this is built. Close it."""

    def __init__(self, source, cfg, workdir: str | None, rows: tuple[int, int], *,
                 start: int, count: int, workers: int):
        check_workers(workers)
        self.workers, self.next_index = workers, start
        self._start, self._iterator, self._first = start, None, None
        if workers == 0:
            self._batches = (source.train_batch(i, rows) for i in itertools.count(start))
            return
        import grain
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain reads its absl flags; train.py parses them
            flags.FLAGS.mark_as_parsed()
        dataset = grain.MapDataset.range(start, start + max(count, 0)).map(
            _Batch(cfg, workdir, rows))
        # no threads inside a worker: the processes are the parallelism (Grain's ReadOptions)
        self._iterator = iter(dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=1),
            worker_init_fn=_start_worker))
        self._batches = self._iterator
        # Grain starts the workers at the first next(): ask for it now, from a thread, so they
        # start up behind the train step's compile (the iterator is used by one thread at a time)
        primer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="data-workers")
        self._first = primer.submit(next, self._iterator)
        primer.shutdown(wait=False)

    def __next__(self) -> Batch:
        index = self.next_index
        try:
            if self._first is not None:
                first, self._first = self._first, None
                batch = first.result()
            else:
                batch = next(self._batches)
        except Exception as error:
            if not self.workers or isinstance(error, StopIteration):
                raise
            line = (str(error).strip().splitlines() or [""])[0]
            raise WorkerError(
                f"data.workers={self.workers}: worker {(index - self._start) % self.workers} "
                f"failed on batch {index}: {type(error).__name__}: {line} (data.workers=0 "
                f"shows its traceback)") from None
        self.next_index += 1
        if self.workers:  # own copies: the shared memory Grain passed them in is freed now
            batch = {key: np.array(value) for key, value in batch.items()}
        return batch

    def close(self) -> None:
        """Stops the worker processes, once the first batch asked for has come, and frees the
        shared memory of the batches they made."""
        if self._first is not None:
            concurrent.futures.wait([self._first])
            self._first = None
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
            self._batches = None
            _unlink_dropped_batches()
