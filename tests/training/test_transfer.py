"""`init_from` (transformer/training/transfer.py): parameters from another run, matched by path,
placed in the new run's sharding; the vocabulary carried over."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from etils import epath

from transformer.checkpoint import averaging, checkpointer
from transformer.config import resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.parallel import sharding
from transformer.training import train_state, transfer


def _fresh_params(workdir, mesh_shape, **model_overrides):
    """Params of the pretrained run's config (with overrides) placed on a mesh: random values
    in the shardings the train state gives them (no init compiled: tests stay fast)."""
    with open(workdir / "config.json") as f:
        cfg = json.load(f)
    cfg["model"].update(model_overrides)
    from ml_collections import ConfigDict

    n = int(np.prod(list(mesh_shape.values())))
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:n])
    trainer = train_state.build_trainer(resolve(ConfigDict(cfg), n), mesh)
    rng = np.random.default_rng(7)
    return jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype),
                                                 a.sharding), trainer.abstract_state.params)


def test_parse_the_three_forms_and_refuse_others(untrained_translation_workdir, tmp_path):
    root = str(untrained_translation_workdir)
    assert transfer.parse(root) == transfer.InitSource(root)
    assert transfer.parse(f"{root}:1") == transfer.InitSource(root, 1)
    assert transfer.parse(f"{root}/checkpoints/1") == transfer.InitSource(root, 1)
    averaged = averaging.average_checkpoints(root, last=1, name="one")
    assert transfer.parse(averaged) == transfer.InitSource(root, params_dir=averaged)
    with pytest.raises(ValueError, match="is not a training workdir"):
        transfer.parse(str(tmp_path))
    with pytest.raises(ValueError, match=r"give the workdir .*, .*:<step>, or a directory"):
        transfer.parse(f"{root}/vocab")


@pytest.mark.parametrize("mesh_shape", [{"data": 1, "fsdp": 1, "tensor": 1},
                                        {"data": 2, "fsdp": 2, "tensor": 2}])
def test_loaded_params_equal_the_checkpoints_in_the_new_sharding(untrained_translation_workdir,
                                                                  mesh_shape):
    root = str(untrained_translation_workdir)
    saved = averaging.load_params(root)
    fresh = _fresh_params(untrained_translation_workdir, mesh_shape)
    params, left_fresh = transfer.load(transfer.parse(root), fresh)
    assert left_fresh == []
    for got, want, new in zip(jax.tree.leaves(params), jax.tree.leaves(saved),
                              jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding == new.sharding and got.dtype == new.dtype
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh),
                                                        jax.tree.leaves(saved), strict=True))


def test_a_scanned_model_starts_from_a_per_layer_run(untrained_translation_workdir):
    root = str(untrained_translation_workdir)
    fresh = _fresh_params(untrained_translation_workdir, {"data": 1, "fsdp": 1, "tensor": 1},
                          scan_layers=True)
    params, _ = transfer.load(transfer.parse(root), fresh)
    want = checkpointer.stack_layers(averaging.load_params(root))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, want)


def test_new_parameters_stay_fresh_and_are_listed(untrained_translation_workdir, caplog):
    fresh = _fresh_params(untrained_translation_workdir, {"data": 1, "fsdp": 1, "tensor": 1},
                          tie_output_embedding=False)
    with caplog.at_level("INFO", logger="transformer"):
        params, left_fresh = transfer.load(transfer.parse(str(untrained_translation_workdir)),
                                           fresh)
    assert left_fresh == ["decoder/logits/kernel"]
    np.testing.assert_array_equal(params["decoder"]["logits"]["kernel"],
                                  fresh["decoder"]["logits"]["kernel"])
    assert "1 left fresh, 0 not used\n  left fresh in decoder (1): logits/kernel\n" in (
        caplog.text)


def test_the_log_counts_the_parameters_and_groups_them_by_module_and_layer(
        untrained_translation_workdir, caplog):
    """A pretrained run of 2 + 2 layers into one of 1 + 4, its first decoder layer's ffn
    excluded: the log's first line counts the parameters loaded, left fresh and not used; then
    a line per kind and module (wrapped) names each sublayer once for all its layers."""
    root = str(untrained_translation_workdir)
    fresh = _fresh_params(untrained_translation_workdir, {"data": 1, "fsdp": 1, "tensor": 1},
                          num_encoder_layers=1, num_decoder_layers=4)
    with caplog.at_level("INFO", logger="transformer"):
        _, left_fresh = transfer.load(transfer.parse(root), fresh, exclude="^decoder/layers_0/ffn/")
    assert len(left_fresh) == 2 * 26 + 4  # 26 parameters a decoder layer, 4 in its ffn
    assert caplog.records[-1].getMessage() == (
        f"init_from {root}: {len(jax.tree.leaves(fresh)) - 56} parameters loaded, 56 left "
        f"fresh, 16 not used\n"
        "  left fresh in decoder (56): layers_{0,2,3}/ffn/*, layers_{2-3}/cross_attention/*,\n"
        "    layers_{2-3}/norm_attention/*, layers_{2-3}/norm_cross/*, layers_{2-3}/norm_ffn/*,\n"
        "    layers_{2-3}/self_attention/*\n"
        "  not used in encoder (16): layers_1/ffn/*, layers_1/norm_attention/*, "
        "layers_1/norm_ffn/*,\n"
        "    layers_1/self_attention/*")


def test_excluded_parameters_stay_fresh(untrained_translation_workdir):
    root = str(untrained_translation_workdir)
    saved = averaging.load_params(root)
    fresh = _fresh_params(untrained_translation_workdir, {"data": 1, "fsdp": 1, "tensor": 1})
    params, left_fresh = transfer.load(transfer.parse(root), fresh, exclude="^decoder/layers_1/")
    assert left_fresh and all(name.startswith("decoder/layers_1/") for name in left_fresh)
    for (path, got), want, new in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                      jax.tree.leaves(saved), jax.tree.leaves(fresh),
                                      strict=True):
        name = checkpointer.path_name(path)
        expected = new if name.startswith("decoder/layers_1/") else want
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    with pytest.raises(ValueError, match=r"init_from_exclude='\^decoder/logits' matches no "
                                         r"parameter of this model"):
        transfer.load(transfer.parse(root), fresh, exclude="^decoder/logits")


def test_a_shape_that_differs_is_one_line(untrained_translation_workdir):
    fresh = _fresh_params(untrained_translation_workdir, {"data": 1, "fsdp": 1, "tensor": 1},
                          d_ff=48)
    with pytest.raises(ValueError, match=r"coder/layers_0/ffn/ff_in/bias has shape \(128,\) "
                                         r"there but \(48,\) in this model; fine-tune a model"):
        transfer.load(transfer.parse(str(untrained_translation_workdir)), fresh)


def test_the_vocabulary_is_carried_over_and_guarded(untrained_translation_workdir, tmp_path):
    source = transfer.parse(str(untrained_translation_workdir))
    size = tokenizer_lib.Tokenizer.load(
        str(untrained_translation_workdir / "vocab" / "sentencepiece.model")).vocab_size
    with pytest.raises(ValueError, match=f"has a {size}-piece vocabulary but "
                                         f"data.vocab_size=500: set --config.data.vocab_size"):
        transfer.copy_vocabulary(source, str(tmp_path / "new"), 500)
    assert not os.path.exists(tmp_path / "new")  # nothing written before the check
    transfer.copy_vocabulary(source, str(tmp_path / "new"), size)
    assert _files(tmp_path / "new" / "vocab") == _files(untrained_translation_workdir / "vocab")
    transfer.copy_vocabulary(source, str(tmp_path / "new"), size)  # again: unchanged, fine
    other = tokenizer_lib.train([f"other words {i} here" for i in range(300)], size, seed=1)
    shutil.rmtree(tmp_path / "new" / "vocab")
    other.save(str(tmp_path / "new" / "vocab"))
    with pytest.raises(ValueError, match="is not init_from's vocabulary"):
        transfer.copy_vocabulary(source, str(tmp_path / "new"), size)


def _files(directory) -> dict[str, bytes]:
    """{name: bytes} of each file in `directory` (local or gs://)."""
    return {path.name: path.read_bytes() for path in epath.Path(directory).iterdir()}


@pytest.mark.parametrize("remote", ["pretrained", "new"])
def test_the_vocabulary_is_copied_from_or_to_gs(remote, untrained_translation_workdir, bucket,
                                                tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a remote workdir must create nothing here
    vocab = untrained_translation_workdir / "vocab"
    size = tokenizer_lib.load(str(vocab)).vocab_size
    if remote == "pretrained":
        for name, data in _files(vocab).items():
            epath.Path(f"gs://bucket/pretrained/vocab/{name}").write_bytes(data)
        source = transfer.InitSource("gs://bucket/pretrained")
        workdir = str(tmp_path / "new")
    else:
        source = transfer.parse(str(untrained_translation_workdir))
        workdir = "gs://bucket/new"
    written = []  # the names in the order they were written
    write = transfer.atomic.write_atomically
    monkeypatch.setattr(transfer.atomic, "write_atomically",
                        lambda path, data: written.append(path.name) or write(path, data))
    transfer.copy_vocabulary(source, workdir, size)
    assert _files(f"{workdir}/vocab") == _files(vocab)
    assert written == ["sentencepiece.vocab", "sentencepiece.model"]  # the model last
    transfer.copy_vocabulary(source, workdir, size)  # again: found, checked, not rewritten
    assert len(written) == 2
    if remote == "new":
        assert sorted(bucket) == ["gs://bucket/new/vocab/sentencepiece.model",
                                  "gs://bucket/new/vocab/sentencepiece.vocab"]
        assert list(tmp_path.iterdir()) == []


def test_only_the_vocabularys_own_files_are_copied(untrained_translation_workdir, tmp_path):
    pretrained = tmp_path / "pretrained"
    shutil.copytree(untrained_translation_workdir, pretrained)
    vocab = pretrained / "vocab"
    own = _files(vocab) | {"info.json": b'{"seed": 0}'}  # a vocabulary trained here records how
    (vocab / "info.json").write_bytes(own["info.json"])
    # what else a run's vocab/ holds: its data's records, and what a crashed writer left
    (vocab / "rows-0123abcd.json").write_text('{"rows": [3, 4]}')
    (vocab / "tokens" / "wmt14_translate-de-en-train").mkdir(parents=True)
    (vocab / "tokens" / "wmt14_translate-de-en-train" / "meta.json").write_text("{}")
    (vocab / "sentencepiece.model.tmp4242").write_bytes(b"half a model")
    (vocab / "info.json.tmp4242").write_bytes(b"{")
    size = tokenizer_lib.load(str(vocab)).vocab_size
    transfer.copy_vocabulary(transfer.parse(str(pretrained)), str(tmp_path / "new"), size)
    assert _files(tmp_path / "new" / "vocab") == own
    assert sorted(own) == ["info.json", "sentencepiece.model", "sentencepiece.vocab"]


def _tiny(**overrides):
    from conftest import _load_config

    # one layer each side at width 32 (4 heads, so tensor 2 still splits them): three runs
    # compile, and what is loaded, left fresh and resumed is the same at any size
    base = {"num_train_steps": 4, "checkpoint_every_steps": 2, "eval_every_steps": 0,
            "log_every_steps": 1, "data.batch_size": 16, "model.num_encoder_layers": 1,
            "model.num_decoder_layers": 1, "model.d_model": 32, "model.d_ff": 64}
    return _load_config("tiny.py", **(base | overrides))


@pytest.mark.slow
def test_a_run_starts_from_another_once_then_resumes_from_its_own(tmp_path, caplog):
    from transformer.training.loop import train_and_evaluate

    pretrained = tmp_path / "pretrained"
    train_and_evaluate(_tiny(), str(pretrained))
    finetuned = tmp_path / "finetuned"
    frozen = {"init_from": f"{pretrained}:4", "num_train_steps": 2, "mesh.data": 2,
              "mesh.fsdp": 2, "mesh.tensor": 2, "optimizer.learning_rate": 1e-30,
              "model.tie_output_embedding": False}
    with caplog.at_level("INFO", logger="transformer"):
        train_and_evaluate(_tiny(**frozen), str(finetuned))
    assert "1 left fresh, 0 not used\n  left fresh in decoder (1): logits/kernel\n" in (
        caplog.text)
    want = averaging.load_params(str(pretrained), step=4)
    got = averaging.load_params(str(finetuned), step=2)  # updates of ~1e-30: unchanged
    for path in ("encoder", "decoder/layers_0", "embedding"):
        a = got
        b = want
        for key in path.split("/"):
            a, b = a[key], b[key]
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-20), a, b)
    shutil.rmtree(pretrained)  # resuming reads the run's own checkpoint, never init_from
    train_and_evaluate(_tiny(**frozen | {"num_train_steps": 3}), str(finetuned))
    assert checkpointer.list_steps(str(finetuned / "checkpoints"))[-1] == 3


