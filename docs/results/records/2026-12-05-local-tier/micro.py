"""The local tier's save alone: checksums, the blocking part of a save, and save plus wait."""

import statistics
import tempfile
import time

import jax

from transformer.checkpoint import checkpointer, tiers


def median_ms(values):
    return round(1000 * statistics.median(values[3:]), 1)  # the first saves compile


state = {"p": {f"w{i}": jax.random.normal(jax.random.key(i), (64, 128)) for i in range(30)}}
folder = tempfile.mkdtemp(dir="/dev/shm")
two_tiers = tiers.TwoTiers(folder + "/run", keep=2, local_dir=folder + "/local", local_every=1,
                           keep_local=2)
blocking, total, sums = [], [], []
for step in range(1, 16):
    start = time.perf_counter()
    checkpointer.checksums(state)
    sums.append(time.perf_counter() - start)
    start = time.perf_counter()
    two_tiers.save(step, state, {"next_batch_index": step}, persistent=False)
    saved = time.perf_counter()
    two_tiers.wait()
    blocking.append(saved - start)
    total.append(time.perf_counter() - start)
two_tiers.close()
print("checksums ms", median_ms(sums), "save blocking ms", median_ms(blocking),
      "save+wait ms", median_ms(total))
