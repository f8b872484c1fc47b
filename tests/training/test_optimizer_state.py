"""The optimizer-state choices in the real train step: Adafactor and Muon on a 2x4 mesh against
1x8, and checkpoints of bfloat16 Adam moments, of Adafactor's factored state and of Muon's two
halves that resume bit for bit (in process: saved, restored into the abstract state, continued).
Adafactor's attention kernels against optax's Adafactor on the same kernels stored 2-D, as T5
stored them."""

import functools
import math

import jax
import numpy as np
import optax
import pytest

from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import resolve
from transformer.data import make_source
from transformer.parallel import sharding
from transformer.sizing import flops, summary
from transformer.training import moments, train_state

STEPS = 4

# Two layouts of the same 8 devices sum the gradients, the factored row and column means and
# the global norms in other orders: float32 rounding, a few ulps (1e-7 relative) per sum,
# compounded over STEPS updates whose size Adafactor normalises (a relative change of the
# gradient moves the update by as much). 1e-5 leaves a margin of 10 or more over that.
LAYOUT_RTOL = 1e-5


def small(load_config, **overrides):
    """configs/tiny.py with one layer a side and 16 rows a batch; Adafactor factors its
    [64, 128] feed-forward kernels and [32, 64] embedding (threshold 32)."""
    return load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "model.dropout_rate": 0.0, "optimizer.schedule": "constant",
        "optimizer.warmup_steps": 0, **overrides})


class Mesh:
    """A config's trainer, jitted train step and data on a data x fsdp mesh of 8 devices."""

    def __init__(self, cfg, data: int, fsdp: int):
        cfg.mesh.data, cfg.mesh.fsdp = data, fsdp
        run = resolve(cfg, 8)
        self.mesh = sharding.make_mesh(run.config.mesh, jax.devices()[:8])
        self.trainer = train_state.build_trainer(run, self.mesh)
        self.step_fn = train_state.make_train_step(self.trainer, run.config)
        self.source = make_source(cfg)
        self.seed = cfg.seed

    def run(self, first: int, last: int, state=None):
        """The state after batches first..last-1 from `state` (None: a fresh one) and the
        losses."""
        state = train_state.init_state(self.trainer, self.seed) if state is None else state
        losses = []
        for index in range(first, last):
            batch = self.source.train_batch(index, (0, self.source.rows_per_batch))
            state, metrics = self.step_fn(state, train_state.global_batch(self.mesh, batch))
            losses.append(float(metrics["loss"]))
        return state, losses

    def resumed(self, tmp_path, split: int):
        """STEPS steps with a checkpoint saved after `split`, restored and continued."""
        state, losses = self.run(0, split)
        checkpointer = Checkpointer(str(tmp_path), keep=1, use_async=False)
        checkpointer.save(split, state, {"next_batch": split})
        restored, _ = checkpointer.restore(split, self.trainer.abstract_state)
        checkpointer.close()
        state, more = self.run(split, STEPS, restored)
        return state, losses + more


def assert_states_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def adafactor(load_config):
    return small(load_config, **{"optimizer.name": "adafactor",
                                 "optimizer.learning_rate": 1e-2,
                                 "optimizer.min_dim_size_to_factor": 32})


def test_adafactor_on_2x4_equals_1x8_and_resumes_exactly(load_config, tmp_path):
    one_by_eight = Mesh(adafactor(load_config), 1, 8)
    straight, losses = one_by_eight.run(0, STEPS)
    factored = straight.opt_state[1][0]
    assert factored.v_row["decoder"]["layers_0"]["ffn"]["ff_in"]["kernel"].shape == (64,)
    # The [64, 4, 16] query kernel factored as [64, 64], its statistics sharded as it is.
    query = factored.v_col["decoder"]["layers_0"]["self_attention"]["query"]["kernel"]
    assert query.shape == (64,)
    assert losses[-1] < losses[0]
    resumed, resumed_losses = one_by_eight.resumed(tmp_path, 2)
    assert resumed_losses == losses
    assert_states_equal(resumed, straight)

    state, other_losses = Mesh(adafactor(load_config), 2, 4).run(0, STEPS)
    np.testing.assert_allclose(other_losses, losses, rtol=LAYOUT_RTOL)
    # Absolute: LAYOUT_RTOL of the STEPS updates, each ~1e-3 (lr 1e-2 x the kernels' RMS 0.1),
    # 4e-8. Not the attention's key biases: softmax ignores a shift of the logits, so their
    # gradient is rounding noise, which Adafactor normalises into full steps of either sign.
    expected = dict(jax.tree_util.tree_leaves_with_path(jax.device_get(straight.params)))
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)):
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" not in name:
            np.testing.assert_allclose(leaf, expected[path], rtol=LAYOUT_RTOL, atol=1e-7,
                                       err_msg=name)


