"""Fixed CPU benchmark workload `cpu-base`: the paper's base dimensions on a CPU.

    python benchmarks/train_step.py --config=benchmarks/workloads/cpu_base.py

Post-LN encoder-decoder, 6 + 6 layers, d_model 512, d_ff 2048, 8 heads, a shared vocabulary of
32,768, float32, Adam; 16 rows per step of 63 source and 64 target tokens (synthetic copy task,
no padding), dropout 0.1.
"""

import pathlib
import runpy

tiny = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py"))[
    "get_config"]


def get_config():
    cfg = tiny()
    cfg.data.update(dict(task="copy", vocab_size=32_768, min_length=63, max_length=63,
                         batch_size=16))
    cfg.model.update(dict(num_encoder_layers=6, num_decoder_layers=6, d_model=512, d_ff=2048,
                          num_heads=8, max_len=64))
    return cfg
