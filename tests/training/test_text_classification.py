"""Text classification: the classifier's pooling and head against numpy, its parameters those of
a masked LM plus the head, the loss and accuracy against numpy, the `offline_help_topics` source
on the committed fixture, and a masked LM fine-tuned through the loop with `init_from`."""

import collections
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.checkpoint import checkpointer
from transformer.config import resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.offline import help_paragraphs
from transformer.data.text_classification import TextClassificationSource
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer
from transformer.parallel import sharding
from transformer.training import loop, train_state

FIXTURE = pathlib.Path(__file__).parents[1] / "data" / "offline_help_topics"
TINY = dict(vocab_size=40, num_encoder_layers=2, num_decoder_layers=0, d_model=16, d_ff=32,
            num_heads=2, num_kv_heads=1, positional="rope", norm="rms_norm",
            norm_position="pre", activation="swiglu", use_bias=False, dropout_rate=0.0,
            max_len=16, num_classes=5)  # mlm_default's block, shrunk
# configs/help_topics.py (and mlm_default.py, its model) shrunk to seconds
SHRUNK_MODEL = {"model.d_model": 32, "model.d_ff": 64, "model.num_heads": 2,
                "model.num_kv_heads": 1, "model.num_encoder_layers": 1}


def _with_random_head(params, rng):
    """The zero-initialised head replaced by random values (zero logits would test nothing)."""
    head = params["head"]
    kernel = rng.normal(size=head["kernel"].shape).astype(np.float32)
    bias = rng.normal(size=head["bias"].shape).astype(np.float32)
    return params | {"head": {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}}


def _tokens():
    """[4, 8] inputs: padded rows, and a row of padding alone (an eval padding row)."""
    return np.array([[5, 9, 12, 3, 0, 0, 0, 0],
                     [7, 7, 30, 21, 14, 8, 11, 3],
                     [6, 3, 0, 0, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0]], np.int32)


@pytest.mark.parametrize("pooling", ["gap", "cls"])
def test_classify_is_the_pooled_encoder_state_through_the_head(pooling):
    config = TransformerConfig(architecture="classifier", pooling=pooling, **TINY)
    model = Transformer(config)
    tokens = _tokens()
    params = nn.unbox(model.init(jax.random.key(0), tokens, None)["params"])
    assert not np.any(model.apply({"params": params}, tokens, method="classify"))  # zero head
    params = _with_random_head(params, np.random.default_rng(1))
    logits = np.asarray(model.apply({"params": params}, tokens, method="classify"))
    encoded = np.asarray(model.apply({"params": params}, tokens, method="encode"), np.float64)
    kernel, bias = (np.asarray(params["head"][k], np.float64) for k in ("kernel", "bias"))
    for row, ids in enumerate(tokens):
        valid = ids != 0
        if pooling == "cls":
            pooled = encoded[row, 0]
        else:
            pooled = encoded[row, valid].mean(0) if valid.any() else np.zeros(config.d_model)
        np.testing.assert_allclose(logits[row], pooled @ kernel + bias, rtol=1e-5, atol=1e-5)
        if valid.any():  # padding changes nothing: the row alone, unpadded, gives the same
            alone = model.apply({"params": params}, ids[valid][None], method="classify")
            np.testing.assert_allclose(np.asarray(alone)[0], logits[row], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(logits))


def test_the_classifier_is_the_masked_lms_encoder_plus_a_head():
    """Same paths and shapes as architecture "encoder" (a masked LM run), plus head/*: what
    lets `init_from` load a masked LM into it, leaving only the head fresh."""
    def shapes(architecture):
        model = Transformer(TransformerConfig(architecture=architecture, **TINY))
        params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), _tokens(),
                                         _tokens())["params"])
        return {checkpointer.path_name(path): leaf.shape
                for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}

    classifier = shapes("classifier")
    encoder = shapes("encoder")
    head = {k: v for k, v in classifier.items() if k not in encoder}
    assert head == {"head/kernel": (16, 5), "head/bias": (5,)}
    assert {k: v for k, v in classifier.items() if k in encoder} == encoder


