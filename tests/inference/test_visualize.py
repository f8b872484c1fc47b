"""transformer.visualize: the plotted attention weights are the forward pass's own, and every
figure kind is written; bad input ends in one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from transformer import visualize  # noqa: E402
from transformer.inference import attention_maps  # noqa: E402
from transformer.inference.translator import load  # noqa: E402
from transformer.model.transformer import Transformer  # noqa: E402
from transformer.ops import attention
from transformer.training import curves  # noqa: E402
from transformer.util import plotting  # noqa: E402

SOURCE = "Sie geht oft ins Kino."
TARGET = "She goes often to the movies."
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def translator(untrained_translation_workdir):
    return load(str(untrained_translation_workdir))


@pytest.fixture(scope="module")
def maps(translator):
    return attention_maps.attention_maps(translator, SOURCE, TARGET)


def test_plotted_weights_reproduce_the_attention_outputs_of_the_forward_pass(translator, maps):
    calls = []

    def recording_attention(q, k, v, *, mask=None, **kwargs):
        out = attention.dot_product_attention(q, k, v, mask=mask, **kwargs)
        calls.append((np.asarray(v[0]), np.asarray(out[0])))
        return out

    source_ids = translator.encode([SOURCE])[0]
    target_ids = translator.tokenizer.encode([TARGET])[0] + [3]
    Transformer(translator.model_config, attention_fn=recording_attention).apply(
        {"params": translator.params}, np.asarray([source_ids]), np.asarray([target_ids]))
    cfg = translator.model_config
    order = ([("encoder_self_attention", i) for i in range(cfg.num_encoder_layers)]
             + [(kind, i) for i in range(cfg.num_decoder_layers)
                for kind in ("decoder_self_attention", "cross_attention")])
    assert len(calls) == len(order)
    for (kind, layer), (v, out) in zip(order, calls, strict=True):
        weights = maps.weights[kind][layer]  # [N, T, S]
        np.testing.assert_allclose(np.einsum("nts,snh->tnh", weights, v), out, atol=1e-5,
                                   err_msg=f"{kind} layer {layer}")


def test_weights_are_distributions_and_the_decoder_never_looks_ahead(maps):
    s = len(maps.source_pieces)
    t = len(maps.target_pieces)
    assert maps.weights["encoder_self_attention"].shape[2:] == (s, s)
    assert maps.weights["decoder_self_attention"].shape[2:] == (t, t)
    assert maps.weights["cross_attention"].shape[2:] == (t, s)
    for weights in maps.weights.values():
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
        assert (weights >= 0).all()
    future = np.triu(np.ones((t, t), bool), 1)
    assert (maps.weights["decoder_self_attention"][..., future] == 0).all()
    assert maps.source_pieces[-1] == "</s>" and maps.decoder_input_pieces[0] == "<s>"
    assert maps.decoder_input_pieces[1:] == maps.target_pieces[:-1]


def test_attention_figures_are_written_for_every_layer_and_head(maps, tmp_path):
    written = plotting.plot_attention(maps, str(tmp_path))
    layers, heads = maps.weights["cross_attention"].shape[:2]
    assert len(written) == 3 * (layers * heads + 1)
    for kind in attention_maps.KINDS:
        assert (tmp_path / f"{kind}.png").read_bytes().startswith(PNG)
        assert (tmp_path / kind / f"layer{layers}_head{heads}.png").stat().st_size > 1000


def test_curves_of_two_runs_keep_the_last_line_per_step(tmp_path):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        run = tmp_path / name
        run.mkdir()
        lines = [{"step": s, "split": "train", "loss": scale * 5 / s, "learning_rate": 1e-3,
                  "tokens_per_sec": 1000.0} for s in range(1, 11)]
        lines += [{"step": 10, "split": "validation", "loss": 9.0, "perplexity": 8103.0},
                  {"step": 10, "split": "validation", "loss": scale, "perplexity": 2.7,
                   "bleu": 12.5, "bleu_signature": "nrefs:1"}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    found = curves.read_metrics(str(tmp_path / "b"))
    assert found["validation"]["loss"] == [(10, 2.0)]
    assert found["validation"]["bleu"] == [(10, 12.5)]
    assert "bleu_signature" not in found["validation"]
    runs = curves.collect([str(tmp_path / "a"), str(tmp_path / "b")])
    out = plotting.plot_curves(runs, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG) and out.endswith("curves.png")


def drawn_axes(run, lines, monkeypatch, tmp_path, **kwargs) -> dict:
    """Writes `lines` as `run`'s metrics.jsonl, draws its curves, returns the axes by title."""
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plt = plotting.pyplot()
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.update(
        {ax.get_title(): ax for ax in fig.axes}))
    plotting.plot_curves(curves.collect([str(run)], **kwargs), str(tmp_path / "curves.png"),
                         **kwargs)
    return drawn


