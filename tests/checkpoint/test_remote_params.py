"""A run's params read from gs:// (init_from, averaging, `evaluate`) equal those read from its
local copy; training checkpoints and what evaluating writes (metrics, the confusion matrix) land
in the bucket.

Orbax reads a gs:// checkpoint's arrays with tensorstore's own GCS client, which an fsspec
filesystem cannot serve; so `disk_bucket` (the conftest `bucket` fixture, its store moved)
keeps the fake bucket in a local folder that both see: etils.epath's fsspec backend, and
tensorstore's kvstore for gs://.
"""

import json
import logging
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from transformer.checkpoint import averaging
from transformer.checkpoint.checkpointer import Checkpointer, list_steps
from transformer.inference import translator
from transformer.training import evaluation, transfer
from transformer.util import plotting

REMOTE = "gs://bucket/run"


@pytest.fixture
def disk_bucket(bucket, tmp_path, monkeypatch):
    """gs://bucket/... served from `<tmp_path>/gs/bucket/...`, to epath and to orbax alike;
    returns that folder. The working directory is an empty one, which nothing may write in."""
    from etils.epath import backend
    from fsspec.implementations.local import LocalFileSystem
    from orbax.checkpoint._src.path import gcs_utils

    root = tmp_path / "gs"

    def local(path: str) -> str:
        return str(root / str(path).split("://", 1)[1]).rstrip("/")

    class Bucket(LocalFileSystem):
        protocol = ("gs", "gcs")

        @classmethod
        def _strip_protocol(cls, path):
            return local(path) if "://" in str(path) else super()._strip_protocol(path)

        def glob(self, path, **kwargs):  # names in the bucket, as gcsfs gives them
            return [name.removeprefix(f"{root}/") for name in super().glob(path, **kwargs)]

    monkeypatch.setattr(backend.fsspec_backend, "_get_filesystem",
                        lambda name: Bucket(auto_mkdir=True))  # as a bucket has no folders
    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs",
                        lambda path: {"driver": "file", "path": local(path)})
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return root / "bucket"


def _equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _copied_run(local, disk_bucket):
    """The local run copied into gs://bucket/run, then a params series added to both: step 1's
    params, and at step 3 those plus one (returned)."""
    shutil.copytree(local, disk_bucket / "run")
    at_step_1 = averaging.load_params(str(local))
    series_params = jax.tree.map(lambda x: x + 1, at_step_1)
    for workdir in (str(local), REMOTE):
        series = averaging.ParamsSeries(workdir, every_minutes=1.0, keep=2, use_async=False)
        series.save(1, at_step_1)
        series.save(3, series_params)
        series.close()
    return series_params


def test_init_from_gs_loads_what_the_local_copy_gives(untrained_translation_workdir, tmp_path,
                                                      disk_bucket):
    local = tmp_path / "local"
    shutil.copytree(untrained_translation_workdir, local)
    series_params = _copied_run(local, disk_bucket)
    assert (disk_bucket / "run" / "params" / "3").is_dir()  # written through gs://
    at_step_1 = averaging.load_params(str(local), step=1)
    assert not np.array_equal(jax.tree.leaves(at_step_1)[0], jax.tree.leaves(series_params)[0])
    forms = {"": series_params, ":1": at_step_1, "/checkpoints/1": at_step_1,
             "/params/3": series_params}
    for suffix, want in forms.items():
        remote = transfer.parse(REMOTE + suffix)
        there = transfer.parse(f"{local}{suffix}")
        assert remote == transfer.InitSource(REMOTE, there.step)
        _equal(transfer._read(remote), want)
    # the average of steps 1 and 3, written into the bucket, then named as init_from
    averaged = averaging.average_checkpoints(REMOTE, last=2, name="two")
    assert averaged == f"{REMOTE}/averaged/two" and (disk_bucket / "run/averaged/two").is_dir()
    assert transfer.parse(averaged) == transfer.InitSource(REMOTE, params_dir=averaged)
    want = averaging.load_averaged(averaging.average_checkpoints(str(local), last=2))
    _equal(transfer._read(transfer.parse(averaged)), want)
    np.testing.assert_allclose(jax.tree.leaves(want)[0], jax.tree.leaves(at_step_1)[0] + 0.5,
                               rtol=1e-6)
    assert list((tmp_path / "cwd").iterdir()) == []


