"""Several file sources mixed by weight (`data.sources`: a list of {dataset, weight, ...}).

A weight is a share of training tokens. With m_s the mean tokens of a document of source s (a
seeded sample) and T an update's token capacity, source s contributes r_s = w_s T / m_s
documents per update (w normalised): update i takes documents [floor(r_s i), floor(r_s (i+1)))
of source s's own order (`FileDocuments.order`, epoch by epoch as each source wraps), so batch
i is a function of (seed, i) and each source's token share converges to its weight. The
documents of an update are then interleaved by a seeded permutation of their ids. Global ids
put source s's documents after those of sources 0..s-1. With packing groups (`data.pack_groups`
G), group g draws r_s / G documents per update from each source's group-g shards, so every
group keeps the weights and a process reads only its groups' shards of every source.
"""

from __future__ import annotations

import numpy as np

from transformer.data.file_specs import BadData
from transformer.data.files import FileDocuments
from transformer.data.permutation import Permutation


def from_sources(sources: list[dict], options: dict) -> Mixture:
    """`data.sources`, each {dataset, weight, text_field?}, as a `Mixture` of `FileDocuments`
    built with `options`. The sources are checked before any file is read."""
    for i, spec in enumerate(sources):
        if "dataset" not in spec or "weight" not in spec:
            raise ValueError(f"data.sources[{i}]={spec}: each source needs a dataset "
                             f"(<format>:<glob>) and a weight")
        if not float(spec["weight"]) > 0:
            raise BadData(f"data.sources[{i}].weight={spec['weight']} must be positive")
    documents = []
    for i, spec in enumerate(sources):
        fields = (spec.get("text_field") or options["fields"][0],)
        documents.append(FileDocuments(spec["dataset"], setting=f"data.sources[{i}]",
                                       **{**options, "fields": fields}))
    return Mixture(documents, [float(s["weight"]) for s in sources], options["seed"])


class Mixture:
    """Documents of several `FileDocuments` by global id, and each update's draw. The weights
    are positive (`from_sources` checks them)."""

    def __init__(self, sources: list[FileDocuments], weights, seed: int = 0):
        weights = np.asarray(weights, np.float64)
        self.sources, self.seed = sources, int(seed)
        self.weights = weights / weights.sum()
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in sources])])
        self.name = " + ".join(f"{w:.3g}*{s.name}" for s, w in zip(sources, self.weights,
                                                                  strict=True))
        self.rates = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def set_rates(self, tokens_per_batch: float, mean_tokens) -> float:
        """Documents per update of each source for `tokens_per_batch` tokens. Returns their sum."""
        self.rates = self.weights * float(tokens_per_batch) / np.asarray(mean_tokens, np.float64)
        return float(self.rates.sum())

    def source_of(self, ids) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(ids, np.int64), side="right") - 1

    def texts(self, ids) -> list[str]:
        ids = np.asarray(ids, np.int64)
        which = self.source_of(ids)
        out = [None] * len(ids)
        for s in np.unique(which):
            where = np.flatnonzero(which == s)
            for i, text in zip(where, self.sources[s].texts(ids[where] - self.offsets[s]),
                               strict=True):
                out[i] = text
        return out

    def sample(self, count: int, key: tuple[int, ...]) -> np.ndarray:
        """At most `count` distinct global ids, sorted: each source's share of `count` in
        proportion to its documents, drawn by its own `sample`."""
        shares = np.floor(count * (self.offsets[1:] - self.offsets[:-1]) / len(self))
        return np.sort(np.concatenate([
            source.sample(int(share), (*key, k)) + self.offsets[k]
            for k, (source, share) in enumerate(zip(self.sources, shares, strict=True))]))

    def batch(self, index: int, group: int = 0) -> np.ndarray:
        """The global ids of update `index`'s documents, interleaved. With G groups (the
        sources' `groups`), those of group `group`: r_s / G documents per update of each
        source's group-`group` order (`FileDocuments.draw`)."""
        parts = []
        for s, (source, rate) in enumerate(zip(self.sources, self.rates, strict=True)):
            rate /= source.groups
            start = int(np.floor(rate * index))
            stop = int(np.floor(rate * (index + 1)))
            parts.append(source.draw(start, stop, group) + self.offsets[s])
        ids = np.concatenate(parts)
        salt = () if self.sources[0].groups == 1 else (group,)
        return ids[Permutation(len(ids), (self.seed, index, 13, *salt))(np.arange(len(ids)))] \
            if len(ids) else ids
