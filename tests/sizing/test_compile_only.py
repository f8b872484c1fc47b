"""`train.py --compile_only`: the memory plan's accounting (in-process, small configs) and the
CLI on large configs over 8 fake devices, which must report memory and allocate nothing large."""

import dataclasses
import os
import pathlib
import subprocess
import sys
import time

import jax
import pytest
from conftest import FAST_COMPILE

from transformer.config import resolve
from transformer.model.transformer import TransformerConfig
from transformer.parallel import sharding
from transformer.sizing import activations, batches, flops, memory
from transformer.training import train_state

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_state_bytes_on_one_device_are_the_parameter_count_times_four(load_config):
    cfg = load_config("tiny.py")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    state = train_state.build_trainer(resolve(cfg, 1), mesh).abstract_state
    count = flops.param_counts(TransformerConfig.from_dict(cfg.model))["total"]
    assert memory.device_bytes(state.params) == 4 * count
    # Adam's two float32 moments, plus two int32 step counts (Adam's and the schedule's)
    assert memory.device_bytes(state.opt_state) == 8 * count + 8


def test_activation_bytes_match_the_docstring_formula_by_hand(load_config):
    """configs/tiny.py (D 64, F 128, N = K = 4, H = 16, V 32, 2 + 2 layers, float32), S = 12,
    T = 13 (the synthetic targets end in EOS), remat "full", per sequence:
    layer inputs 4 x 4·(2·12 + 2·13)·64 = 12,800; the largest layer without remat (a decoder
    layer) 4 x [self 13·64 + 13·128 + 13·64 + 4·13·64 = 6,656; cross 13·64 + 12·128 + 13·64 +
    4·13·64 = 6,528; FFN 13·(2·128 + 3·64) = 5,824; input 832] + float32 weights 4 x 4·(13·13 +
    13·12) = 79,360 + 5,200; embedded inputs 4·(12 + 13)·64 = 6,400; logits 2·4·13·32 = 3,328."""
    model = resolve(load_config("tiny.py", **{"model.remat_policy": "full"})).model
    per_sequence = 12_800 + 79_360 + 5_200 + 6_400 + 3_328
    assert activations.activation_bytes(model, rows=2, source_length=12,
                                        target_length=13) == 2 * per_sequence
    # The loss by chunks of 8 tokens per device (4 positions of the 2 rows): two float32 copies
    # of one chunk's logits 2·4·(2·4)·32 = 2,048, the hidden states' gradient 4·13·64 = 3,328
    # per row, and the output kernel's float32 gradient 4·64·32 = 8,192, instead of the logits.
    assert activations.activation_bytes(model, rows=2, source_length=12, target_length=13,
                                        loss_chunk_tokens=8) == (
        2 * (per_sequence - 3_328) + 2 * 3_328 + 2_048 + 8_192)  # logits out, d hidden in


@pytest.mark.parametrize("factor, encoder_rows, decoder_rows", [
    (1.25, 32, 36),  # capacity: E·ceil(1.25·L·2 / 4) slots, L = 12 and 13
    (0.0, 24, 26)])  # dropless: k·L
def test_a_routed_layer_keeps_its_experts_rows(load_config, factor, encoder_rows, decoder_rows):
    """configs/tiny.py (float32, ReLU, F 128, D 64, 2 + 2 layers, remat none) with 4 experts,
    2 a token: each layer's FFN keeps R rows of F twice (before and after the activation) and
    the dispatched tokens and the experts' outputs (2·R·D) where the dense one keeps L rows of
    F twice; the rest is the same. Per sequence: 2 x [(R_S - 12)·128·2 + 2·R_S·64] + 2 x
    [(R_T - 13)·128·2 + 2·R_T·64] elements of 4 bytes."""
    dense = resolve(load_config("tiny.py", **{"model.remat_policy": "none"})).model
    routed = dataclasses.replace(dense, num_experts=4, experts_per_token=2,
                                 moe_capacity_factor=factor)
    elements = 2 * ((encoder_rows - 12) * 256 + 128 * encoder_rows) + 2 * (
        (decoder_rows - 13) * 256 + 128 * decoder_rows)
    sizes = dict(rows=2, source_length=12, target_length=13)
    dense_bytes = activations.activation_bytes(dense, **sizes)
    routed_bytes = activations.activation_bytes(routed, **sizes)
    assert routed_bytes - dense_bytes == 2 * 4 * elements
    shared = dataclasses.replace(routed, moe_shared_expert=True)  # + a dense FFN a layer
    shared_bytes = activations.activation_bytes(shared, **sizes)
    assert shared_bytes - routed_bytes == 2 * 4 * (2 * 12 * (256 + 192) + 2 * 13 * (256 + 192))