def test_params_step_and_averages_on_gs_equal_the_local_copys(untrained_translation_workdir,
                                                              tmp_path, disk_bucket):
    local = tmp_path / "local"
    shutil.copytree(untrained_translation_workdir, local)
    _copied_run(local, disk_bucket)
    for kwargs, step in (({}, 3), ({"step": 1}, 1), ({"average": 2}, 3)):
        assert averaging.params_step(REMOTE, **kwargs) == step
        assert averaging.params_step(str(local), **kwargs) == step
        _equal(averaging.load_params(REMOTE, **kwargs), averaging.load_params(str(local),
                                                                             **kwargs))
    assert (disk_bucket / "run/averaged/last2_step3").is_dir()  # computed in the bucket
    # what `evaluate` reads of a translation run: config, vocabulary and params
    remote = translator.load(REMOTE, step=1)
    there = translator.load(str(local), step=1)
    _equal(remote.params, there.params)
    assert remote.config == there.config and remote.tokenizer.sha256 == there.tokenizer.sha256
    assert list((tmp_path / "cwd").iterdir()) == []


def test_training_checkpoints_are_saved_to_and_restored_from_gs(disk_bucket, tmp_path):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.array(4)}
    checkpointer = Checkpointer(REMOTE, keep=1)
    checkpointer.save(4, state, {"next_batch_index": 5})
    checkpointer.wait()
    assert checkpointer.directory == f"{REMOTE}/checkpoints"
    assert list_steps(checkpointer.directory) == [4]
    assert (disk_bucket / "run/checkpoints/4").is_dir()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    step, restored, data = checkpointer.restore_latest(abstract)
    checkpointer.close()
    assert step == 4 and data == {"next_batch_index": 5}
    _equal(restored, state)
    assert list((tmp_path / "cwd").iterdir()) == []


