"""Evaluation's per-layer health (training/health.py, the model's `HEALTH` records): attention
logit maxima and activation RMS per layer against numpy, scanned layers split, the reduction over
eval batches, and the eval step's line."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.checkpoint.checkpointer import stack_layers
from transformer.data import make_source
from transformer.model.blocks import DecoderBlock, EncoderBlock, MultiHeadAttention
from transformer.model.records import HEALTH
from transformer.model.transformer import Transformer, TransformerConfig
from transformer.parallel import sharding
from transformer.training import health, train_state

CFG = dict(vocab_size=40, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
           num_decoder_layers=2, max_len=16, dropout_rate=0.0, attention_implementation="xla",
           norm_position="pre")  # pre-LN: a residual stream whose RMS is not 1
SOURCE = np.array([[5, 6, 7, 8, 9, 3], [11, 12, 13, 3, 0, 0]], np.int32)  # 0: padding
TARGET = np.array([[1, 14, 15, 16, 17], [1, 18, 19, 0, 0]], np.int32)
# float32 logits q.k/sqrt(d_k) (d_k = 8 terms) and sums of ~200 squares against float64:
# relative error a few times 200 u ~ 1e-5 with the projections' rounding; 1e-4 leaves margin.
RTOL = 1e-4


def unboxed_params(config: TransformerConfig) -> dict:
    variables = Transformer(config).init(jax.random.key(0), SOURCE, TARGET)
    return nn.meta.unbox(variables["params"])


def health_sums(config: TransformerConfig, params, source=SOURCE, target=TARGET) -> dict:
    _, variables = Transformer(config).apply({"params": params}, source, target,
                                             mutable=[HEALTH])
    return jax.device_get(health.eval_sums(variables))


def recorded(config: TransformerConfig, params):
    """The inputs of every attention call and the output of every block, per layer (per-layer
    layout), recorded by a method interceptor."""
    seen = {"attention": [], "block": []}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name == "__call__" and isinstance(module, MultiHeadAttention):
            seen["attention"].append((module.path, args, kwargs))
        elif context.method_name == "__call__" and isinstance(module,
                                                              (EncoderBlock, DecoderBlock)):
            seen["block"].append((module.path, out[0]))
        return out

    with nn.intercept_methods(record):
        Transformer(config).apply({"params": params}, SOURCE, TARGET)
    return seen


def numpy_health(config: TransformerConfig, params) -> dict:
    """The expected `eval_sums`, in float64 from the params and the recorded inputs: q = x Wq,
    k = kv Wk (no biases on q/k: `use_bias` adds them, so they are added here too), logits
    q.k / sqrt(d_k) over heads and the (query, key) pairs of real tokens (the decoder's
    self-attention causal), and the blocks' sums of squares over real tokens."""
    seen = recorded(config, params)
    d_k = config.d_model // config.num_heads
    expected = {}
    for path, args, _ in seen["attention"]:
        stack, layer, kind = path
        p = params[stack][layer][kind]
        x = np.asarray(args[0], np.float64)
        kv = np.asarray(args[1], np.float64) if len(args) > 1 else x
        q = np.einsum("btd,dnh->btnh", x, np.asarray(p["query"]["kernel"], np.float64))
        k = np.einsum("bsd,dnh->bsnh", kv, np.asarray(p["key"]["kernel"], np.float64))
        if "bias" in p["query"]:
            q = q + np.asarray(p["query"]["bias"], np.float64)
            k = k + np.asarray(p["key"]["bias"], np.float64)
        logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(d_k)
        keys_real = (SOURCE if stack == "encoder" or kind == "cross_attention" else TARGET) != 0
        queries_real = (SOURCE if stack == "encoder" else TARGET) != 0
        allowed = queries_real[:, None, :, None] & keys_real[:, None, None, :]
        if kind == "self_attention" and stack == "decoder":
            t = logits.shape[-1]
            allowed = allowed & np.tril(np.ones((t, t), bool))
        allowed = np.broadcast_to(allowed, logits.shape)
        expected[f"attention_logit_max/{stack}/{layer}/{kind}"] = logits[allowed].max()
    for (stack, layer), out in seen["block"]:
        real = (SOURCE if stack == "encoder" else TARGET) != 0
        out = np.asarray(out, np.float64)
        expected[f"activation_squares/{stack}/{layer}"] = np.sum(np.square(out) * real[..., None])
        expected[f"activation_count/{stack}/{layer}"] = real.sum() * out.shape[-1]
    return expected


@pytest.fixture(scope="module")
def layered():
    config = TransformerConfig(**CFG)
    params = unboxed_params(config)
    return config, params, health_sums(config, params)


def test_logit_maxima_and_squares_per_layer_equal_numpy(layered):
    config, params, got = layered
    expected = numpy_health(config, params)
    assert set(got) == set(expected)
    assert len([k for k in got if k.startswith("attention_logit_max/")]) == 2 + 2 * 2
    for key, value in expected.items():
        assert float(got[key]) == pytest.approx(value, rel=RTOL), key


def test_scanned_layers_give_one_value_per_layer_index(layered):
    """The same params stacked for `scan_layers`: the same keys, one per layer index, and the
    same values as the per-layer layout (checked against numpy above)."""
    config, params, expected = layered
    scanned = TransformerConfig(**CFG, scan_layers=True)
    got = health_sums(scanned, {stack: stack_layers(tree) if stack in ("encoder", "decoder")
                                else tree for stack, tree in params.items()})
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert float(got[key]) == pytest.approx(float(value), rel=RTOL), key