def test_abstract_batch_follows_each_batch_layout(load_config):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    tiny = load_config("tiny.py", grad_accum_steps=2)
    batch = batches.abstract_batch(tiny, mesh)
    assert {k: v.shape for k, v in batch.items()} == {"inputs": (2, 16, 12),
                                                      "targets": (2, 16, 13)}
    assert batch["inputs"].sharding.spec == jax.P(None, sharding.BATCH_AXES)
    wmt = load_config("wmt14_ende_base.py", grad_accum_steps=1)
    assert set(batches.batch_shapes(wmt)) == set(batches.TRANSLATION_KEYS)
    assert set(batches.batch_shapes(wmt).values()) == {(1, 104, 256)}
    lm = load_config("wmt14_ende_base.py", grad_accum_steps=4)
    expected = {"causal": {"targets", "targets_positions", "targets_segmentation"},
                "prefix": {"targets", "targets_positions", "targets_segmentation",
                           "targets_prefix"},
                "sft": {"targets", "targets_positions", "targets_segmentation",
                        "targets_loss_mask"},
                "masked": {"inputs", "inputs_positions", "inputs_segmentation", "targets"}}
    for objective, keys in expected.items():
        lm.data.objective = objective
        shapes = batches.batch_shapes(lm)
        assert set(shapes) == keys and set(shapes.values()) == {(4, 26, 256)}
    lm.data.objective = "span_corruption"  # pieces of 284 tokens: 43 noise, 14 spans, EOS
    assert batches.batch_shapes(lm) == {k: (4, 26, 256 if k.startswith("inputs") else 58)
                                        for k in batches.TRANSLATION_KEYS}
    lm.data.objective = "classification"
    assert batches.batch_shapes(lm) == {"inputs": (4, 26, 256), "label": (4, 26)}


