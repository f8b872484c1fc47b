"""MetricWriter.sync alone: the flush and close that every checkpoint save waits for."""

import statistics
import tempfile
import time

from transformer.training import metrics

folder = tempfile.mkdtemp()
writer = metrics.MetricWriter(folder, "tensorboard")
times = []
for step in range(1, 161):
    writer.write(step, "train", {"loss": 1.0 / step, "learning_rate": 1e-3})
    if step % 10 == 0:
        start = time.perf_counter()
        writer.sync()
        times.append(time.perf_counter() - start)
writer.close()
print("MetricWriter.sync ms", [round(1000 * t) for t in times], "median",
      round(1000 * statistics.median(times), 1))