def test_a_scaled_query_kernel_raises_that_layers_maximum(layered):
    config, params, before = layered
    key = "attention_logit_max/decoder/layers_1/self_attention"
    scaled = jax.tree.map(lambda a: a, params)
    query = scaled["decoder"]["layers_1"]["self_attention"]["query"]
    query["kernel"] = query["kernel"] * 10.0
    if "bias" in query:
        query["bias"] = query["bias"] * 10.0
    after = health_sums(config, scaled)
    # q (and so every logit) is 10x: the largest logit is 10x, or a negative one 10x lower
    assert abs(float(after[key])) == pytest.approx(10 * abs(float(before[key])), rel=RTOL)
    assert float(after[key]) > 2 * float(before[key]) > 0
    for other in ("decoder/layers_0/self_attention", "encoder/layers_1/self_attention"):
        assert after[f"attention_logit_max/{other}"] == before[f"attention_logit_max/{other}"]


def test_two_batches_reduce_to_max_of_maxima_and_pooled_rms(layered):
    """Batches of 1 and 2 rows: the logit maximum is the larger, the RMS the square root of the
    pooled mean square (not the mean of the two RMS), as numpy on the rows together."""
    config, params, _ = layered
    one = health_sums(config, params, SOURCE[:1], TARGET[:1])
    two = health_sums(config, params, SOURCE[1:], TARGET[1:])
    both = health_sums(config, params)  # padding excluded: the rows pooled
    totals = {"nll_sum": 1.0, "tokens": 1.0}
    for sums in (one, two):
        totals = health.add_eval_sums(totals, sums)
    figures = train_state.eval_metrics(totals)
    layer = "decoder/layers_1"
    expected_rms = math.sqrt(float(both[f"activation_squares/{layer}"])
                             / float(both[f"activation_count/{layer}"]))
    assert figures[f"activation_rms/{layer}"] == pytest.approx(expected_rms, rel=RTOL)
    mean_of_rms = np.mean([math.sqrt(float(s[f"activation_squares/{layer}"])
                                     / float(s[f"activation_count/{layer}"])) for s in (one, two)])
    assert abs(mean_of_rms - expected_rms) > 100 * RTOL * expected_rms  # the test can tell
    for key in (k for k in both if k.startswith("attention_logit_max/")):
        assert figures[key] == pytest.approx(float(both[key]), rel=RTOL), key
        assert figures[key] == max(float(one[key]), float(two[key]))
    assert not any(k.startswith(("activation_squares/", "activation_count/")) for k in figures)


def test_the_eval_step_returns_the_per_layer_figures(load_config):
    """The jitted eval step of a tiny run carries the keys for every layer; its figures equal
    the model's records under the same params."""
    cfg = load_config("tiny.py", **{"model.num_encoder_layers": 1, "model.num_decoder_layers": 2,
                                    "model.attention_implementation": "xla"})
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    from transformer.config import resolve
    resolved = resolve(cfg, 1)
    trainer = train_state.build_trainer(resolved, mesh)
    state = train_state.init_state(trainer, cfg.seed)
    source = make_source(cfg)
    local = next(iter(source.eval_batches(source.validation_split, (0, 4))))
    sums = jax.device_get(train_state.make_eval_step(trainer)(
        state.params, train_state.global_batch(mesh, local)))
    figures = train_state.eval_metrics(health.add_eval_sums({}, sums))
    for layer in ("encoder/layers_0", "decoder/layers_0", "decoder/layers_1"):
        assert figures[f"activation_rms/{layer}"] > 0
    assert {k for k in figures if k.startswith("attention_logit_max/")} == {
        "attention_logit_max/encoder/layers_0/self_attention",
        *(f"attention_logit_max/decoder/layers_{i}/{kind}" for i in (0, 1)
          for kind in ("self_attention", "cross_attention"))}
    assert all(np.isfinite(v) for v in figures.values())
    assert jnp.isfinite(figures["loss"])


def test_visualize_curves_draws_the_eval_figures_per_layer(tmp_path):
    """`curves.layer_curves` reads the eval lines' keys; `plot_layer_health` draws a line per
    layer in the "eval attention logit max: attention" and "eval activation RMS: residual"
    panels, and no empty eval panels."""
    import json

    from transformer.training import curves
    from transformer.util import plotting

    lines = [{"step": s, "split": "train", "loss": 1.0, "grad_norm/decoder/layers_0/attention": 1.0}
             for s in (10, 20)]
    lines += [{"step": s, "split": "validation", "loss": 1.0,
               "attention_logit_max/decoder/layers_0/self_attention": 1.0 * s,
               "attention_logit_max/decoder/layers_0/cross_attention": -2.0,
               "activation_rms/encoder/layers_0": 3.0, "activation_rms/decoder/layers_1": 4.0}
              for s in (10, 20)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    layers = curves.layer_curves(curves.read_metrics(str(tmp_path)))
    assert layers["attention_logit_max"] == {"attention": {
        "decoder/layers_0 self": [(10, 10.0), (20, 20.0)],
        "decoder/layers_0 cross": [(10, -2.0), (20, -2.0)]}}
    assert list(layers["activation_rms"]["residual"]) == ["encoder/layers_0", "decoder/layers_1"]
    plt = plotting.pyplot()
    drawn = {}
    close = plt.close
    plt.close = lambda fig: drawn.update({ax.get_title(): ax for ax in fig.axes})
    try:
        plotting.plot_layer_health("run", layers, str(tmp_path / "layers.png"))
    finally:
        plt.close = close
    assert [ln.get_label() for ln in drawn["eval activation RMS: residual"].get_lines()] == [
        "encoder/layers_0", "decoder/layers_1"]
    assert len(drawn["eval attention logit max: attention"].get_lines()) == 2
    assert "eval activation RMS: attention" not in drawn  # empty eval panels left out
