"""`train.py --config=configs/lm_files.py` on a glob of jsonl.zst shards: 2 processes x 4
devices train as 1 x 8 does (each process packing its own group of rows, data.pack_groups=2),
and a run killed (SIGKILL) right after a checkpoint resumes with
bit-identical losses (the machinery of tests/training/test_multihost.py)."""

import importlib.util
import pathlib

import numpy as np
import pytest
from test_data_files import documents, write_shards

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "multihost", ROOT / "tests/training/test_multihost.py")
multihost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multihost)


@pytest.mark.slow
def test_a_file_source_trains_alike_on_1x8_and_2x4_and_resumes_after_kill9(tmp_path):
    write_shards(tmp_path / "train", documents(800), shards=8, nested=True)
    write_shards(tmp_path / "validation", documents(40, seed=1), shards=2, nested=True)
    shrink = {"data.dataset": f"jsonl:{tmp_path}/train/*.jsonl.zst",
              "data.eval_dataset": f"jsonl:{tmp_path}/validation/*.jsonl.zst",
              "data.text_field": "meta.text", "data.shuffle_window": 2, "data.pack_groups": 2,
              "data.vocab_size": 64, "data.max_length": 32, "model.max_len": 32,
              "data.batch_size": 8, "model.d_model": 32, "model.d_ff": 64, "model.num_heads": 2,
              "model.num_kv_heads": 1, "model.num_decoder_layers": 1,
              "optimizer.warmup_steps": 1, "num_train_steps": 6, "eval_every_steps": 6,
              "checkpoint_every_steps": 3, "checkpoint_every_minutes": 0, "log_every_steps": 1}
    overrides = ["--config=configs/lm_files.py",
                 *(f"--config.{key}={value}" for key, value in shrink.items())]
    run = dict(overrides=overrides, common=())
    multihost.finish(multihost.launch(tmp_path / "one", processes=1, devices=8, **run))
    multihost.finish(multihost.launch(tmp_path / "two", processes=2, devices=4, **run))
    one = multihost.figures(tmp_path / "one")
    two = multihost.figures(tmp_path / "two")
    assert sorted(one) == sorted(two) == [*((s, "train") for s in range(1, 7)),
                                          (6, "validation")]
    np.testing.assert_allclose([two[k] for k in sorted(two)], [one[k] for k in sorted(one)],
                               rtol=1e-5)
    killed = tmp_path / "killed"
    procs = multihost.launch(killed, processes=1, devices=8, faults={0: "killafter@3"}, **run)
    procs[0].wait(timeout=600)
    assert procs[0].returncode == -9, multihost.output_of(procs[0])[-2000:]
    multihost.finish(multihost.launch(killed, processes=1, devices=8, **run))
    assert multihost.figures(killed) == one  # bit-identical after the kill