def test_bfloat16_moments_resume_exactly(load_config, tmp_path):
    trained = Mesh(small(load_config, **{"optimizer.moments_dtype": "bfloat16"}), 2, 4)
    straight, losses = trained.run(0, STEPS)
    moments = straight.opt_state[1][0]
    assert {leaf.dtype for leaf in jax.tree.leaves((moments.mu, moments.nu))} == {
        np.dtype("bfloat16")}
    resumed, resumed_losses = trained.resumed(tmp_path, 2)
    assert resumed_losses == losses
    assert_states_equal(resumed, straight)


def test_muon_on_2x4_equals_1x8_and_resumes_exactly(load_config, tmp_path):
    """Muon's momentum for the blocks' kernels alone, Adam's moments for the rest, sharded as
    their parameters; a checkpoint of both resumes bit for bit."""
    cfg = small(load_config, **{"optimizer.name": "muon", "optimizer.learning_rate": 1e-2})
    one_by_eight = Mesh(cfg, 1, 8)
    straight, losses = one_by_eight.run(0, STEPS)
    halves = optax.tree.get(straight.opt_state, "PartitionState").inner_states
    muon_state = optax.tree.get(halves["muon"], "MuonState")
    adam_state = optax.tree.get(halves["adam"], "ScaleByAdamState")
    layer = "decoder", "layers_0", "self_attention", "query", "kernel"
    query = functools.reduce(dict.get, layer, muon_state.mu)
    assert query.shape == (64, 4, 16)
    assert query.sharding.spec == straight.params["decoder"]["layers_0"]["self_attention"][
        "query"]["kernel"].sharding.spec
    assert isinstance(functools.reduce(dict.get, layer, adam_state.mu), optax.MaskedNode)
    assert isinstance(muon_state.mu["embedding"]["embedding"], optax.MaskedNode)
    assert adam_state.nu["embedding"]["embedding"].shape == (32, 64)
    assert losses[-1] < losses[0]
    resumed, resumed_losses = one_by_eight.resumed(tmp_path, 2)
    assert resumed_losses == losses
    assert_states_equal(resumed, straight)

    _, other_losses = Mesh(cfg, 2, 4).run(0, STEPS)
    np.testing.assert_allclose(other_losses, losses, rtol=LAYOUT_RTOL)


# Both sides run optax's own arithmetic on the same 2-D values (ours reshapes around it); only
# XLA's order of summation in the row and column means (4096 terms) may differ, each a relative
# 4096 x 2**-24 = 2.4e-4 at worst, typically ~sqrt(4096) x 2**-24 = 4e-6, and the step moves
# with the statistic's -1/2 power. Over 3 steps of size ~lr x RMS (1e-3), 1e-5 of a step is
# 1e-8 absolute: atol 1e-8 on values of ~0.1, rtol 1e-6.
MERGED_RTOL, MERGED_ATOL = 1e-6, 1e-8


