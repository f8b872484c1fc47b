"""Test setup: 8 fake CPU devices and JAX's persistent compilation cache.

Both must be configured before JAX starts its backend, hence at import time here.
"""

import json
import os
import pathlib
import runpy
import sys

# LLVM's cheapest optimisation for every XLA program of the tests and their subprocesses: the
# suite spends most of its CPU time compiling small programs, and this takes half or more off
# each compile (a tiny train step: 36 -> 14 s for init, compile and 4 steps, on 2 cores) for
# slower machine code, which these tests do not time. Programs compared with each other are
# compiled alike; benchmarks/ and users' runs keep XLA's default.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
# JAX_PLATFORMS=cpu, inherited by the tests' subprocesses, also keeps JAX from probing for a TPU
# where libtpu (the `tpu` extra) is installed; libtpu itself, loaded for compile-only TPU
# devices, may then be loaded by both xdist workers at once (else: a /tmp/libtpu_lockfile error).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Triton (bundled with PyPI's CUDA build of torch; GPU kernels only) segfaults when imported into
# a process that has loaded TensorFlow, as a test worker has by the time a test imports
# transformers, which imports torch._dynamo, which probes for triton. Marked absent here, its
# import raises ImportError and torch carries on without it (seen: triton 3.8, TensorFlow 2.21).
sys.modules.setdefault("triton", None)

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / ".cache" / "jax"
jax.config.update("jax_compilation_cache_dir", str(CACHE_DIR))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(config, items):
    """The modules that hold slow tests first, each module's tests kept together and in order
    (module-scoped fixtures are still built once a worker). xdist's workers take tests in this
    order, so the suite ends on many short tests that both workers share, not on one worker's
    minute-long train.py test while the other sits idle."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the rest keeps its order


def subprocess_env(**overrides) -> dict:
    """The environment of a CLI the tests start: one CPU device (no fake 8), FAST_COMPILE and
    the tests' compilation cache. A CLI started twice on one run (a resume, a second command)
    compiles its programs once. Several processes must not share it (test_multihost.launch)."""
    cache = {"JAX_COMPILATION_CACHE_DIR": str(CACHE_DIR),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE,
                **{**cache, **overrides})


@pytest.fixture
def strict_dtype_promotion():
    """JAX's strict dtype promotion (no implicit int/float or precision mixing), for the pure
    functions: a silent upcast there would be a bug. The Flax modules keep the default."""
    with jax.numpy_dtype_promotion("strict"):
        yield


def _load_config(name: str, **overrides):
    """The config of `configs/<name>` (or of `name`, a path from the repository root) with
    dotted-key overrides, as `--config.<key>=<value>` flags give them."""
    path = ROOT / "configs" / name
    cfg = runpy.run_path(str(path if path.exists() else ROOT / name))["get_config"]()
    for key, value in overrides.items():
        *sections, last = key.split(".")
        target = cfg
        for section in sections:
            target = target[section]
        target[last] = value
    return cfg


@pytest.fixture(scope="session")
def load_config():
    """`load_config("tiny.py", **{"model.d_model": 32})`: a config file with overrides."""
    return _load_config


TRANSLATION_SENTENCES = [
    "Specifies whether the chosen connections are pooled.",
    "She goes often to the movies.",
    "Die gewählten Verbindungen werden aufbewahrt.",
    "Sie geht oft ins Kino.",
    "Opens a dialog where you can select a file.",
    "Öffnet einen Dialog, in dem Sie eine Datei auswählen können.",
] * 20


def byte_level_bpe(texts, *, vocab_size: int, special_tokens=(), added_tokens=()):
    """A byte-level BPE tokenizer (GPT-2's kind) trained by the `tokenizers` library:
    `special_tokens` take the first ids, `added_tokens` the ids after the trained pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if added_tokens:
        tokenizer.add_special_tokens(list(added_tokens))
    return tokenizer


def params_run(workdir: pathlib.Path, cfg, params) -> pathlib.Path:
    """`workdir` (created) as a run holding `params` at step 1 as its params series, with
    config.json from `cfg`: what the Hugging Face export reads."""
    from transformer.checkpoint import averaging, layout

    workdir.mkdir()
    layout.write_config(str(workdir), cfg.to_dict(), {})
    series = averaging.ParamsSeries(str(workdir), every_minutes=1.0, keep=1, use_async=False)
    series.save(1, params)
    series.close()
    return workdir


@pytest.fixture
def bucket(monkeypatch):
    """`gs://` served from memory: etils.epath's fsspec backend given an in-memory filesystem
    (what gcsfs would be against a real bucket), and tensorboardX's gs:// event writer (which
    needs google-cloud-storage) replaced by one that uploads through epath as it does."""
    import types

    from etils import epath
    from etils.epath import backend, gpath
    from fsspec.implementations.memory import MemoryFileSystem
    from tensorboardX import record_writer

    class Bucket(MemoryFileSystem):
        protocol = ("gs", "gcs")
        store = {}
        pseudo_dirs = [""]

    class Events:  # tensorboardX's GCSRecordWriter: the whole file uploaded on each flush
        def __init__(self, path):
            self.path, self.data = epath.Path(path), b""

        def write(self, data):
            self.data += data

        def flush(self):
            self.path.write_bytes(self.data)

        close = flush

    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # else tf.io.gfile serves gs://
    monkeypatch.setattr(backend.fsspec_backend, "_get_filesystem", lambda name: Bucket())
    monkeypatch.setitem(record_writer.REGISTERED_FACTORIES, "gs",
                        types.SimpleNamespace(open=Events, directory_check=lambda path: None))
    return Bucket.store


def _untrained_run(path: pathlib.Path, **overrides) -> pathlib.Path:
    """config.json, vocab/ and one checkpoint of an untrained tiny model (configs/tiny.py with
    a 96-piece vocabulary, max_len 24, and `overrides`) in `path`: what the CLIs read."""
    from transformer.checkpoint.checkpointer import Checkpointer
    from transformer.config import resolve
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.parallel import sharding
    from transformer.training import train_state

    tokenizer = tokenizer_lib.train(TRANSLATION_SENTENCES, 96, seed=0)
    tokenizer.save(str(path / "vocab"))
    cfg = _load_config("tiny.py", **{"data.vocab_size": tokenizer.vocab_size,
                                      "model.max_len": 24, **overrides})
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = train_state.build_trainer(resolve(cfg, 1), mesh)
    checkpointer = Checkpointer(str(path), keep=2)
    checkpointer.save(1, train_state.init_state(trainer, 0), {"next_batch_index": 1})
    checkpointer.close()
    return path


@pytest.fixture(scope="session")
def untrained_translation_workdir(tmp_path_factory):
    """An untrained tiny translation run: what `transformer.load` reads."""
    return _untrained_run(tmp_path_factory.mktemp("untrained_run"),
                          **{"data.target_lang": "de", "decode.max_extra_length": 6})


@pytest.fixture(scope="session")
def untrained_lm_workdir(tmp_path_factory):
    """An untrained tiny decoder-only run: what `transformer.load_generator` reads."""
    return _untrained_run(tmp_path_factory.mktemp("untrained_lm"),
                          **{"model.architecture": "decoder"})


# configs/default.py shrunk to seconds (dotted keys, as --config.<key>=<value> flags take them):
# used in-process (test_train_translation.py) and by train.py processes (test_multihost.py).
SHRUNK_DEFAULT = {
    "data.vocab_size": 200, "data.max_length": 32, "model.max_len": 32, "data.batch_size": 8,
    "data.eval_batch_size": 8, "data.tokens_per_batch": 256, "model.d_model": 32,
    "model.d_ff": 64, "model.num_heads": 2, "model.num_encoder_layers": 1,
    "model.num_decoder_layers": 1, "optimizer.warmup_steps": 1, "eval_every_steps": 2,
    "bleu_every_steps": 2, "bleu_num_sentences": 2, "checkpoint_every_steps": 0,
    "checkpoint_every_minutes": 0, "decode.max_extra_length": 4,
    "model.dropout_rate": 0.1}  # the default trains without; tests keep the dropout rng in play


@pytest.fixture(scope="session")
def offline_data_dir(tmp_path_factory):
    """`offline_data_dir(name)`: a TFDS data_dir holding the offline dataset `name`
    (offline_de_en, offline_fashion_mnist, offline_help_topics), built once a session from its
    committed fixture, tests/data/<name>. The `data` extra is required, not skipped: `make test`
    installs it, so its absence is a broken install to report."""
    import tensorflow_datasets as tfds

    from transformer.data.offline import de_en, fashion_mnist, help_topics

    builders = {"offline_de_en": de_en.OfflineDeEn,
                "offline_fashion_mnist": fashion_mnist.OfflineFashionMnist,
                "offline_help_topics": help_topics.OfflineHelpTopics}
    data_dir = tmp_path_factory.mktemp("offline_tfds")
    built = set()

    def build(name: str) -> pathlib.Path:
        if name not in built:
            manual_dir = ROOT / "tests" / "data" / name
            builders[name](data_dir=str(data_dir)).download_and_prepare(
                file_format="array_record",
                download_config=tfds.download.DownloadConfig(manual_dir=str(manual_dir)))
            built.add(name)
        return data_dir

    return build


@pytest.fixture(scope="session")
def offline_fixture_data_dir(offline_data_dir):
    """A TFDS data_dir holding `offline_de_en` built from the committed help pages
    (tests/data/offline_de_en)."""
    return offline_data_dir("offline_de_en")


VISION_CLASSES = [f"class{i}" for i in range(10)]
VISION_MEAN = 0.25
VISION_STD = 0.4


@pytest.fixture(scope="session")
def untrained_vision_workdir(tmp_path_factory):
    """A tiny ViT run (28x28 grey, 10 classes) whose head is random, not zero, so that the
    probabilities differ between images; config.json records the preprocessing. Evaluated
    without the mirror (the tests that want it set `test_time_flip`)."""
    from transformer.checkpoint.checkpointer import Checkpointer
    from transformer.config import resolve
    from transformer.parallel import sharding
    from transformer.training import train_state

    path = tmp_path_factory.mktemp("vision_run")
    cfg = _load_config("vit_fashion_mnist.py", **{
        "model.num_encoder_layers": 1, "model.d_model": 16, "model.d_ff": 32,
        "model.num_heads": 2, "data.test_time_flip": False})
    provenance = {"images": {"class_names": VISION_CLASSES, "mean": [VISION_MEAN],
                             "std": [VISION_STD]}}
    (path / "config.json").write_text(json.dumps(cfg.to_dict() | {"provenance": provenance}))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = train_state.build_trainer(resolve(cfg, 1), mesh)
    state = train_state.init_state(trainer, 0)
    head = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype),
                        state.params["head"])
    state = state.replace(params=state.params | {"head": head})
    checkpointer = Checkpointer(str(path), keep=1)
    checkpointer.save(1, state, {"next_batch_index": 1})
    checkpointer.close()
    return path


def train_steps(cfg, mesh, num_steps, state=None, first_batch=0):
    """(final state, each step's metrics, trainer) of `num_steps` train steps of `cfg` on
    `mesh`, from `state` (default: a fresh init) and batch `first_batch` on."""
    from transformer.config import resolve
    from transformer.data import make_source
    from transformer.training import train_state

    run = resolve(cfg, mesh.size)
    trainer = train_state.build_trainer(run, mesh)
    if state is None:
        state = train_state.init_state(trainer, cfg.seed)
    step_fn = train_state.make_train_step(trainer, run.config)
    source = make_source(cfg)
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    lines = []
    for index in range(first_batch, first_batch + num_steps):
        state, metrics = step_fn(state, train_state.global_batch(
            mesh, source.train_batch(index, rows)))
        lines.append(jax.device_get(metrics))
    return state, lines, trainer
