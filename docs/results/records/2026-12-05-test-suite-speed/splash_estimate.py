"""The TPU compiles of tests/sizing/test_tpu.py's splash step-estimate test, timed (wall and CPU
seconds per compile), and the ratios it asserts. From the repository root:

    .venv/bin/python docs/results/records/2026-12-05-test-suite-speed/splash_estimate.py \
        '{"data.max_length": 2048, "model.max_len": 2048, "model.num_decoder_layers": 2}'

The argument: config overrides on top of the test's former config (4,096 tokens, 4 layers).
"""

import ast
import sys
import time

sys.path[:0] = ["tests", "tests/sizing"]
import conftest  # noqa: E402  (before jax: the tests' XLA flags and compilation cache)
import test_tpu  # noqa: E402

from transformer.config import resolve  # noqa: E402
from transformer.parallel import sharding  # noqa: E402
from transformer.sizing import flops, step_flops, tpu  # noqa: E402

BEFORE = {
    "data.vocab_size": 512, "data.max_length": 4096, "model.max_len": 4096,
    "model.num_decoder_layers": 4, "model.d_model": 512, "model.d_ff": 1024,
    "model.num_heads": 4, "model.num_kv_heads": 4, "model.scan_layers": True,
    "model.dtype": "bfloat16", "model.remat_policy": "full", "data.batch_size": 8,
    "grad_accum_steps": 2, "data.max_rows_per_device": 0}


def main() -> None:
    overrides = BEFORE | (ast.literal_eval(sys.argv[1]) if len(sys.argv) > 1 else {})
    cfg = conftest._load_config("lm_default.py", **overrides)
    real_plan = tpu._plan

    def timed(run, *args):
        wall, cpu = time.time(), time.process_time()
        plan = real_plan(run, *args)
        print("plan", run.config.model.num_decoder_layers, run.config.model.scan_layers,
              round(time.time() - wall, 1), "wall", round(time.process_time() - cpu, 1), "cpu",
              flush=True)
        return plan

    tpu._plan = timed
    wall, cpu = time.time(), time.process_time()
    with test_tpu._tpu_compile():
        topology = tpu.parse_topology("v5e:2x2")
        devices = tpu.abstract_devices(topology)
        run = resolve(cfg, len(devices))
        plan = tpu._plan(run, sharding.make_mesh(run.config.mesh, devices), topology)
        estimate = tpu.step_estimate(run, topology, devices, plan)
    length = overrides["data.max_length"]
    peak = topology.chip.device.peak_flops
    parts = flops.forward_flops(run.model, source_length=length, target_length=length)
    attention = parts["attention_scores_values"] * 8 / 4
    print("recomputed ratio", estimate.recomputed * peak / step_flops.remat_flops(run.model, plan))
    print("unseen/4att", estimate.unseen * peak / (4 * attention))
    before = step_flops.step_flops_per_device(run.model, plan) - estimate.compiler_flops
    print("before/(0.5*4att)", before / (0.5 * 4 * attention))
    print("total", round(time.time() - wall, 1), "wall", round(time.process_time() - cpu, 1), "cpu")


if __name__ == "__main__":
    main()