def test_adafactor_factors_attention_kernels_as_optax_does_their_2d_form():
    shapes = {"query": ((128, 4, 32), (128, 128)), "out": ((4, 32, 128), (128, 128)),
              "ffn": ((128, 256), (128, 256))}
    keys = jax.random.split(jax.random.key(0), 6)
    params = {name: {"kernel": 0.1 * jax.random.normal(keys[i], shape)}
              for i, (name, (shape, _)) in enumerate(shapes.items())}
    flat = {name: {"kernel": params[name]["kernel"].reshape(flat_shape)}
            for name, (_, flat_shape) in shapes.items()}
    ours, reference = moments.adafactor(lambda _: 1e-2), optax.adafactor(lambda _: 1e-2)
    state, ref_state = ours.init(params), reference.init(flat)
    assert state[0].v_row["query"]["kernel"].shape == (128,)  # not a full [128, 4, 32]
    assert state[0].v["out"]["kernel"].shape == (1,)
    step, ref_step = jax.jit(ours.update), jax.jit(reference.update)
    for key in keys[3:]:
        grads = jax.tree.map(lambda x, k=key: jax.random.normal(k, x.shape), params)
        updates, state = step(grads, state, params)
        ref_updates, ref_state = ref_step(
            jax.tree.map(lambda g, f: g.reshape(f.shape), grads, flat), ref_state, flat)
        params, flat = optax.apply_updates(params, updates), optax.apply_updates(flat, ref_updates)
    for name in shapes:
        np.testing.assert_allclose(params[name]["kernel"].reshape(shapes[name][1]),
                                   flat[name]["kernel"], rtol=MERGED_RTOL, atol=MERGED_ATOL,
                                   err_msg=name)
        np.testing.assert_allclose(state[0].v_col[name]["kernel"],
                                   ref_state[0].v_col[name]["kernel"], rtol=MERGED_RTOL)


def test_scanned_attention_kernels_boxed_are_merged_once_and_named():
    """The trainer's init takes params boxed with axis names; scanned layers put a layer axis
    in front of each kernel. Their heads are merged once, as the unboxed init merges them (a
    second merge would fold the layer axis in), the statistics named as the axes they keep,
    and a step runs."""
    import flax.linen as nn

    names = {"query": ("layers", "embed", "heads", "head_dim"),
             "out": ("layers", "heads", "head_dim", "embed")}
    shapes = {"query": (2, 128, 4, 32), "out": (2, 4, 32, 128)}
    boxed = {name: {"kernel": nn.Partitioned(0.1 * jax.numpy.ones(shapes[name]), names[name])}
             for name in shapes}
    params = nn.unbox(boxed)
    ours = moments.adafactor(lambda _: 1e-2)
    state, plain = ours.init(boxed), ours.init(params)
    for name in shapes:
        for stats in ("v_row", "v_col"):
            box = getattr(state[0], stats)[name]["kernel"]
            assert box.value.shape == getattr(plain[0], stats)[name]["kernel"].shape == (2, 128)
            assert box.names[0] == "layers"
    grads = jax.tree.map(lambda x: jax.numpy.full(x.shape, 0.5), params)
    updates, _ = ours.update(grads, nn.unbox(state), params)
    assert jax.tree.map(lambda x: x.shape, updates) == jax.tree.map(lambda x: x.shape, params)


def test_memory_plan_counts_factored_attention_kernels(load_config):
    """lm_default's Adafactor state: every matrix factored, heads x d_k merged."""
    run = resolve(load_config("lm_default.py", **{"optimizer.name": "adafactor"}))
    params = flops.abstract_params(run.model)
    expected = 3 * 4  # int32 step counts: the statistics', the schedule's, the decay's
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if any(f"['{p}']['kernel']" in name for p in ("query", "key", "value")):
            shape = (*shape[:-2], shape[-2] * shape[-1])
        elif "['out']['kernel']" in name:
            shape = (*shape[:-3], shape[-3] * shape[-2], shape[-1])
        second, largest = sorted(shape)[-2:] if len(shape) > 1 else (0, shape[0])
        expected += (4 * (math.prod(shape) // largest + math.prod(shape) // second) + 4
                     if second >= 128 else 4 * math.prod(shape) + 8)
    assert summary.optimizer_state_bytes(run, params) == expected
    assert expected / flops.param_counts(run.model)["total"] < 0.05


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    jax.clear_caches()
