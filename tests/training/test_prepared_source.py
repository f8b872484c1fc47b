"""With several processes, `_prepared_source` has process 0 prepare the data first and lets no
process go on to the collectives of restoring and compiling before every process has its
source, waiting on the coordination service's key-value store (a fake one here, whose peer sets
its key after a number of timed-out waits) rather than in a collective."""

import logging
import types

import jax
import pytest
from jax._src import distributed as jax_distributed

from transformer.training import loop

PREPARED = loop.DATA_PREPARED_KEY
READY = loop.DATA_READY_KEY


class Store:
    """The key-value store as one process sees it: a key of `later` is set by its peer after
    that many of this process's waits for it have timed out."""

    def __init__(self, later: dict[str, int]):
        self.values, self.later, self.events = {}, dict(later), []

    def key_value_set(self, key, value):
        assert key not in self.values
        self.values[key] = value
        self.events.append(("set", key))

    def blocking_key_value_get(self, key, timeout_ms):
        assert timeout_ms == loop.DATA_WAIT_LOG_S * 1000
        if key not in self.values and self.later.get(key, 0) > 0:
            self.later[key] -= 1
            self.events.append(("timed out", key))
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        if key not in self.values:
            self.values[key] = "1"
            self.events.append(("peer set", key))
        return self.values[key]


@pytest.mark.parametrize("process", [0, 1])
def test_no_process_goes_on_before_every_process_has_its_source(process, monkeypatch, caplog):
    peer = 1 - process
    later = ({READY.format(1): 2} if process == 0 else {PREPARED: 1, READY.format(0): 2})
    store = Store(later)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(jax_distributed.global_state, "client", store)

    def make_source(cfg, workdir):
        store.events.append(("make_source", workdir))
        return types.SimpleNamespace(rows_per_batch=4, eval_rows_per_batch=4)

    monkeypatch.setattr(loop, "make_source", make_source)
    with caplog.at_level(logging.INFO, logger="transformer"):
        source = loop._prepared_source(None, "run", batch_shards=2)
    assert source.rows_per_batch == 4
    waits = [("timed out", READY.format(peer))] * 2 + [("peer set", READY.format(peer))]
    if process == 0:
        assert store.events == [("make_source", "run"), ("set", PREPARED),
                                ("set", READY.format(0)), *waits]
    else:
        assert store.events == [("timed out", PREPARED), ("peer set", PREPARED),
                                ("make_source", "run"), ("set", READY.format(1)), *waits]
    said = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert said[-2:] == [f"process {process}: waiting 60 s for process {peer} to open its data",
                         f"process {process}: waiting 120 s for process {peer} to open its data"]
