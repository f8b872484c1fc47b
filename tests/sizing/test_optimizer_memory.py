"""The memory plan's optimizer state (`--compile_only`'s figure, `--summary`'s line) for each
optimizer choice, against the bytes the analysis predicts from the parameter shapes."""

import math

import jax
import pytest

from transformer.config import resolve
from transformer.parallel import sharding
from transformer.sizing import flops, memory, step_time, summary
from transformer.training import train_state

COUNTS = 8  # two int32 step counts: the moments' (or factored statistics') and the schedule's


def predicted(shapes, name: str, min_dim: int = 128) -> int:
    """Bytes of optimizer state: Adam's two float32 moments (8 per parameter) or bfloat16 ones
    (4); Adafactor's row and column statistics (the parameter's size over its largest, and
    over its second largest axis) for a tensor whose two largest axes are >= min_dim, a full
    float32 statistic otherwise, each beside [1] float32 stubs for the statistics it lacks."""
    size = sum(math.prod(s) for s in shapes)
    if name == "adam":
        return 8 * size + COUNTS
    if name == "bfloat16":
        return 4 * size + COUNTS
    total = COUNTS + 4  # and the count of the weight decay's schedule (weight_decay 0.1)
    for shape in shapes:  # attention kernels with their two head axes merged (merged_shapes)
        largest, second = sorted(shape)[-1:], sorted(shape)[-2:-1]
        if len(shape) >= 2 and second[0] >= min_dim:
            total += 4 * (math.prod(shape) // largest[0] + math.prod(shape) // second[0]) + 4
        else:
            total += 4 * math.prod(shape) + 8
    return total


def merged_shapes(params) -> list[tuple[int, ...]]:
    """The leaves' shapes as Adafactor factors them (`moments.merge_heads`): a query, key or
    value kernel [..., D, N, H] as [..., D, N*H], the output's [..., N, H, D] as [..., N*H, D]."""
    shapes = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name, shape = jax.tree_util.keystr(path), leaf.shape
        if any(f"['{p}']['kernel']" in name for p in ("query", "key", "value")):
            shape = (*shape[:-2], shape[-2] * shape[-1])
        elif "['out']['kernel']" in name:
            shape = (*shape[:-3], shape[-3] * shape[-2], shape[-1])
        shapes.append(shape)
    return shapes


@pytest.mark.parametrize("choice", ["adam", "bfloat16", "adafactor"])
def test_optimizer_bytes_per_parameter_follow_the_analysis(load_config, choice):
    overrides = {"optimizer.moments_dtype": "bfloat16"} if choice == "bfloat16" else (
        {"optimizer.name": "adafactor"} if choice == "adafactor" else {})
    cfg = load_config("t5_default.py", **overrides)
    run = resolve(cfg)
    params = flops.abstract_params(run.model)
    shapes = merged_shapes(params)
    expected = predicted(shapes, choice)
    total = flops.param_counts(run.model)["total"]
    assert f"{expected / total:.2f} bytes per parameter ({expected:,} bytes)" in (
        summary.summarize(run))
    # --compile_only's figure: the trainer's abstract state on one device holds it all.
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = train_state.build_trainer(resolve(cfg, 1), mesh)
    assert memory.device_bytes(trainer.abstract_state.opt_state) == expected
    per_param = {"adam": 8, "bfloat16": 4, "adafactor": 0.02}[choice]
    assert expected / total == pytest.approx(per_param, abs=0.005)


def test_optimizer_seconds_count_the_state():
    # Adam float32: params and gradient 3 passes + moments read and written 4 = 7 x params.
    assert step_time.optimizer_seconds(4_000, 1e9) == pytest.approx(7 * 4e-6)
    assert step_time.optimizer_seconds(4_000, 1e9, 4_000) == pytest.approx(5 * 4e-6)


def test_lora_counts_the_adapters_moments_alone(load_config):
    """`--summary` with finetune.lora_rank > 0: Adam's moments of the adapters, not of the
    model, and the figure --compile_only reads from the trainer's abstract state."""
    cfg = load_config("lm_default.py", **{"model.num_decoder_layers": 1})
    cfg.finetune = {"lora_rank": 4, "lora_alpha": 8, "lora_targets": "query,value"}
    run = resolve(cfg)
    params = flops.abstract_params(run.model)
    adapters = [leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                if "lora_" in jax.tree_util.keystr(path)]
    assert adapters  # two kernels with A and B each
    expected = predicted(adapters, "adam")
    assert summary.optimizer_state_bytes(run, params) == expected
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = train_state.build_trainer(resolve(cfg, 1), mesh)
    assert memory.device_bytes(trainer.abstract_state.opt_state) == expected
