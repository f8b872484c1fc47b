"""Fixed CPU benchmark workload `lm-125m`: the 125M-parameter language model of
`configs/lm_125m.py` at its real shapes, one row per step.

    python benchmarks/train_step.py --config=benchmarks/workloads/lm_125m.py --steps 3 --warmup 1

The config's decoder-only model (12 layers, d_model 768, 12 heads sharing 4 key/value heads,
SwiGLU d_ff 2048, untied 32k vocabulary) on rows of 2,048 tokens, AdamW, in float32 (the
config computes in bfloat16 on accelerators; CPUs have no fast bfloat16 matmul). The batch is
the synthetic copy task's target side, every token real (a decoder-only model reads no
source), so the figure is the model's arithmetic alone, not the input pipeline.
"""

import pathlib
import runpy

from ml_collections import config_dict

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
lm_125m = runpy.run_path(str(CONFIGS / "lm_125m.py"))["get_config"]


def get_config():
    cfg = lm_125m()
    cfg.data = config_dict.ConfigDict(dict(
        dataset="synthetic", task="copy", vocab_size=32_000, min_length=2047, max_length=2047,
        batch_size=1, eval_examples=1))
    cfg.model.vocab_size = cfg.data.vocab_size
    cfg.model.dtype = "float32"
    cfg.grad_accum_steps = 1
    return cfg
