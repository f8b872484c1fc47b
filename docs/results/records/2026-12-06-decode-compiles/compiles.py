"""Count and time the compiles of one validation decode."""

import collections
import sys
import time

import jax
from jax import monitoring

from transformer.data import make_source
from transformer.inference.runs import open_run
from transformer.inference.translator import from_run

jax.config.update("jax_log_compiles", True)
events = collections.defaultdict(list)


def listener(name, duration, **kw):
    events[name].append(duration)


monitoring.register_event_duration_secs_listener(listener)

run = open_run(sys.argv[1])
tr = from_run(run)
src = make_source(run.config, run.workdir)
split = sys.argv[3] if len(sys.argv) > 3 else "validation"
pairs = src.raw_pairs(split, None)
sources = [s for s, _ in pairs]
bs = int(sys.argv[2])
t = time.time()
hyp = tr.translate(sources, batch_size=bs, show_progress=False)
print(f"{split} batch {bs}: {time.time() - t:.1f} s")
for k, v in sorted(events.items()):
    if "compil" in k or "trac" in k or "lower" in k:
        print(f"{k}: {len(v)} events, {sum(v):.1f} s")
