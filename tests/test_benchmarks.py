"""The benchmark scripts keep working: the GPU check end to end at its dry-run sizes on CPU."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent


def one_cpu_device_env() -> dict:
    """A user's shell, but for the tests' fast compiling: one CPU device (conftest fakes 8), no
    compilation cache."""
    env = subprocess_env(PYTHON=sys.executable)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_result(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(one_cpu_device_env(), GPU_CHECK_TIMEOUT_S="540")  # 195 s on an idle CI machine
    with open(tmp_path / "log.txt", "w") as log:  # a file, not a pipe nobody reads
        result = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", f"--out={out}",
                                 "--steps=1"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=600)
    assert result.returncode == 0, (tmp_path / "log.txt").read_text()[-4000:]
    rows = json.loads(out.read_text())
    assert rows[0]["check"] == "device" and rows[0]["dry_run"] is True
    by_check = {}
    for row in rows[1:]:
        assert "error" not in row, row
        by_check.setdefault(row["check"], []).append(row)
    parity = {r["implementation"]: r for r in by_check["attention"]}
    assert set(parity) == {"xla", "chunked", "cudnn"} and "skipped" in parity["cudnn"]
    for impl in ("xla", "chunked"):
        assert parity[impl]["max_abs_diff_vs_f32_xla"] < 0.05  # bfloat16 inputs
        assert parity[impl]["forward_backward_ms"] > 0
    steps = by_check["train_step"]
    assert [(r["model"], r["dtype"]) for r in steps] == [
        ("base", "bfloat16"), ("base", "bfloat16"), ("big", "bfloat16"), ("big", "bfloat16")]
    assert all(r["tokens_per_sec"] > 0 and r["compile_s"] > 0 for r in steps)
    assert steps[0]["target_tokens_per_step"] < steps[1]["target_tokens_per_step"]
    (lm,) = by_check["lm_train_step"]
    assert lm["dtype"] == "bfloat16" and lm["layers"] == [0, 1] and lm["tokens_per_sec"] > 0
    whole, chunked = by_check["loss_chunks"]
    assert (whole["loss_chunk_tokens"], chunked["loss_chunk_tokens"]) == (0, 64)
    assert chunked["temp_bytes"] < whole["temp_bytes"]  # no [B, T, V] logits held whole
    assert [r["beam_size"] for r in by_check["decode"]] == [4, 1]
    assert all(r["sentences_per_sec"] > 0 for r in by_check["decode"])


def test_gpu_check_runs_the_checks_asked_for_and_refuses_unknown_ones(tmp_path):
    """--checks picks a subset (a device call's 10 minutes hold the whole check on an H200 only
    in two parts: docs/benchmarks.md)."""
    out = tmp_path / "gpu_check.json"
    script = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", f"--out={out}"]
    result = subprocess.run([*script, "--checks=attention"], cwd=ROOT, env=one_cpu_device_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["check"] for r in rows] == ["device"] + ["attention"] * 3
    result = subprocess.run([*script, "--checks=attention,train_steps"], cwd=ROOT,
                            env=one_cpu_device_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1  # absl's flag error: one line, before any check runs
    assert "--checks=['attention', 'train_steps']: unknown train_steps; choose from attention," \
        in result.stderr


@pytest.mark.slow
def test_sweep_writes_a_point_per_length_and_batch_and_a_plot(tmp_path):
    out = tmp_path / "sweep.png"
    config = tmp_path / "tiny_one_layer.py"  # configs/tiny.py at one layer a side: compiles sooner
    config.write_text(
        "import runpy\n\n\ndef get_config():\n"
        f"    cfg = runpy.run_path({str(ROOT / 'configs' / 'tiny.py')!r})['get_config']()\n"
        "    cfg.model.num_encoder_layers = cfg.model.num_decoder_layers = 1\n"
        "    return cfg\n")
    with open(tmp_path / "log.txt", "w") as log:
        result = subprocess.run([sys.executable, "benchmarks/sweep.py",
                                 f"--config={config}", "--lengths=8,16", "--batches=4",
                                 "--steps=1", f"--out={out}"], cwd=ROOT,
                                env=one_cpu_device_env(), stdout=log,
                                stderr=subprocess.STDOUT, timeout=600)
    output = (tmp_path / "log.txt").read_text()
    assert result.returncode == 0, output[-4000:]
    points = [json.loads(line) for line in output.splitlines() if line.startswith('{"length"')]
    assert [(p["length"], p["rows"]) for p in points] == [(8, 4), (16, 4)]
    assert all(p["tokens_per_sec"] > 0 and p["peak_bytes"] > 0 for p in points)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_source_probe_unigram_floor_by_hand():
    """Counts (add-one) 5 once and 7 twice among ordinary tokens; EOS (3) is free: over 12
    counts p(7) = 3/12, so targets [7, EOS] have perplexity exp(ln 4 / 2) = 2."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from benchmarks.source_probe import unigram_perplexity

    def batch(ids, padding=0):
        targets = np.array([ids + [0] * padding])
        return {"targets": targets, "targets_segmentation": (targets > 0).astype(np.int32)}

    floor = unigram_perplexity([batch([5, 7, 7, 3], padding=2)], [batch([7, 3], padding=3)],
                               10, [3])
    assert floor == pytest.approx(2.0)