def test_curves_draw_a_classifiers_accuracy(tmp_path, monkeypatch):
    """A text classifier's validation accuracy gets its own panel, on the axes titled so."""
    run = tmp_path / "classifier"
    run.mkdir()
    lines = [{"step": s, "split": "validation", "loss": 1.0 / s, "accuracy": 0.5 + s / 10_000}
             for s in (200, 400, 600)]
    drawn = drawn_axes(run, lines, monkeypatch, tmp_path)
    (line,) = drawn["accuracy (a classifier)"].get_lines()
    assert list(line.get_xdata()) == [200, 400, 600]
    np.testing.assert_allclose(line.get_ydata(), [0.52, 0.54, 0.56])


def test_curves_of_a_routed_run_draw_the_expert_loads_and_drops(tmp_path, monkeypatch):
    """A routed run (docs/moe.md) gets a third row: the most- and least-loaded experts' shares
    and the dropped assignments; a dense run keeps two rows without them."""
    run = tmp_path / "routed"
    run.mkdir()
    lines = [{"step": s, "split": "train", "loss": 5.0 / s, "expert_load_max": 0.2 - s / 1000,
              "expert_load_min": 0.05 + s / 1000, "moe_dropped": 0.01 * s} for s in (1, 2, 3)]
    drawn = drawn_axes(run, lines, monkeypatch, tmp_path)
    (line,) = drawn["least-loaded expert's share of assignments"].get_lines()
    np.testing.assert_allclose(line.get_ydata(), [0.051, 0.052, 0.053])
    (line,) = drawn["assignments dropped over capacity"].get_lines()
    np.testing.assert_allclose(line.get_ydata(), [0.01, 0.02, 0.03])
    assert len(drawn) == 9
    dense = tmp_path / "dense"
    dense.mkdir()
    drawn = drawn_axes(dense, [{k: v for k, v in line.items() if "expert" not in k
                                and k != "moe_dropped"} for line in lines],
                       monkeypatch, tmp_path)
    assert len(drawn) == 6 and "assignments dropped over capacity" not in drawn


