import time, tempfile, statistics
from transformer.training import metrics
d = tempfile.mkdtemp(dir="/tmp/h/lt")
w = metrics.MetricWriter(d, "tensorboard")
times = []
for step in range(1, 161):
    w.write(step, "train", {"loss": 1.0 / step, "learning_rate": 1e-3})
    if step % 10 == 0:
        a = time.perf_counter(); w.sync(); times.append(time.perf_counter() - a)
w.close()
print("MetricWriter.sync ms", [round(1000 * t) for t in times], "median",
      round(1000 * statistics.median(times), 1))
