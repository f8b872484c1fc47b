"""Per-layer health (training/health.py): norms grouped by layer and module kind, computed in the
train step on logged steps, on train lines, and naming where a non-finite step went wrong."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import resolve
from transformer.data import make_source
from transformer.parallel import sharding
from transformer.training import health, loop, train_state

U = 2.0**-24  # float32 unit roundoff


def numpy_norms(tree, group_of, counts=None) -> dict[str, float]:
    """{group: float64 norm} of a nested dict of arrays, grouped by `group_of(path)`; the
    elements of each group are added to `counts` when given."""
    squares: dict[str, float] = {}

    def walk(node, path):
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, (*path, key))
        else:
            group = group_of(path)
            squares[group] = squares.get(group, 0.0) + float(
                np.sum(np.square(np.asarray(node, np.float64))))
            if counts is not None:
                counts[group] = counts.get(group, 0) + np.size(node)

    walk(tree, ())
    return {group: math.sqrt(value) for group, value in squares.items()}


def expected_group(path) -> str:
    """The grouping of docs/reliability.md, written out by hand for the trees below."""
    kinds = {"self_attention": "attention", "cross_attention": "attention",
             "ffn": "feed_forward", "moe": "experts", "norm_attention": "norms",
             "norm_ffn": "norms", "norm": "norms", "embedding": "embeddings",
             "logits": "embeddings", "logits_bias": "embeddings"}
    if path[0] in ("encoder", "decoder"):
        if path[1].startswith("layers_"):
            return f"{path[0]}/{path[1]}/{kinds[path[2]]}"
        return f"{path[0]}/{kinds[path[1]]}"
    return kinds[path[0]]


def test_group_norms_split_layers_and_kinds_as_numpy_does():
    """A tree with an unscanned encoder and a scanned decoder (3 layers on a leading axis):
    each `layers_{i}/{kind}` group's norm is numpy's norm of its leaves (the scanned ones
    sliced at i); a stack's own norm and projection and the embedding have their groups."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.normal(size=shape).astype(np.float32)

    encoder = {f"layers_{i}": {"self_attention": {"query": {"kernel": r(4, 2, 2)},
                                                  "out": {"bias": r(4)}},
                               "ffn": {"ff_in": {"kernel": r(4, 8)}},
                               "norm_attention": {"scale": r(4)}} for i in range(2)}
    scanned = {"self_attention": {"query": {"kernel": r(3, 4, 2, 2)}},
               "cross_attention": {"key": {"kernel": r(3, 4, 2, 2)}},
               "moe": {"ff_in": r(3, 2, 4, 8), "router": {"kernel": r(3, 4, 2)}},
               "norm_ffn": {"scale": r(3, 4)}}
    tree = {"embedding": {"embedding": r(10, 4)},
            "encoder": {**encoder, "norm": {"scale": r(4)}},
            "decoder": {"layers": scanned, "logits": {"kernel": r(4, 10)}, "logits_bias": r(10)}}
    unstacked = {**tree, "decoder": {"logits": tree["decoder"]["logits"],
                                     "logits_bias": tree["decoder"]["logits_bias"],
                                     **{f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], scanned)
                                        for i in range(3)}}}
    expected = numpy_norms(unstacked, expected_group)

    got = health.per_layer(jax.device_get(jax.jit(lambda t: jax.tree.map(
        jnp.sqrt, health.group_squares(t)))(tree)))
    assert list(got) == [  # model order: embeddings, the encoder's layers, the decoder's
        "embeddings", "encoder/layers_0/attention", "encoder/layers_0/feed_forward",
        "encoder/layers_0/norms", "encoder/layers_1/attention", "encoder/layers_1/feed_forward",
        "encoder/layers_1/norms", "encoder/norms", "decoder/layers_0/attention",
        "decoder/layers_0/experts", "decoder/layers_0/norms", "decoder/layers_1/attention",
        "decoder/layers_1/experts", "decoder/layers_1/norms", "decoder/layers_2/attention",
        "decoder/layers_2/experts", "decoder/layers_2/norms", "decoder/embeddings"]
    # float32 squares summed in some order: relative error at most n*u for n elements (the
    # largest group holds 2x4x8 + 4x2 = 72 per layer), halved by the square root; x4 margin.
    for group, value in got.items():
        assert value == pytest.approx(expected[group], rel=4 * 72 * U), group


@pytest.fixture(scope="module")
def one_step(load_config):
    """A 1-layer tiny model without dropout, logging every 2 steps: (trainer, config, params
    and batch of step 1, the metrics of steps 1 and 2, the params after step 1, the step)."""
    cfg = load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "model.dropout_rate": 0.0, "log_every_steps": 2})
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    resolved = resolve(cfg, 1)
    trainer = train_state.build_trainer(resolved, mesh)
    step_fn = train_state.make_train_step(trainer, resolved.config)
    source = make_source(cfg)
    batches = [train_state.global_batch(mesh, source.train_batch(i, (0, 16))) for i in (0, 1)]
    state = train_state.init_state(trainer, cfg.seed)
    before = jax.device_get(state.params)
    state, first = step_fn(state, batches[0])
    after = jax.device_get(state.params)
    state, second = step_fn(state, batches[1])
    return (trainer, resolved.config, before, batches[0], jax.device_get((first, second)),
            after, step_fn)


