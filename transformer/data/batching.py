"""Packing variable-length pairs into fixed [rows, length] batches under a token budget.

Pure numpy and Python. No TensorFlow. The scheme (one epoch):

1. `order` is a permutation of the eligible example indices, seeded by (seed, epoch).
2. `plan_epoch` walks `order` once and cuts it into consecutive runs, one run per global batch:
   a run is the longest prefix of what is left whose examples all find room, first-fit, in the
   batch's `rows` packed rows of `length` tokens (source and target side each), and whose
   non-pad source and target tokens each stay within `budget`. Only the cut points are kept
   (`starts`), so every example lands in exactly one batch of the epoch and no batch exceeds
   the budget.
3. `first_fit` places a run's examples into rows: row, and offsets on both sides. It is the same
   online rule that cut the run, so the placement follows from the run alone. A process
   computes it for the whole batch and materialises only its own rows (`pack`).

A packed row holds several pairs: tokens in `inputs`/`targets`, the pair's number (1, 2, ...)
in `*_segmentation` (0 = padding), positions restarting at 0 per pair in `*_positions`.
"""

from __future__ import annotations

import numpy as np

KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation",
        "inputs_positions", "targets_positions")


def epoch_positions(index: int, count: int, batch_size: int, seed: int) -> np.ndarray:
    """Positions of global batch `index`'s `batch_size` examples among `count`: epoch e is a
    permutation of them seeded by (seed, e), cut into runs of `batch_size`."""
    if index < 0:
        raise ValueError(f"batch index {index} < 0")
    epoch, b = divmod(index, count // batch_size)
    order = np.random.default_rng([seed, epoch]).permutation(count)
    return order[b * batch_size:(b + 1) * batch_size]


def _sides(length: int | tuple[int, int]) -> tuple[int, int]:
    """A row's (source, target) length: one `length` for both sides, or a pair."""
    return (length, length) if isinstance(length, int) else tuple(length)


def plan_epoch(source_lengths: np.ndarray, target_lengths: np.ndarray, order: np.ndarray,
               rows: int, length: int | tuple[int, int], budget: int = 0) -> np.ndarray:
    """Cut points of `order` into batches: batch b is order[starts[b]:starts[b + 1]].

    `source_lengths`/`target_lengths` are indexed by example. Every example must fit one row
    (`length`, or a (source, target) pair) and, with a budget (> 0), `budget` >= `length`."""
    src_length, tgt_length = _sides(length)
    src = source_lengths[order].tolist()
    tgt = target_lengths[order].tolist()
    starts = [0]
    src_used = [0] * rows
    tgt_used = [0] * rows
    first_open = 0
    src_total = 0
    tgt_total = 0
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        row = _find_row(src_used, tgt_used, first_open, s, t, length)
        if row < 0 or (budget and (src_total + s > budget or tgt_total + t > budget)):
            starts.append(i)
            src_used = [0] * rows
            tgt_used = [0] * rows
            first_open = 0
            src_total = 0
            tgt_total = 0
            row = 0
        src_used[row] += s
        tgt_used[row] += t
        src_total += s
        tgt_total += t
        while first_open < rows and (src_used[first_open] >= src_length
                                     or tgt_used[first_open] >= tgt_length):
            first_open += 1
    if len(src):
        starts.append(len(src))
    return np.asarray(starts, np.int64)


def _find_row(src_used, tgt_used, first_open, s, t, length) -> int:
    src_length, tgt_length = _sides(length)
    src_room = src_length - s
    tgt_room = tgt_length - t
    for row in range(first_open, len(src_used)):
        if src_used[row] <= src_room and tgt_used[row] <= tgt_room:
            return row
    return -1


def first_fit(source_lengths, target_lengths, rows: int, length: int | tuple[int, int], *,
              drop: bool = False):
    """(row, source offset, target offset) of each example in turn, first-fit into `rows` rows.
    An example that finds no room raises ValueError (the plan guarantees they fit) or, with
    `drop`, is placed nowhere: None."""
    src_used = [0] * rows
    tgt_used = [0] * rows
    placement = []
    for s, t in zip(np.asarray(source_lengths).tolist(), np.asarray(target_lengths).tolist(),
                    strict=True):
        row = _find_row(src_used, tgt_used, 0, s, t, length)
        if row < 0 and drop:
            placement.append(None)
            continue
        if row < 0:
            raise ValueError(f"an example of lengths ({s}, {t}) does not fit the batch")
        placement.append((row, src_used[row], tgt_used[row]))
        src_used[row] += s
        tgt_used[row] += t
    return placement


def empty_batch(rows: int, source_length: int, target_length: int) -> dict[str, np.ndarray]:
    shape = {"inputs": source_length, "targets": target_length}
    return {k: np.zeros((rows, shape[k.split("_")[0]]), np.int32) for k in KEYS}


def pack(pieces, placement, row_range: tuple[int, int], source_length: int,
         target_length: int) -> dict[str, np.ndarray]:
    """Rows [start, stop) of a packed batch. `pieces[i]` is example i's (source ids, target ids)
    (EOS included) or None when it lands outside the range; `placement` is `first_fit`'s
    (None: dropped)."""
    start, stop = row_range
    batch = empty_batch(stop - start, source_length, target_length)
    segment = {}
    for piece, place in zip(pieces, placement, strict=True):
        if place is None or not start <= place[0] < stop:
            continue
        row, src_off, tgt_off = place
        r = row - start
        segment[r] = seg = segment.get(r, 0) + 1
        for side, ids, off in (("inputs", piece[0], src_off), ("targets", piece[1], tgt_off)):
            n = len(ids)
            batch[side][r, off:off + n] = ids
            batch[f"{side}_segmentation"][r, off:off + n] = seg
            batch[f"{side}_positions"][r, off:off + n] = np.arange(n, dtype=np.int32)
    return batch


class EpochPlans:
    """Global batch index -> (epoch, run of example indices), for an endless sequence of epochs.

    Epoch e's order is a permutation of `eligible` seeded by (seed, e). Its plan is computed on
    first use and its batch count kept, so any index maps to its examples by a pure function of
    (seed, index)."""

    def __init__(self, source_lengths, target_lengths, eligible: np.ndarray, *, seed: int,
                 rows: int, length: int, budget: int = 0, keep: int = 2):
        if not len(eligible):
            raise ValueError("no training example fits data.max_length")
        self.source_lengths = np.asarray(source_lengths)
        self.target_lengths = np.asarray(target_lengths)
        self.eligible = np.asarray(eligible, np.int64)
        self.seed, self.rows, self.length, self.budget = seed, rows, length, budget
        self._counts: list[int] = []  # batches in epochs 0, 1, ...
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._keep = keep

    def order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        return self.eligible[rng.permutation(len(self.eligible))]

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, starts) of an epoch."""
        if epoch not in self._cache:
            order = self.order(epoch)
            starts = plan_epoch(self.source_lengths, self.target_lengths, order, self.rows,
                                self.length, self.budget)
            if len(self._cache) >= self._keep:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = (order, starts)
            if epoch == len(self._counts):
                self._counts.append(len(starts) - 1)
        return self._cache[epoch]

    def batches_in_epoch(self, epoch: int) -> int:
        while len(self._counts) <= epoch:
            self.epoch(len(self._counts))
        return self._counts[epoch]

    def locate(self, index: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global batch `index`."""
        if index < 0:
            raise ValueError(f"batch index {index} < 0")
        epoch = 0
        while index >= self.batches_in_epoch(epoch):
            index -= self.batches_in_epoch(epoch)
            epoch += 1
        return epoch, index

    def examples(self, index: int) -> np.ndarray:
        """The example indices of global batch `index`, in placement order."""
        epoch, b = self.locate(index)
        order, starts = self.epoch(epoch)
        return order[starts[b]:starts[b + 1]]