def _numpy_sums(logits, labels, eps):
    """Smoothed cross-entropy and top-1 hits over rows with label >= 0 (ties: lower class)."""
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = correct = 0.0
    for row, label in zip(log_p, labels, strict=True):
        if label >= 0:
            q = np.full(row.shape, eps / row.size)
            q[label] += 1 - eps
            loss += -(q * row).sum()
            correct += min(range(row.size), key=lambda c: (-row[c], c)) == label
    return loss, correct


def test_text_loss_and_accuracy_against_numpy(load_config):
    """The sharded eval step's sums and the train step's (smoothed) loss on a text batch, over
    8 devices, against numpy from the unsharded logits; label -1 rows left out."""
    cfg = load_config("help_topics.py", **SHRUNK_MODEL | {
        "data.vocab_size": 40, "model.max_len": 16, "model.num_classes": 5,
        "data.batch_size": 8, "mesh.data": 4, "mesh.fsdp": 2, "label_smoothing": 0.1})
    run = resolve(cfg, 8)
    trainer = train_state.build_trainer(run, sharding.make_mesh(cfg.mesh))
    state = train_state.init_state(trainer, 0)
    params = _with_random_head(jax.device_get(state.params), np.random.default_rng(2))
    rng = np.random.default_rng(3)
    tokens = np.concatenate([_tokens(), rng.integers(5, 40, (4, 8)).astype(np.int32)])
    tokens[5, 6:] = 0
    labels = np.array([4, 0, 2, -1, 1, 3, 3, 0], np.int32)
    logits = np.asarray(Transformer(run.model).apply({"params": params}, tokens,
                                                     method="classify"), np.float64)
    batch = train_state.global_batch(trainer.mesh, {"inputs": tokens[None], "label": labels[None]})
    placed = jax.device_put(params, trainer.state_shardings.params)
    sums = jax.device_get(train_state.make_eval_step(trainer)(placed, batch))
    loss, correct = _numpy_sums(logits, labels, 0.0)
    np.testing.assert_allclose(sums["nll_sum"], loss, rtol=1e-5)
    assert (sums["tokens"], sums["correct"]) == (7.0, correct)
    assert 0 < correct < 7 and "top5_correct" not in sums  # 5 classes: no top-5
    state = state.replace(params=placed)
    _, step_metrics = train_state.make_train_step(trainer, run.config)(state, batch)
    smoothed, _ = _numpy_sums(logits, labels, 0.1)
    np.testing.assert_allclose(float(step_metrics["loss"]), smoothed / 7, rtol=1e-5)
    assert float(step_metrics["sequence_tokens"]) == 7.0  # labelled rows


@pytest.fixture(scope="module")
def help_data_dir(offline_data_dir):
    return offline_data_dir("offline_help_topics")


def _source(data_dir, **overrides):
    kwargs = dict(vocab_size=120, max_length=12, batch_size=8, grad_accum_steps=2,
                  eval_batch_size=8, seed=0, data_dir=str(data_dir)) | overrides
    return TextClassificationSource("offline_help_topics", **kwargs)


