"""What a run records about its data in `<workdir>/vocab/` (a file source's rows per shard, a
language model's mean document length), so that the processes after process 0 and a resumed
run need not read the data again to learn it."""

from __future__ import annotations

import hashlib
import json

from etils import epath

from transformer.util import atomic


class Record:
    """`<record_dir>/<kind>-<digest>.json`: what a run recorded about the data its `spec` (a
    JSON-able list) names, kept in the run's `<workdir>/vocab/` (rows per shard, the mean
    length of a document) so that later processes and a resumed run need not read it again."""

    def __init__(self, record_dir: str, kind: str, spec: list):
        self.spec = json.dumps(spec)
        digest = hashlib.sha256(self.spec.encode()).hexdigest()[:16]
        self.path = epath.Path(record_dir) / f"{kind}-{digest}.json"

    def read(self) -> dict | None:
        return json.loads(self.path.read_text()) if self.path.exists() else None

    def write(self, fields: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_atomically(self.path, json.dumps({"spec": self.spec, **fields}))
