"""Fixed CPU benchmark workload `cpu-small`, so throughput figures compare across changes.

    python benchmarks/train_step.py --config=benchmarks/workloads/cpu_small.py

The paper's post-LN encoder-decoder at 2 + 2 layers, d_model 256, d_ff 1024, 4 heads, a shared
vocabulary of 8,192, float32, Adam; 32 rows per step of 63 source and 64 target tokens
(synthetic copy task: every token real, no padding), dropout 0.1 as in training.
"""

import pathlib
import runpy

tiny = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py"))[
    "get_config"]


def get_config():
    cfg = tiny()
    cfg.data.update(dict(task="copy", vocab_size=8192, min_length=63, max_length=63,
                         batch_size=32))
    cfg.model.update(dict(num_encoder_layers=2, num_decoder_layers=2, d_model=256, d_ff=1024,
                          num_heads=4, max_len=64))
    return cfg