def test_the_source_tokenizes_one_labelled_example_a_row(help_data_dir, tmp_path):
    source = _source(help_data_dir, workdir=str(tmp_path))
    assert source.class_names == help_paragraphs.LABELS and source.validation_split == "validation"
    expected = help_paragraphs.split_examples(help_paragraphs.labelled_pairs(str(FIXTURE)))
    rows, labels = source.split("train")
    assert len(rows) == len(expected["train"])
    wanted = collections.Counter()  # the fixture's texts, tokenized as the docstring says
    for example in expected["train"]:
        ids = source.tokenizer.encode([example["text"]])[0] + [tokenizer_lib.EOS_ID]
        if len(ids) > 12:
            ids = ids[:11] + [tokenizer_lib.EOS_ID]
        wanted[tuple(ids + [0] * (12 - len(ids))), example["label"]] += 1
    assert collections.Counter(
        (tuple(r.tolist()), int(label)) for r, label in zip(rows, labels, strict=True)) == wanted
    assert any(r[-1] == tokenizer_lib.EOS_ID for r in rows)  # some were cut
    # batch i is a pure function of (seed, i); processes' rows are slices of the same batch
    batch = source.train_batch(5, (0, 4))
    assert batch["inputs"].shape == (2, 4, 12) and batch["label"].shape == (2, 4)
    again = _source(help_data_dir, workdir=str(tmp_path))  # reuses <workdir>/vocab/
    assert again.tokenizer.sha256 == source.tokenizer.sha256
    halves = [again.train_batch(5, r) for r in ((0, 2), (2, 4))]
    for key in ("inputs", "label"):
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves], 1), batch[key])
    assert not np.array_equal(source.train_batch(6, (0, 4))["inputs"], batch["inputs"])
    epoch = np.concatenate([source.batch_positions(i) for i in range(source.batches_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch) == 8 * (len(rows) // 8)
    # evaluation: the split once, padding rows labelled -1
    eval_rows, eval_labels = source.split("validation")
    batches = list(source.eval_batches("validation", (0, 8)))
    got = np.concatenate([b["label"][0] for b in batches])
    assert len(eval_rows) % 8 and len(got) == 8 * -(-len(eval_rows) // 8)
    np.testing.assert_array_equal(got[:len(eval_rows)], eval_labels)
    assert np.all(got[len(eval_rows):] == -1)
    assert not batches[-1]["inputs"][0, len(eval_rows) % 8:].any()


def test_bad_settings_are_one_line_before_tokenizing(help_data_dir):
    with pytest.raises(ValueError, match="model.num_classes=3 but offline_help_topics has 8"):
        _source(help_data_dir, num_classes=3)
    with pytest.raises(ValueError, match="data.text_feature='body' is not a feature"):
        _source(help_data_dir, text_feature="body")
    with pytest.raises(ValueError, match="imdb_reviews is not prepared"):
        TextClassificationSource("imdb_reviews", vocab_size=120, max_length=12, batch_size=8,
                                 data_dir=str(help_data_dir))


@pytest.mark.slow  # two runs: pretraining, then fine-tuning
def test_a_masked_lm_fine_tuned_through_the_loop(load_config, offline_fixture_data_dir,
                                                 help_data_dir, tmp_path, caplog):
    """A tiny masked LM (2 updates) on the offline corpus fixture, then fine-tuned on the help
    topics fixture with init_from over 8 devices: only the head starts fresh, the vocabulary is
    the pretrained run's, the train loss falls from ln 8 and validation reports accuracy."""
    common = SHRUNK_MODEL | {"data.vocab_size": 120, "model.max_len": 32,
                             "checkpoint_every_minutes": 0, "log_every_steps": 5}
    pretrained = tmp_path / "mlm"
    loop.train_and_evaluate(load_config("mlm_default.py", **common | {
        "data.data_dir": str(offline_fixture_data_dir), "data.max_length": 32,
        "data.batch_size": 8, "num_train_steps": 2, "optimizer.warmup_steps": 1,
        "eval_every_steps": 0, "checkpoint_every_steps": 0}), str(pretrained))
    finetuned = tmp_path / "help_topics"
    cfg = load_config("help_topics.py", **common | {
        "init_from": str(pretrained), "data.data_dir": str(help_data_dir),
        "data.max_length": 24, "data.batch_size": 16, "data.eval_batch_size": 16,
        "num_train_steps": 30, "eval_every_steps": 30, "checkpoint_every_steps": 0,
        "optimizer.warmup_steps": 3, "optimizer.learning_rate": 3e-3,
        "mesh.data": 4, "mesh.fsdp": 2})
    with caplog.at_level("INFO", logger="transformer"):
        loop.train_and_evaluate(cfg, str(finetuned))
    assert "2 left fresh, 0 not used\n  left fresh in head (2): bias, kernel\n" in caplog.text
    vocab = "vocab/sentencepiece.model"
    assert (finetuned / vocab).read_bytes() == (pretrained / vocab).read_bytes()
    lines = [json.loads(line) for line in (finetuned / "metrics.jsonl").read_text().splitlines()]
    train = [m["loss"] for m in lines if m["split"] == "train"]
    assert len(train) == 30 and train[0] == pytest.approx(np.log(8), rel=1e-4)  # zero head
    assert np.mean(train[-5:]) < np.mean(train[:5]) - 0.1
    (validation,) = [m for m in lines if m["split"] == "validation"]
    size = len(help_paragraphs.split_examples(help_paragraphs.labelled_pairs(str(FIXTURE)))[
        "validation"])
    assert validation["accuracy"] * size == pytest.approx(round(validation["accuracy"] * size),
                                                          abs=1e-6)
    assert set(validation) == {"step", "split", "loss", "accuracy"}
