"""Elastic restart (`elastic=True`, training/elastic.py): a run resumed on fewer devices keeps
its global batch and rows per device by accumulating more microbatches, and its losses are an
uninterrupted run's up to the order of the sums; devices or batches that cannot be fitted are
one line each."""

import json
import logging
import os

import numpy as np
import pytest

from transformer.checkpoint import layout
from transformer.config import resolve
from transformer.training import elastic, loop

SMALL = {"data.batch_size": 16, "model.dropout_rate": 0.0,  # dropout draws depend on the split
         "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
         "model.d_model": 32, "model.d_ff": 64, "log_every_steps": 1, "eval_every_steps": 0,
         "checkpoint_every_steps": 2}


def recorded_run(tmp_path, load_config, num_devices=8, **overrides):
    """A workdir whose config.json records the tiny config resolved on `num_devices`."""
    cfg = load_config("tiny.py", **(SMALL | overrides))
    run = resolve(cfg, num_devices)
    layout.write_config(str(tmp_path), run.config.to_dict(), {"mesh_shape": run.mesh_shape})
    cfg.elastic = True
    return cfg


def test_fewer_devices_accumulate_more_microbatches(tmp_path, load_config, caplog):
    cfg = recorded_run(tmp_path, load_config)  # mesh.data=-1: 8, one microbatch of 2 rows
    with caplog.at_level(logging.INFO, logger="transformer"):
        fitted = elastic.fit(cfg, str(tmp_path), 4)
    assert resolve(fitted, 4).mesh_shape["data"] == 4
    assert fitted.grad_accum_steps == 2 and fitted.data.batch_size == 16
    assert ("elastic: 4 devices (recorded: 8): mesh.data 8 -> 4, grad_accum_steps 1 -> 2; 16 "
            "rows per update as recorded, 2 per device per microbatch") in caplog.text
    # 2 devices: 4 microbatches of 2 rows each; 3 devices would not split the 16 rows
    assert elastic.fit(cfg, str(tmp_path), 2).grad_accum_steps == 4


def test_a_fixed_mesh_that_no_longer_fits_is_shrunk_along_data_and_fsdp(tmp_path, load_config):
    cfg = recorded_run(tmp_path, load_config, **{"mesh.data": 2, "mesh.fsdp": 2,
                                                 "mesh.tensor": 2})
    fitted = elastic.fit(cfg, str(tmp_path), 4)  # data 2 x fsdp 2 x tensor 2 needs 8
    shape = resolve(fitted, 4).mesh_shape
    assert (shape["data"], shape["fsdp"], shape["tensor"]) == (1, 2, 2)
    assert fitted.grad_accum_steps == 2


def test_more_devices_accumulate_fewer_microbatches(tmp_path, load_config):
    cfg = recorded_run(tmp_path, load_config, num_devices=2)  # 2 devices x 8 rows
    assert elastic.fit(cfg, str(tmp_path), 8).grad_accum_steps == 1


def test_off_or_fresh_leaves_the_config_as_given(tmp_path, load_config):
    cfg = recorded_run(tmp_path, load_config)
    cfg.elastic = False
    assert elastic.fit(cfg, str(tmp_path), 4) is cfg
    cfg.elastic = True
    assert elastic.fit(cfg, str(tmp_path / "fresh"), 4) is cfg


@pytest.mark.parametrize("overrides, devices, message", [
    ({"mesh.tensor": 4}, 3, "elastic: 3 devices cannot hold the recorded mesh.tensor=4 (a "
                            "multiple of 4 devices is needed)"),
    ({}, 6, "elastic: data.batch_size=16 does not split over mesh.data x mesh.fsdp x "
            "mesh.expert=6 on the 6 devices left"),
])
def test_devices_the_run_cannot_use_are_one_line(tmp_path, load_config, overrides, devices,
                                                 message):
    cfg = recorded_run(tmp_path, load_config, **overrides)
    with pytest.raises(ValueError) as error:
        elastic.fit(cfg, str(tmp_path), devices)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_fit_stops_train_before_any_work(tmp_path, load_config):
    cfg = recorded_run(tmp_path, load_config, num_devices=4, **{"data.batch_size": 12})
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"^elastic: data.batch_size=12 does not split over "
                                         r"mesh.data x mesh.fsdp x mesh.expert=8 on the 8 "):
        loop.train_and_evaluate(cfg, str(tmp_path))  # the tests' 8 devices
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def train_losses(workdir) -> dict[int, float]:
    found = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["split"] == "train":
                found[record["step"]] = record["loss"]
    return found


@pytest.mark.slow
def test_two_processes_resumed_on_one_with_half_the_devices(tmp_path, load_config):
    """A run of 2 processes x 4 devices that loses a process after step 2 resumes on 1 x 4
    (`mesh.data=8` no longer fits: elastic makes it 4 and accumulates 2 microbatches): each
    process fed half of every global batch, the survivor feeds all of it. Against 4 steps of
    the same config on this process's 8 devices."""
    from test_multihost import finish, launch, output_of

    overrides = {**SMALL, "mesh.data": 8, "elastic": True}
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    reference, workdir = tmp_path / "reference", tmp_path / "elastic"
    loop.train_and_evaluate(load_config("tiny.py", num_train_steps=4, **overrides,
                                        **{"data.eval_examples": 100}), str(reference))
    finish(launch(workdir, processes=2, devices=4,
                  overrides=[*flags, "--config.num_train_steps=2"]))
    procs = launch(workdir, processes=1, devices=4,
                   overrides=[*flags, "--config.num_train_steps=4"])
    finish(procs)
    assert "mesh.data 8 -> 4, grad_accum_steps 1 -> 2" in output_of(procs[0])
    expected, resumed = train_losses(reference), train_losses(workdir)
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4]
    # Steps 3-4 sum the same 16 rows in 2 microbatches on 4 devices instead of 1 on 8: float32
    # rounding of the sums (~1e-7 relative) that Adam (eps 1e-9) may turn into +-lr steps on
    # parameters whose true gradient is ~0 (test_multihost: < 1e-4 over 20 steps); 2 steps at
    # lr <= 2.4e-4 (warmup) stay well inside 1e-4. Steps 1-2: 8 devices over 2 processes
    # against 8 in one, the same sums.
    np.testing.assert_allclose([resumed[s] for s in expected], [expected[s] for s in expected],
                               rtol=1e-4)
