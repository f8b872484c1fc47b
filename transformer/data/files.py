"""Documents from the user's own files, by global id, and each epoch's training order.

`data.dataset` names the files (`file_specs.py`: `<format>:<glob>`, a glob whose extension
names the format, or a hub-layout directory), and `file_formats.py` reads a shard of each
format. Each shard is read whole when a batch needs it, never the corpus.

Document ids are global: shard k's rows follow those of shards 0..k-1, the shards in sorted
path order. The training order of epoch e (`FileDocuments.order`) shuffles without
materialising anything per document. It is a seeded permutation of the shards, cut into
windows of `data.shuffle_window` shards, and within each window a seeded pseudo-random
permutation of its rows (`permutation.Permutation`). So a batch reads from at most a window's
shards, and a host holds at most that many shards decoded. With `groups` G > 1, a language
model's `data.pack_groups`, the corpus is G streams: group g owns the shards k with
k % G == g and has its own order of the same kind over them, in windows of
max(1, shuffle_window // G) shards. A process that packs only some groups' rows opens only
those groups' shards.

Rows per shard come from parquet's metadata or ArrayRecord's index, else from a read of the
shard. With `record_dir`, a run's `<workdir>/vocab/`, the counts are recorded there and reused
while the shards are unchanged.
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np

from transformer.data import records
from transformer.data.file_formats import ShardReader
from transformer.data.file_specs import BadData, expand, parse_spec
from transformer.data.permutation import Permutation

log = logging.getLogger("transformer")
CACHED_SHARDS = 2  # decoded shards kept per process when data.shuffle_window is smaller
SAMPLE_SHARDS = 32  # shards a sample (vocabulary, mean length) reads at most, whatever the corpus


class FileDocuments:
    """Documents by global id from a glob of shards, and each epoch's training order."""

    reader_class = ShardReader  # reads one shard (chat.ChatReader: conversations)

    def __init__(self, spec: str, *, fields: tuple[str, ...] = ("text",), seed: int = 0,
                 shuffle_window: int = 8, skip_bad_lines: bool = False,
                 setting: str = "data.dataset", label_field: str | None = None,
                 record_dir: str | None = None, groups: int = 1):
        parsed = parse_spec(spec, setting)
        if parsed is None:
            raise BadData(f"{setting}={spec!r} names no files; write <format>:<glob>")
        self.format, self.pattern = parsed
        self.fields, self.seed = tuple(fields), int(seed)
        if int(shuffle_window) < 1:
            raise BadData(f"data.shuffle_window={shuffle_window} must be >= 1")
        self.groups = int(groups)
        self.window = int(shuffle_window) if self.groups == 1 else max(
            1, int(shuffle_window) // self.groups)  # shards per window of one group
        self.paths = expand(self.pattern, setting)
        if self.groups > len(self.paths):
            raise BadData(f"data.pack_groups={self.groups} exceeds the {len(self.paths)} "
                          f"shard(s) of {setting}={spec!r}: each group reads its own shards; "
                          f"lower data.pack_groups or split the corpus into more shards")
        self._reader = self.reader_class(self.format, self.fields, skip_bad_lines, label_field)
        self._cache: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counts = self._counts(record_dir)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.name = f"{self.format}:{self.pattern}"
        sizes = [self.group_size(g) for g in range(self.groups)]
        if max(sizes) > 1.1 * min(sizes):
            log.warning("%s: data.pack_groups=%d gives groups of %d to %d documents; each group "
                        "draws the same share of an update, so the smaller ones repeat their "
                        "documents sooner: choose a G dividing the %d shards of equal size",
                        self.name, self.groups, min(sizes), max(sizes), len(self.paths))
        if self._reader.skipped:
            log.warning("%s: skipped %d malformed lines", self.name, self._reader.skipped)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def skipped_lines(self) -> int:
        return self._reader.skipped

    def _counts(self, record_dir: str | None) -> np.ndarray:
        """Rows of every shard. With `record_dir` (a run's `<workdir>/vocab/`), the record of
        an earlier count there is used while the shards' paths, sizes and modification times
        are unchanged: the processes that follow process 0, and a resumed run, read no shard
        to count."""
        if record_dir is None:
            return np.array([self._count(k) for k in range(len(self.paths))], np.int64)
        import fsspec

        fs = fsspec.core.url_to_fs(self.paths[0])[0]
        stamps = []
        for path in self.paths:
            info = fs.info(path)
            stamps.append([info.get("size"), str(info.get("mtime") or info.get("updated")
                                                 or info.get("LastModified") or "")])
        reader = self._reader
        record = records.Record(record_dir, "rows", [
            self.format, self.pattern, self.fields, reader.skip_bad_lines, reader.label_field])
        kept = record.read()
        if kept and kept["paths"] == self.paths and kept["stamps"] == stamps:
            reader.skipped = kept["skipped"]
            return np.array(kept["counts"], np.int64)
        counts = np.array([self._count(k) for k in range(len(self.paths))], np.int64)
        record.write({"paths": self.paths, "stamps": stamps, "counts": counts.tolist(),
                      "skipped": reader.skipped})
        return counts

    def _count(self, k: int) -> int:
        """Rows of shard k (`ShardReader.count`)."""
        return self._reader.count(self.paths[k])

    def _shard(self, k: int) -> list[tuple[str, ...]]:
        with self._lock:
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
        rows = self._reader.read(self.paths[k])
        with self._lock:
            self._cache[k] = rows
            while len(self._cache) > max(CACHED_SHARDS, self.window * self.groups):
                self._cache.popitem(last=False)
        return rows

    def records(self, ids) -> list[tuple[str, ...]]:
        """The field tuples of global documents `ids`."""
        ids = np.asarray(ids, np.int64)
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        out = [None] * len(ids)
        for k in np.unique(shards):
            rows = self._shard(int(k))
            for i in np.flatnonzero(shards == k):
                out[i] = rows[int(ids[i] - self.offsets[k])]
        return out

    def split(self, names: tuple[str, ...]) -> Split:
        """This source as a random-access split of dicts {name: field} (what
        `datasets.read_pairs` reads)."""
        return Split(self, names)

    def texts(self, ids) -> list[str]:
        return [r[0] for r in self.records(ids)]

    def sample(self, count: int, key: tuple[int, ...]) -> np.ndarray:
        """At most `count` distinct document ids, sorted, drawn with seed (seed, *key) from
        `SAMPLE_SHARDS` shards chosen with the same seed (every shard when there are no more):
        reading a sample costs those shards' decoding whatever the corpus' size."""
        if len(self.paths) <= SAMPLE_SHARDS:
            count = min(count, len(self))
            return np.sort(Permutation(len(self), (self.seed, *key))(np.arange(count)))
        shards = np.sort(Permutation(len(self.paths), (self.seed, *key, 1))(
            np.arange(SAMPLE_SHARDS)))
        starts = np.concatenate([[0], np.cumsum(self.counts[shards])])
        count = min(count, int(starts[-1]))
        positions = Permutation(int(starts[-1]), (self.seed, *key))(np.arange(count))
        slot = np.searchsorted(starts, positions, side="right") - 1
        return np.sort(self.offsets[shards[slot]] + positions - starts[slot])

    def group_size(self, group: int) -> int:
        """Documents of group `group`'s shards (all of them with one group)."""
        return int(self.counts[group::self.groups].sum())

    def order(self, epoch: int, positions, group: int = 0) -> np.ndarray:
        """The global ids at `positions` of epoch `epoch`'s training order of group `group`'s
        shards (see the module docstring): shards permuted, cut into windows, rows permuted
        within each window."""
        positions = np.asarray(positions, np.int64)
        shards = np.arange(group, len(self.paths), self.groups)
        salt = () if self.groups == 1 else (self.groups, group)
        shard_order = shards[Permutation(len(shards), (self.seed, epoch, 0, *salt))(
            np.arange(len(shards)))]
        counts = self.counts[shard_order]
        window_of = np.arange(len(shard_order)) // self.window
        window_sizes = np.bincount(window_of, weights=counts).astype(np.int64)
        window_starts = np.concatenate([[0], np.cumsum(window_sizes)])
        windows = np.searchsorted(window_starts, positions, side="right") - 1
        ids = np.empty_like(positions)
        for w in np.unique(windows):
            here = windows == w
            inner = Permutation(int(window_sizes[w]), (self.seed, epoch, 1, int(w), *salt))(
                positions[here] - window_starts[w])
            members = shard_order[window_of == w]
            member_starts = np.concatenate([[0], np.cumsum(self.counts[members])])
            slot = np.searchsorted(member_starts, inner, side="right") - 1
            ids[here] = self.offsets[members[slot]] + inner - member_starts[slot]
        return ids

    def draw(self, start: int, stop: int, group: int = 0) -> np.ndarray:
        """Positions [start, stop) of group `group`'s endless order (epoch after epoch)."""
        positions = np.arange(start, stop, dtype=np.int64)
        epochs, inner = np.divmod(positions, self.group_size(group))
        ids = np.empty_like(positions)
        for e in np.unique(epochs):
            ids[epochs == e] = self.order(int(e), inner[epochs == e], group)
        return ids


class Split:
    """Records of a `FileDocuments` as dicts keyed by `names` (one per field), by index."""

    def __init__(self, documents: FileDocuments, names: tuple[str, ...]):
        self.documents, self.names = documents, names

    def __len__(self) -> int:
        return len(self.documents)

    def __getitems__(self, ids) -> list[dict[str, str]]:
        return [dict(zip(self.names, r, strict=True)) for r in self.documents.records(ids)]

    def __getitem__(self, i: int) -> dict[str, str]:
        return self.__getitems__([i])[0]