def test_decode_int8_scores_both_and_measures_the_cache(untrained_translation_workdir, tmp_path):
    """benchmarks/decode_int8.py on a tiny run (in-process): both passes scored, the cache
    and parameter bytes measured on the arrays, int8's cache at most half of float32's."""
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "decode_int8.py"))
    sources, references = tmp_path / "src.txt", tmp_path / "ref.txt"
    sources.write_text("Sie geht oft ins Kino.\nOpens a dialog.\nJa.\n")
    references.write_text("She goes often to the movies.\nÖffnet einen Dialog.\nYes.\n")
    record = script["benchmark"](str(untrained_translation_workdir), "test", 0, str(sources),
                                 str(references), 2, 2)
    assert record["sentences"] == 3 and record["beam_size"] == 2
    assert record["bleu_difference"] == record["int8_bleu"] - record["float_bleu"]
    assert record["int8_sentences_per_sec"] > 0 and record["float_sentences_per_sec"] > 0
    # configs/tiny.py: H = 64 / 4 = 16, so int8 keys and values with a float32 scale per
    # head and position take (16 + 4) / (16 * 4) of float32's bytes.
    assert record["cache_ratio"] == pytest.approx(20 / 64, rel=0.01)
    assert record["cache_at_most_half"] and record["param_ratio"] < 0.5


def test_step_ops_counts_each_op_without_the_ops_it_encloses():
    """A while loop (0-100 ns) enclosing two ops (10-40 and 50-70), one of them enclosing a
    third (55-60), then an op of its own (200-210): each keeps only its own time."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.step_ops import kind, self_times

    events = [(0, 100, "while.1"), (10, 30, "dot.3"), (50, 20, "fusion.2"), (55, 5, "copy"),
              (200, 10, "copy.7")]
    assert self_times(events) == {"while.1": 50, "dot.3": 30, "fusion.2": 15, "copy": 5,
                                  "copy.7": 10}
    assert [kind(name) for name in ("copy_bitcast_fusion.12", "dot", "add.5")] == [
        "copy_bitcast_fusion", "dot", "add"]


@pytest.mark.slow
def test_step_ops_traces_the_tiny_step_and_names_its_sources():
    """The script end to end on tiny.py: op kinds whose shares sum to 1, and top ops that name
    where in the model they come from."""
    result = subprocess.run([sys.executable, "benchmarks/step_ops.py", "--config=configs/tiny.py",
                             "--steps=2", "--warmup=1", "--top=5"], cwd=ROOT,
                            env=one_cpu_device_env(), capture_output=True, text=True,
                            timeout=600, check=True)
    row = json.loads(result.stdout.splitlines()[-1])
    assert sum(k["share"] for k in row["kinds"]) == pytest.approx(1.0)
    assert row["op_ms_per_step"] > 0 and len(row["top"]) == 5
    assert any("/" in op["source"] for op in row["top"]), row["top"]  # a module path