def _peak_rss(pid: int) -> int:
    """The process's own resident high-water mark (VmHWM, bytes; 0 once it has exited). Not
    wait4's ru_maxrss: Linux carries the spawning process's peak into its child across exec,
    so a child of a pytest worker that grew to gigabytes would report the worker's peak."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def _compile_only(tmp_path, args: list[str]) -> tuple[int, str, str, int]:
    """Runs `train.py --compile_only` (outside pytest's 8-device JAX): (status, stdout,
    stderr, the child's own peak RSS in bytes, read every 20 ms while it runs)."""
    out = tmp_path / "stdout.txt"
    err = tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # the tests' cheapest compile (train.py keeps it and sets the device count): the arguments'
    # bytes are the same, and the big model's 12-layer step compiles sooner (35 -> 27 CPU s)
    env["XLA_FLAGS"] = FAST_COMPILE
    peak = 0
    with open(out, "w") as stdout, open(err, "w") as stderr:
        child = subprocess.Popen([sys.executable, "train.py", "--compile_only", *args],
                                 stdout=stdout, stderr=stderr, cwd=ROOT, env=env)
        while child.poll() is None:
            peak = max(peak, _peak_rss(child.pid))
            time.sleep(0.02)
    assert peak > 0, "the child's memory was never read"
    return child.returncode, out.read_text(), err.read_text(), peak


def _figures(report: str) -> dict[str, int]:
    last = report.strip().splitlines()[-1]
    assert last.startswith("per_device_bytes: "), report
    return {k: int(v) for k, v in (item.split("=") for item in last.split()[1:])}


def _check_report(tmp_path, load_config, config_name: str,
                  overrides: dict) -> tuple[dict, int, int]:
    """Runs the CLI on 8 devices and checks its state accounting against the abstract state
    built here; returns (figures, full params bytes, the child's peak RSS)."""
    args = [f"--config=configs/{config_name}", "--mesh_devices=8"]
    args += [f"--config.{k}={v}" for k, v in overrides.items()]
    status, report, stderr, peak_rss = _compile_only(tmp_path, args)
    assert status == 0, stderr
    figures = _figures(report)

    cfg = load_config(config_name, **overrides)
    state = train_state.build_trainer(resolve(cfg, 8), sharding.make_mesh(cfg.mesh)).abstract_state
    leaves = jax.tree.leaves(state.params)
    full = 4 * sum(leaf.size for leaf in leaves)
    replicated = 4 * sum(leaf.size for leaf in leaves if leaf.sharding.is_fully_replicated)
    assert full // 4 == flops.param_counts(TransformerConfig.from_dict(cfg.model))["total"]
    assert replicated < full / 100  # only norms (and biases) escape FSDP
    assert figures["analytic_params"] == (full - replicated) // 8 + replicated
    assert 0 <= figures["analytic_optimizer_state"] - 2 * figures["analytic_params"] <= 64
    # The state and batch XLA takes as arguments are the analytic ones to the byte (+ step).
    assert figures["compiled_arguments"] == (figures["analytic_params"] + figures[
        "analytic_optimizer_state"] + figures["analytic_batch"] + 4)
    for key in ("outputs", "aliased", "temporaries", "total"):
        assert figures[f"compiled_{key}"] > 0
    assert figures["analytic_activations"] > 0
    assert "fits? the larger total" in report and "H100" in report
    return figures, full, peak_rss


@pytest.mark.slow
def test_compile_only_wmt14_big_fsdp8(tmp_path, load_config):
    """About a minute on 2 CPU cores (the unscanned 12-layer step compiles in ~20-55 s)."""
    figures, full, peak_rss = _check_report(tmp_path, load_config, "wmt14_ende_big.py",
                                            {"mesh.fsdp": 8, "mesh.data": 1})
    # Nothing of the program's size was allocated: the process stays under its full state
    # (params and Adam moments, 2.6 GB) and far under one device's compiled total.
    assert peak_rss < min(2 * 1024 ** 3, 3 * full, figures["compiled_total"] / 4)


@pytest.mark.slow
def test_compile_only_lm_8b_allocates_nothing_large(tmp_path, load_config):
    """The 7.2B-parameter LM (scanned layers) compiles in 5-20 s (15-25 s the test); its float32
    params alone are 29 GB, the process stays well under 2 GB."""
    if not (ROOT / "configs" / "lm_8b.py").exists():
        pytest.skip("configs/lm_8b.py is not there yet")
    figures, full, peak_rss = _check_report(tmp_path, load_config, "lm_8b.py", {})
    assert full > 28e9
    assert figures["analytic_gradients"] == 2 * figures["analytic_params"]  # + accumulator
    assert peak_rss < min(2 * 1024 ** 3, full / 10)


def test_compile_only_rejects_a_mesh_the_devices_do_not_fill(tmp_path):
    status, _, stderr, _ = _compile_only(tmp_path, [
        "--config=configs/wmt14_ende_big.py", "--mesh_devices=3", "--config.mesh.fsdp=8",
        "--config.mesh.data=1"])
    assert status == 1
    assert stderr.strip().splitlines() == [
        "error: mesh.data=1, mesh.fsdp=8, mesh.tensor=1 needs 8 devices, but 3 are available; "
        "make the product 3 or set one axis to -1"]


def test_bytes_per_device_of_a_sharded_leaf():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
    sharded = jax.ShapeDtypeStruct((64, 3), "float32",
                                   sharding=jax.NamedSharding(mesh, jax.P("fsdp")))
    replicated = jax.ShapeDtypeStruct((5,), "bfloat16", sharding=sharding.replicated(mesh))
    assert memory.device_bytes({"a": sharded, "b": replicated}) == 8 * 3 * 4 + 5 * 2
