"""A local save's blocking part alone, profiled: a state of 90 arrays (1 M floats, about the
tiny config's parameters and Adam moments), 20 saves into /dev/shm with the previous one waited
for first; cProfile of the save calls after the first 3, by own time."""

import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time

import jax

from transformer.checkpoint import tiers

state = {"p": {f"w{i}": jax.random.normal(jax.random.key(i), (96, 128)) for i in range(90)}}
folder = tempfile.mkdtemp(dir="/dev/shm")
two = tiers.TwoTiers(folder + "/run", keep=2, local_dir=folder + "/local", local_every=1)
profiler, blocking = cProfile.Profile(), []
for step in range(1, 24):
    two.wait()
    if step > 3:
        profiler.enable()
    start = time.perf_counter()
    two.save(step, state, {"next_batch_index": step}, persistent=False)
    blocking.append(time.perf_counter() - start)
    if step > 3:
        profiler.disable()
two.close()
print("blocking ms median", round(1000 * statistics.median(blocking[3:]), 1),
      [round(1000 * b) for b in blocking])
text = io.StringIO()
pstats.Stats(profiler, stream=text).sort_stats(sys.argv[1] if len(sys.argv) > 1 else
                                               "tottime").print_stats(25)
print(text.getvalue())