def test_positions_figure(tmp_path):
    out = visualize.plot_positions(64, 50, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes().startswith(PNG) and out.endswith("p.png")
    with pytest.raises(ValueError, match="--d_model=63 must be even"):
        visualize.plot_positions(63, 50, str(tmp_path / "q.png"))


@pytest.mark.parametrize("dpi", [50, 120])
def test_save_writes_the_figure_whole_at_the_dpi_asked(dpi, tmp_path, monkeypatch):
    """A 2 x 1 inch figure is 2 dpi x dpi pixels; the file goes through `atomic` (a reader
    sees the old figure or the new one) and nothing else is left beside it."""
    from matplotlib import image

    written = []
    write = plotting.atomic.write_atomically
    monkeypatch.setattr(plotting.atomic, "write_atomically",
                        lambda path, data: (written.append(path), write(path, data)))
    target = tmp_path / "plots" / "f.png"
    target.parent.mkdir()
    target.write_bytes(b"old")
    fig = plotting.pyplot().figure(figsize=(2, 1))
    assert plotting.save(fig, str(target), dpi=dpi) == str(target)
    assert written == [str(target)]
    assert image.imread(target).shape[:2] == (dpi, 2 * dpi)
    assert [path.name for path in target.parent.iterdir()] == ["f.png"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "transformer.visualize", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["no_run", "empty_source"])
def test_cli_bad_input_is_one_line(case, untrained_translation_workdir, tmp_path):
    if case == "no_run":
        result = run_cli("attention", f"--workdir={tmp_path}", f"--source={SOURCE}")
        expected = "has no config.json"
    else:
        result = run_cli("attention", f"--workdir={untrained_translation_workdir}",
                         "--source=  ")
        expected = "--source is empty"
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last
    assert not (tmp_path / "plots").exists()


def test_attention_rollout_of_a_hand_worked_case():
    """Layer 1: heads I and the cyclic shift P (P[i, i+1] = 1), mean (I + P) / 2, so
    Â1 = 3/4 I + 1/4 P; layer 2: uniform heads U, Â2 = (U + I) / 2. Â2 Â1 = U/2 + 3/8 I + 1/8 P
    (U M = U for the doubly stochastic M)."""
    eye = np.eye(3)
    shift = np.roll(np.eye(3), 1, axis=1)
    uniform = np.full((3, 3), 1 / 3)
    weights = np.array([[eye, shift], [uniform, uniform]])
    rollout = attention_maps.attention_rollout(weights)
    np.testing.assert_allclose(rollout[0], [1 / 6 + 3 / 8, 1 / 6 + 1 / 8, 1 / 6])
    np.testing.assert_allclose(rollout, uniform / 2 + 3 / 8 * eye + 1 / 8 * shift)
    # one layer of uneven heads: the head mean, the identity, rows re-normalised
    head = np.array([[0.2, 0.8, 0.0], [0.5, 0.5, 0.0], [0.1, 0.1, 0.8]])
    np.testing.assert_allclose(attention_maps.attention_rollout(head[None, None])[0],
                               [0.6, 0.4, 0.0])


def test_image_attention_maps_are_the_class_tokens_rows(load_config, tmp_path):
    """A tiny untrained ViT on a 28x28 PNG: per-head maps are row 0 of each layer's weights
    over the 16 patches (a 4x4 grid), the rollout is row 0 of `attention_rollout`, and both
    figures are written."""
    import jax
    from PIL import Image

    from transformer.config import resolve
    from transformer.inference.classifier import Classifier
    from transformer.model.vit import VisionTransformer

    cfg = load_config("vit_fashion_mnist.py", **{
        "model.num_encoder_layers": 2, "model.d_model": 16, "model.d_ff": 32,
        "model.num_heads": 2, "model.scan_layers": True})
    model = resolve(cfg, 1).model
    params = VisionTransformer(model).init(jax.random.key(0), np.zeros((1, 28, 28, 1)))
    params = jax.tree.map(np.asarray, jax.tree.map(
        lambda x: x.value if hasattr(x, "value") else x, params["params"],
        is_leaf=lambda x: hasattr(x, "value")))
    classifier = Classifier(model, params, tuple("abcdefghij"), np.array([0.3]), np.array([0.4]))
    pixels = np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "x.png")
    found = attention_maps.image_attention(classifier, str(tmp_path / "x.png"))
    assert found.weights.shape == (2, 2, 17, 17) and found.grid == 4
    np.testing.assert_allclose(found.weights.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(found.image[..., 0], pixels)
    np.testing.assert_array_equal(found.per_head()[1, 0], found.weights[1, 0, 0, 1:].reshape(4, 4))
    np.testing.assert_allclose(
        found.rollout(), attention_maps.attention_rollout(found.weights)[0, 1:].reshape(4, 4))
    paths = plotting.plot_image_attention(found, str(tmp_path / "out"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["heads.png", "rollout.png"]
    assert all(open(p, "rb").read(8) == PNG for p in paths)


def test_curves_against_hours_of_training(tmp_path, monkeypatch):
    """--x=hours puts each evaluation at the summed time of the train steps before it: 10
    steps at 1,000 tokens/s of 900 target tokens (a log without steps_per_sec), then 10 at 0.5
    steps/s (a masked LM's 450 tokens/s count more than its targets), are 0.0025 h, then
    0.0025 + 20 / 3600 h; an evaluation before any train line sits at 0."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "split": "train", "loss": 5 / s, "target_tokens_per_update": 900.0,
              "tokens_per_sec": 1000.0} for s in range(1, 11)]
    lines += [{"step": s, "split": "train", "loss": 5 / s, "target_tokens_per_update": 135.0,
               "tokens_per_sec": 450.0, "steps_per_sec": 0.5} for s in range(11, 21)]
    lines += [{"step": s, "split": "validation", "loss": 3.0, "perplexity": 20.1}
              for s in (0, 10, 20)]
    drawn = drawn_axes(run, lines, monkeypatch, tmp_path, x="hours")
    (line,) = drawn["perplexity"].get_lines()
    np.testing.assert_allclose(line.get_xdata(), [0.0, 9 / 3600, 9 / 3600 + 20 / 3600])
    assert drawn["perplexity"].get_xlabel().startswith("hours of training")
    (run / "metrics.jsonl").write_text(json.dumps(lines[-1]) + "\n")
    with pytest.raises(ValueError, match="no train lines with their throughput.*--x=step"):
        curves.collect([str(run)], x="hours")


def test_every_figure_lands_in_a_gs_workdir(maps, bucket, tmp_path, monkeypatch):
    from etils import epath

    monkeypatch.chdir(tmp_path)  # a remote workdir must create nothing here
    run = "gs://bucket/run"
    lines = [{"step": s, "split": "train", "loss": 5 / s, "learning_rate": 1e-3} for s in (1, 2)]
    epath.Path(run).mkdir(parents=True)
    epath.Path(f"{run}/metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert curves.read_metrics(run)["train"]["loss"] == [(1, 5.0), (2, 2.5)]
    written = [plotting.plot_curves(curves.collect([run]), f"{run}/plots/curves.png"),
               visualize.plot_positions(8, 10, f"{run}/plots/positions.png")]
    written += plotting.plot_attention(maps, f"{run}/plots/attention")
    rng = np.random.default_rng(0)
    weights = rng.random((2, 2, 5, 5))
    found = attention_maps.ImageAttention(
        rng.integers(0, 255, (8, 8, 1), np.uint8), weights / weights.sum(-1, keepdims=True),
        grid=2, has_class_token=True, predicted="a", probability=0.5)
    written += plotting.plot_image_attention(found, f"{run}/plots/image_attention/x")
    layers, heads = maps.weights["cross_attention"].shape[:2]
    assert len(written) == 2 + 3 * (layers * heads + 1) + 2
    assert sorted(bucket) == sorted([f"{run}/metrics.jsonl", *written])  # no temporary left
    for path in written:
        assert path.startswith(f"{run}/plots/") and bucket[path].getvalue().startswith(PNG)
    assert list(tmp_path.iterdir()) == []