def test_the_step_logs_numpy_norms_of_params_gradients_and_updates(one_step):
    trainer, cfg, before, batch, (first, second), after, _ = one_step
    assert not bool(first["health_logged"]) and bool(second["health_logged"])  # every 2nd
    assert all(not np.any(v) for v in jax.tree.leaves(first["health"]))  # not computed

    # step 1's norms, computed as on a logged step: the same function the step runs
    micro = jax.tree.map(lambda x: x[0], batch)
    total = jnp.maximum(train_state.loss_weights(batch).sum(), 1.0)

    def loss(params):
        sums, _ = train_state._loss_sums(trainer, params, micro,
                                         label_smoothing=float(cfg.label_smoothing),
                                         z_loss=0.0, dropout_rng=None)
        return sums.loss_sum / total

    grads = jax.device_get(jax.jit(jax.grad(loss))(before))
    updates = jax.tree.map(lambda a, b: a - b, after, before)
    logged = jax.device_get(jax.jit(health.group_norms)(before, grads, updates))
    figures = health.line_figures(logged)
    counts: dict[str, int] = {}
    for quantity, tree in (("param_norm", before), ("grad_norm", grads),
                           ("update_norm", updates)):
        expected = numpy_norms(tree, health.group_of, counts)
        assert {k.split("/", 1)[1] for k in figures if k.startswith(quantity)} == set(expected)
        for group, value in expected.items():
            # float32 sums of squares of n elements: relative error at most n*u, halved by
            # the root; x2 margin
            assert figures[f"{quantity}/{group}"] == pytest.approx(
                value, rel=counts[group] // 3 * U), group
    largest = sum(counts.values()) // 3
    assert "grad_norm/decoder/layers_0/attention" in figures
    assert "param_norm/encoder/layers_0/feed_forward" in figures
    # The groups add up to the global gradient norm the step logged
    total_norm = math.sqrt(sum(v**2 for k, v in figures.items() if k.startswith("grad_norm/")))
    assert total_norm == pytest.approx(float(first["grad_norm"]), rel=largest * U)
    # And the step's own figures of step 2 are on its train line
    writer = _Lines()
    loop._flush([(1, first), (2, second)], _Progress(), writer, 2, 10, 1.0, None, cfg, None)
    lines = {step: values for step, _, values in writer.lines}
    assert not any("/" in key for key in lines[1])
    assert set(health.line_figures(second["health"])) <= set(lines[2])
    assert lines[2]["update_norm/decoder/layers_0/norms"] > 0


def test_a_nan_in_one_layer_is_named_in_the_stop_line(one_step):
    trainer, cfg, _, batch, _, _, step_fn = one_step
    state = train_state.init_state(trainer, cfg.seed)
    kernel = state.params["decoder"]["layers_0"]["ffn"]["ff_in"]["kernel"]
    params = jax.tree.map(lambda x: x, state.params)
    params["decoder"]["layers_0"]["ffn"]["ff_in"]["kernel"] = kernel.at[3, 5].set(jnp.nan)
    _, metrics = step_fn(state.replace(params=params), batch)
    with pytest.raises(loop.NonFiniteLoss, match=r"^step 4: loss nan .*\(a parameter in "
                                                 r"decoder/layers_0/feed_forward is not finite"):
        loop._flush([(4, jax.device_get(metrics))], _Progress(), _Lines(), 4, 10, 1.0, None,
                    cfg, 2)


@pytest.mark.parametrize("loss,norms,where", [
    (float("nan"), {"param_norm": {"decoder/layers/norms": np.array([1.0, np.inf])}},
     "a parameter in decoder/layers_1/norms"),
    (float("inf"), {"param_norm": {"embeddings": 1.0}}, "the loss is not finite"),
    (2.0, {"param_norm": {"embeddings": 1.0},
           "grad_norm": {"encoder/layers_3/attention": np.nan, "embeddings": np.nan}},
     "the gradient is first not finite in embeddings"),
    (2.0, {"update_norm": {"decoder/layers_0/norms": 1.0, "encoder/layers_1/experts": np.nan}},
     "the update is first not finite in encoder/layers_1/experts"),
])
def test_locate_nonfinite_names_the_first_group_and_what(loss, norms, where):
    assert health.locate_nonfinite(loss, norms).startswith(where)


def test_visualize_curves_draws_each_layer_by_kind(tmp_path, monkeypatch):
    """`visualize curves` writes curves_layers.png beside curves.png: a panel per quantity and
    kind, a line per layer with that layer's logged values."""
    from absl import flags

    from transformer import visualize
    from transformer.util import plotting

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "split": "train", "loss": 3.0 / s, "steps_per_sec": 1.0,
              "grad_norm/decoder/layers_0/attention": 1.0 * s,
              "grad_norm/decoder/layers_1/attention": 2.0 * s,
              "grad_norm/embeddings": 0.5, "param_norm/decoder/layers_1/norms": 4.0}
             for s in (10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plt = plotting.pyplot()
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.update(
        {ax.get_title(): ax for ax in fig.axes}))
    flags.FLAGS(["visualize", f"--workdir={run}"])
    try:
        written = visualize.run("curves", [])
    finally:
        flags.FLAGS.unparse_flags()
    assert written == [str(run / "plots" / "curves.png"), str(run / "plots" / "curves_layers.png")]
    assert (run / "plots" / "curves_layers.png").exists()
    attention = {line.get_label(): list(line.get_ydata())
                 for line in drawn["gradient norm: attention"].get_lines()}
    assert attention == {"decoder/layers_0": [10.0, 20.0], "decoder/layers_1": [20.0, 40.0]}
    assert [line.get_label() for line in drawn["gradient norm: embeddings"].get_lines()] == [
        "model"]
    assert [line.get_label() for line in drawn["parameter norm: norms"].get_lines()] == [
        "decoder/layers_1"]


class _Progress:
    unit = "tok"

    def add_tokens(self, tokens):
        pass

    def report(self, step):
        return {"tokens_per_sec": 1.0, "steps_per_sec": 1.0, "data_wait_fraction": 0.0}


class _Lines:
    def __init__(self):
        self.lines = []

    def write(self, step, split, values):
        self.lines.append((step, split, values))
