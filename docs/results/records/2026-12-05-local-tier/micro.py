import time, jax, jax.numpy as jnp, tempfile, statistics
from transformer.checkpoint import tiers, checkpointer
state = {"p": {f"w{i}": jax.random.normal(jax.random.key(i), (64, 128)) for i in range(30)}}
d = tempfile.mkdtemp(dir="/dev/shm")
t = tiers.TwoTiers(d + "/run", keep=2, local_dir=d + "/local", local_every=1, keep_local=2)
blocking, total, sums = [], [], []
for step in range(1, 16):
    a = time.perf_counter(); checkpointer.checksums(state); sums.append(time.perf_counter() - a)
    a = time.perf_counter(); t.save(step, state, {"next_batch_index": step}, persistent=False)
    b = time.perf_counter(); t.wait(); c = time.perf_counter()
    blocking.append(b - a); total.append(c - a)
t.close()
m = lambda x: round(1000 * statistics.median(x[3:]), 1)
print("checksums ms", m(sums), "save blocking ms", m(blocking), "save+wait ms", m(total))