@pytest.mark.slow  # two runs: span corruption, then translation
def test_a_span_corruption_run_fine_tunes_on_translation(load_config, offline_fixture_data_dir,
                                                        tmp_path, caplog):
    """configs/t5_default.py (2 updates), then configs/t5_translate.py from it, both shrunk:
    the encoder and embeddings are the pretrained run's and the decoder starts fresh (the
    config's init_from_exclude, chosen on validation), its vocabulary (with the sentinels) is
    the translation run's, and the translation loss falls."""
    from transformer.training.loop import train_and_evaluate

    common = {"model.d_model": 32, "model.d_ff": 64, "model.num_heads": 2,
              "model.num_kv_heads": 1, "model.num_encoder_layers": 1,
              "model.num_decoder_layers": 1, "data.vocab_size": 200, "data.max_length": 32,
              "data.data_dir": str(offline_fixture_data_dir), "data.batch_size": 8,
              "optimizer.warmup_steps": 1, "checkpoint_every_steps": 0,
              "checkpoint_every_minutes": 0, "log_every_steps": 5}
    pretrained = tmp_path / "t5"
    train_and_evaluate(load_config("t5_default.py", **common | {
        "data.num_sentinels": 10, "num_train_steps": 2, "eval_every_steps": 0}), str(pretrained))
    finetuned = tmp_path / "translate"
    cfg = load_config("t5_translate.py", **common | {
        "init_from": str(pretrained), "data.tokens_per_batch": 256, "data.eval_batch_size": 8,
        "num_train_steps": 20, "eval_every_steps": 20, "bleu_every_steps": 0,
        "optimizer.learning_rate": 3e-3})
    with caplog.at_level("INFO", logger="transformer"):
        train_and_evaluate(cfg, str(finetuned))
    (message,) = [r.getMessage() for r in caplog.records if "parameters loaded" in r.msg]
    header, *groups = message.splitlines()
    assert header.endswith(", 0 not used")
    assert [g for g in groups if not g.startswith("    ")] == groups[:1]  # decoder's alone
    assert groups[0].startswith("  left fresh in decoder (") and "logits/kernel" in message
    vocab = "vocab/sentencepiece.model"
    assert (finetuned / vocab).read_bytes() == (pretrained / vocab).read_bytes()
    lines = [json.loads(line) for line in (finetuned / "metrics.jsonl").read_text().splitlines()]
    train = [m["loss"] for m in lines if m["split"] == "train"]
    assert len(train) == 20 and np.mean(train[-5:]) < np.mean(train[:5]) - 0.2
    assert [m["step"] for m in lines if m["split"] == "validation"] == [20]