def test_a_damaged_checkpoint_on_gs_is_moved_aside_and_the_one_before_restores(disk_bucket,
                                                                              tmp_path, caplog):
    def state(step):
        return {"w": jnp.arange(6.0).reshape(2, 3) + step, "step": jnp.array(step)}

    checkpointer = Checkpointer(REMOTE, keep=5)
    for step in (1, 2):
        checkpointer.save(step, state(step), {"next_batch_index": step})
    checkpointer.close()
    manifest = disk_bucket / "run/checkpoints/2/state/manifest.ocdbt"
    manifest.write_bytes(manifest.read_bytes()[:manifest.stat().st_size // 2])

    def files(directory):
        return {str(p.relative_to(directory)): p.read_bytes()
                for p in sorted(directory.rglob("*")) if p.is_file()}

    damaged = files(disk_bucket / "run/checkpoints/2")
    checkpointer = Checkpointer(REMOTE, keep=5)
    with caplog.at_level(logging.WARNING, logger="transformer"):
        step, restored, data = checkpointer.restore_latest(
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state(0)))
    assert (step, data) == (1, {"next_batch_index": 1})
    _equal(restored, state(1))
    (warning,) = [r.getMessage() for r in caplog.records
                  if r.levelno == logging.WARNING and r.name == "transformer"]
    assert warning.startswith("checkpoint 2 does not restore (")
    assert warning.endswith(f"moved to {REMOTE}/skipped_checkpoints/2; trying the previous one")
    # kept byte for byte in the bucket, gone from checkpoints/
    assert files(disk_bucket / "run/skipped_checkpoints/2") == damaged
    assert not (disk_bucket / "run/checkpoints/2").exists() and checkpointer.all_steps() == [1]
    checkpointer.save(2, state(2), {"next_batch_index": 2})  # training goes on past it
    checkpointer.close()
    assert list_steps(f"{REMOTE}/checkpoints") == [1, 2]
    assert list((tmp_path / "cwd").iterdir()) == []


def test_init_from_a_gs_run_without_a_checkpoint_is_one_line(untrained_translation_workdir,
                                                             disk_bucket):
    epath.Path(f"{REMOTE}/vocab").mkdir(parents=True)
    shutil.copy(untrained_translation_workdir / "config.json", disk_bucket / "run")
    for spec in (REMOTE, f"{REMOTE}:1"):
        with pytest.raises(ValueError) as error:
            transfer.parse(spec)
        assert str(error.value) == (
            f"init_from={spec!r}: {REMOTE} holds no checkpoint (no finished step in "
            f"checkpoints/ or params/): give a run that has saved one, or train it first")
    shutil.copytree(untrained_translation_workdir / "checkpoints", disk_bucket / "run/checkpoints")
    with pytest.raises(ValueError, match=r"^init_from='gs://bucket/run:2': step 2 is not saved "
                                         r"in gs://bucket/run \(it holds 1\): give one of those$"):
        transfer.parse(f"{REMOTE}:2")
    with pytest.raises(ValueError, match="is not a training workdir"):
        transfer.parse("gs://bucket/elsewhere")


def test_evaluating_a_gs_vision_run_writes_its_figures_and_plot_there(untrained_vision_workdir,
                                                                      disk_bucket, monkeypatch):
    shutil.copytree(untrained_vision_workdir, disk_bucket / "run")
    rng = np.random.default_rng(3)
    images = rng.standard_normal((1, 4, 28, 28, 1)).astype(np.float32)
    labels = np.array([[0, 3, 9, -1]], np.int32)
    config = json.loads((untrained_vision_workdir / "config.json").read_text())
    source = types.SimpleNamespace(
        class_names=config["provenance"]["images"]["class_names"], dataset="fake",
        eval_rows_per_batch=4, eval_batches=lambda split, rows: iter(
            [{"image": images, "label": labels}]))
    monkeypatch.setattr(evaluation, "make_source", lambda cfg, workdir: source)
    figures = evaluation.evaluate_run(REMOTE, "test")
    (line,) = [json.loads(text) for text in
               (disk_bucket / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 1 and line["split"] == "test" and figures["checkpoint"] == "step1"
    assert line["accuracy"] == pytest.approx(figures["accuracy"])
    assert 3 * line["accuracy"] == pytest.approx(round(3 * line["accuracy"]))  # 3 labelled
    record = json.loads((disk_bucket / "run/eval/confusion_test.json").read_text())
    assert sum(map(sum, record["counts"])) == 3  # the labelled rows
    assert not (disk_bucket / "run/plots").exists()  # the evaluate command draws it


@pytest.mark.parametrize("remote", [False, True])
def test_the_confusion_plot_lands_in_the_workdir_whatever_its_scheme(remote, bucket, tmp_path,
                                                                     monkeypatch):
    """The matrix kept in eval/ and the figure drawn from it in plots/, local or gs://."""
    monkeypatch.chdir(tmp_path)  # a remote workdir must create nothing here
    workdir = "gs://bucket/run" if remote else str(tmp_path / "run")
    record, path = evaluation.confusion_files(workdir, "test")
    confusion = np.array([[2, 1], [0, 3]])
    assert evaluation.save_confusion(workdir, "test", confusion, ["a", "b"], "t") == record
    assert plotting.plot_confusion_matrix(record, path) == path
    image = epath.Path(path).read_bytes()
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 1000
    assert [p.name for p in epath.Path(path).parent.iterdir()] == ["confusion_test.png"]
    assert json.loads(epath.Path(record).read_text())["counts"] == [[2, 1], [0, 3]]
    if remote:
        assert list(tmp_path.iterdir()) == [] and sorted(bucket) == sorted([record, path])
