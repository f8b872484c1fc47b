"""Checkpoint averaging: the mean of the parameter trees, read onto the host from any mesh;
the params-only series; loading params by step or average; one-line errors."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.checkpoint import averaging
from transformer.checkpoint.averaging import ParamsSeries
from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import resolve
from transformer.parallel import sharding
from transformer.training import train_state

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = (10, 20, 30)


def host_params(k: int) -> dict:
    """A small params tree, different for each k (shapes as the model names them)."""
    rng = np.random.default_rng(k)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {"embedding": {"embedding": normal(32, 8)},
            "encoder": {"layers_0": {"ffn": {"ff_in": {"kernel": normal(8, 16),
                                                       "bias": normal(16)}},
                                     "norm_ffn": {"scale": 1.0 + normal(8)}}}}


def sharded_state(mesh, params: dict, step: int) -> train_state.TrainState:
    """A TrainState (with Adam moments) sharded over `mesh` like the real one."""
    def put(x):
        spec = P("fsdp", "tensor") if x.ndim == 2 else P("tensor") if x.ndim else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = jax.tree.map(put, params)
    opt_state = jax.tree.map(put, optax.adam(1e-3).init(params))
    return train_state.TrainState(step=jnp.asarray(step, jnp.int32), params=params,
                                  opt_state=opt_state)


def numpy_mean(trees: list[dict]) -> dict:
    return jax.tree.map(lambda *xs: np.mean(np.stack(xs).astype(np.float64), 0).astype(xs[0].dtype),
                        *trees)


def assert_trees_equal(actual, expected, atol=0.0):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert isinstance(a, np.ndarray) and a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=0, atol=atol)


@pytest.fixture
def workdir(tmp_path):
    """Three checkpoints (steps 10, 20, 30) written from a (data 1, fsdp 2, tensor 4) mesh."""
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4}, jax.devices()[:8])
    checkpointer = Checkpointer(str(tmp_path), keep=5)
    for k, step in enumerate(STEPS, 1):
        checkpointer.save(step, sharded_state(mesh, host_params(k), step),
                          {"next_batch_index": step})
    checkpointer.close()
    return str(tmp_path)


@pytest.mark.parametrize("last", [1, 2, 3])
def test_average_is_the_mean_of_the_parameter_trees(workdir, last):
    path = averaging.average_checkpoints(workdir, last=last)
    assert path == os.path.join(workdir, "averaged", f"last{last}_step30")
    expected = numpy_mean([host_params(k) for k in range(4 - last, 4)])
    averaged = averaging.load_params(workdir, average=last)
    assert_trees_equal(averaged, expected, atol=1e-7)
    metadata = ocp.PyTreeCheckpointer().metadata(path).custom_metadata
    assert metadata == {"source": "checkpoints", "steps": list(STEPS[-last:])}


def test_named_average_and_load_params(workdir):
    path = averaging.average_checkpoints(workdir, last=2, name="final")
    assert path == os.path.join(workdir, "averaged", "final")
    assert os.listdir(os.path.join(workdir, "averaged")) == ["final"]
    assert_trees_equal(averaging.load_params(workdir), host_params(3))  # latest
    assert_trees_equal(averaging.load_params(workdir, step=10), host_params(1))
    # average= computes averaged/last2_step30 when it is missing, then reads it back.
    assert_trees_equal(averaging.load_params(workdir, average=2),
                       numpy_mean([host_params(2), host_params(3)]), atol=1e-7)
    assert sorted(os.listdir(os.path.join(workdir, "averaged"))) == ["final", "last2_step30"]
    # The checkpoints themselves are untouched (averaging is never pruned nor resumed from).
    assert Checkpointer(workdir, keep=5).all_steps() == list(STEPS)


def test_errors(workdir, tmp_path_factory):
    with pytest.raises(ValueError, match=r"cannot average the last 4 checkpoints: .*checkpoints "
                                         r"holds 3 \(steps 10, 20, 30\)$"):
        averaging.average_checkpoints(workdir, last=4)
    with pytest.raises(ValueError, match="last=0"):
        averaging.average_checkpoints(workdir, last=0)
    with pytest.raises(ValueError, match="plain directory name"):
        averaging.average_checkpoints(workdir, last=2, name="../escape")
    with pytest.raises(ValueError, match=r"step=15 is not saved .*holds \[10, 20, 30\]"):
        averaging.load_params(workdir, step=15)
    with pytest.raises(ValueError, match="not both"):
        averaging.load_params(workdir, step=10, average=2)
    empty = str(tmp_path_factory.mktemp("empty"))
    for call in (lambda: averaging.load_params(empty),
                 lambda: averaging.load_params(empty, average=2),
                 lambda: averaging.average_checkpoints(empty, last=2)):
        with pytest.raises(ValueError, match=r"^no checkpoint in .*train first") as info:
            call()
        assert "\n" not in str(info.value)


def test_params_series_keeps_the_last_k_and_is_preferred(workdir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4}, jax.devices()[:8])
    now = [0.0]
    series = ParamsSeries(workdir, every_minutes=10, keep=3, clock=lambda: now[0])
    saved = {}
    for minute in range(0, 61, 5):  # a save due every 10 minutes: 10, 20, ..., 60
        now[0] = 60.0 * minute
        step = 100 + minute
        params = sharded_state(mesh, host_params(step), step).params
        if series.maybe_save(step, params):
            saved[step] = host_params(step)
    series.save(165, sharded_state(mesh, host_params(165), 165).params)  # the final step
    saved[165] = host_params(165)
    series.close()
    assert sorted(saved) == [110, 120, 130, 140, 150, 160, 165]
    assert series.all_steps() == [150, 160, 165]
    assert sorted(os.listdir(os.path.join(workdir, "params"))) == ["150", "160", "165"]
    # The series is preferred over the full checkpoints (steps 10, 20, 30).
    path = averaging.average_checkpoints(workdir, last=3)
    assert path.endswith(os.path.join("averaged", "last3_step165"))
    assert_trees_equal(averaging.load_params(workdir, average=3),
                       numpy_mean([saved[s] for s in (150, 160, 165)]), atol=1e-7)
    assert_trees_equal(averaging.load_params(workdir), saved[165])
    assert_trees_equal(averaging.load_params(workdir, step=20), host_params(2))
    with pytest.raises(ValueError, match=r"params holds 3 \(steps 150, 160, 165\)"):
        averaging.average_checkpoints(workdir, last=5)


def test_real_train_state(tmp_path, load_config):
    """The tiny model's TrainState from build_trainer/init_state on one device."""
    cfg = load_config("tiny.py")
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    state = train_state.init_state(train_state.build_trainer(resolve(cfg, 1), mesh), cfg.seed)
    checkpointer = Checkpointer(str(tmp_path), keep=3)
    trees = []
    for k in (1, 2, 3):
        params = jax.tree.map(lambda p, k=k: p * (1.0 + 0.5 * k) + k, state.params)
        trees.append(jax.device_get(params))
        checkpointer.save(k, state.replace(step=state.step + k, params=params),
                          {"next_batch_index": k})
    checkpointer.close()
    for last in (2, 3):
        averaging.average_checkpoints(str(tmp_path), last=last)
        assert_trees_equal(averaging.load_params(str(tmp_path), average=last),
                           numpy_mean(trees[-last:]), atol=1e-7)
