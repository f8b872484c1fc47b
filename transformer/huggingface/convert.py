"""Hugging Face checkpoint directories <-> our workdirs.

`import_checkpoint(hf_dir, workdir)` reads a directory as `save_pretrained` writes it
(`config.json`, `model.safetensors` or shards listed in `model.safetensors.index.json`), maps
the config to `model.*` on top of a run config (the family's default config file, or one
given), and places each tensor group straight into its mesh sharding as it is read
(`jax.make_array_from_callback`: a device holds only its shard). The workdir it writes holds
`config.json` (provenance: the source directory and its config) and the parameters as step 0
of the params-only series `params/0/`, which `generate`, `evaluate` and `init_from` read as
any run's. The checkpoint's tokenizer becomes the run's `vocab/` with its own special ids
(`model.bos_id`, `eos_id`, `pad_id` from config.json): `tokenizer.json` through the
`tokenizers` library, else T5's `spiece.model` (as T5Tokenizer reads it, `t5.read_spiece`),
else a SentencePiece `tokenizer.model`. Where the model's embedding has rows past the
tokenizer's pieces (T5's 32128 for 32100), the vocabulary counts them (`data.vocab_size` is
the model's; `vocab/special_ids.json` records them) and its decode drops their ids. The run's
ends are every id `transformers`' `generate` stops at (`generation_config.json`'s
`eos_token_id`, else config.json's: `mapping.end_ids`), for a language model and a translation
model alike; `model.eos_id` is config.json's first and special_ids.json's `eos_ids` records the
others after it.

`export_workdir(workdir, out_dir)` writes a run's parameters back as `config.json` and
`model.safetensors` (float32; shards of at most `max_shard_bytes` and their index beyond that,
as `save_pretrained` writes them) that `transformers`' `from_pretrained` loads, and its
vocabulary as `tokenizer.json` or `tokenizer.model` (and T5's `spiece.model` where the import
read one) with a `tokenizer_config.json` that `AutoTokenizer` reads it by, and a
`generation_config.json` listing the vocabulary's ends where it has more than `model.eos_id`
(with config.json's decoder start and forced end, which `generate` then reads from it). An
earlier export's files in `out_dir` (`EXPORTED_FILES`, any tokenizer kind's) are removed first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import runpy
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from transformer.checkpoint import averaging, checkpointer, layout
from transformer.config import resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.tokenizer import MODEL_FILE
from transformer.huggingface import adapters, families, kept, marian, t5
from transformer.huggingface.mapping import end_ids, generation_config
from transformer.inference.runs import open_run
from transformer.model import lora
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding

log = logging.getLogger("transformer")
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # generate's defaults: its eos_token_id(s)
SINGLE_FILE = "model.safetensors"
TOKENIZER_MODEL = "tokenizer.model"  # a SentencePiece model, as Llama's checkpoints hold it
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # AutoTokenizer's class and special tokens
NO_BOS_TOKEN = ("qwen2",)  # model types whose tokenizer names no BOS (Qwen2Tokenizer's None)
CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = {"decoder": "lm_default.py", "vision": "vit_b16_imagenet.py",
                  "encoder_decoder": "default.py"}
MAX_SHARD_BYTES = 5 * 10**9  # export: bytes per safetensors file (save_pretrained's "5GB")
IMPORTED_STEP = 0  # the params-only series step an import writes (no update made yet)
ADAPTER_DIR = "adapter"  # export of a LoRA run: the PEFT adapter, beside the base's files
EMBEDDING = "embedding/embedding"
# Files an export may write beside the tensors: an earlier export's are removed first, so that
# a tokenizer of another kind (tokenizer.json beside a Marian's vocab.json) does not stay.
EXPORTED_FILES = (GENERATION_CONFIG, TOKENIZER_CONFIG, TOKENIZER_MODEL, tokenizer_lib.JSON_FILE,
                  t5.SPIECE_FILE, marian.SOURCE_SPM, marian.TARGET_SPM, marian.VOCAB_JSON)


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: {what}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg} at line {error.lineno})") from None


class TensorReader:
    """The tensors of a checkpoint directory, one at a time, by name (numpy)."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index):
            weight_map = read_json(index, "")["weight_map"]
            self.files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
        elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
            from safetensors import safe_open

            path = os.path.join(hf_dir, SINGLE_FILE)
            with safe_open(path, framework="numpy") as f:
                self.files = dict.fromkeys(f.keys(), path)
        else:
            raise ValueError(f"{hf_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}: save the "
                             f"model with save_pretrained(..., safe_serialization=True)")
        for path in sorted(set(self.files.values())):
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing ({INDEX_FILE} lists it)")

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (bfloat16 and float16 checkpoints are widened exactly)."""
        from safetensors import safe_open

        with safe_open(self.files[name], framework="numpy") as f:
            return np.asarray(f.get_tensor(name), np.float32)


def load_run_config(config_file: str | None, architecture: str) -> tuple[ConfigDict, str]:
    """The run config an import starts from (its data, optimizer and mesh): `config_file`, or
    the family's default under configs/."""
    path = config_file or str(CONFIGS_DIR / DEFAULT_CONFIG[architecture])
    if not os.path.isfile(path):
        raise ValueError(f"--config={path} is not a file: give a config file (configs/*.py) "
                         f"for the imported run's data and optimizer")
    return runpy.run_path(path)["get_config"](), path


def _model_of(model_cfg: TransformerConfig):
    from transformer.model.transformer import Transformer
    from transformer.model.vit import VisionTransformer

    if model_cfg.architecture == "vision":
        return VisionTransformer(model_cfg)
    return Transformer(model_cfg)


def abstract_params(model_cfg: TransformerConfig):
    """The model's parameters as boxed `jax.ShapeDtypeStruct`s (logical axis names kept)."""
    model = _model_of(model_cfg)
    if model_cfg.architecture == "vision":
        size = (1, model_cfg.image_size, model_cfg.image_size, model_cfg.num_channels)
        return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(size)))["params"]
    tokens = jnp.ones((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]


def _import_groups(family, model_cfg: TransformerConfig, hf_config: dict,
                   names: set[str]) -> list:
    """The family's tensor groups as this checkpoint holds them (`import_tensors`, given its
    tensor names, where a family reads more than one layout: Marian's OPUS-MT ids, Mixtral's
    fused experts)."""
    if hasattr(family, "import_tensors"):
        return family.import_tensors(model_cfg, hf_config, names)
    return family.tensors(model_cfg)


def _check_tensors(family, groups: list, reader: TensorReader, hf_dir: str):
    """Every tensor the model needs is there, and nothing there would be silently dropped."""
    wanted = {name for group in groups for name in group.hf}
    missing = sorted(wanted - reader.names())
    if missing:
        raise ValueError(f"{hf_dir} lacks tensor {missing[0]} (and {len(missing) - 1} more) "
                         f"that its config.json implies: is the checkpoint complete?")
    ignored = getattr(family, "ignored", ())
    extra = sorted(name for name in reader.names() - wanted if not name.endswith(ignored))
    if extra:
        raise ValueError(f"{hf_dir} holds tensor {extra[0]} (and {len(extra) - 1} more) that "
                         f"our {family.__name__} model has no place for: not supported")


def import_checkpoint(hf_dir: str, workdir: str, *, config_file: str | None = None,
                      overrides: dict | None = None, adapter: str | None = None) -> str:
    """Writes the checkpoint in `hf_dir` as a run in `workdir` (module docstring). Returns the
    params directory. The model fields the checkpoint does not fix (`dtype`,
    `attention_implementation`, `remat_policy`) come from the run config; `overrides` sets
    dotted keys after (e.g. {"model.dtype": "float32"}), as `--config.<key>=` flags do.
    `adapter`: a PEFT LoRA adapter directory for this checkpoint, imported as the run's
    `finetune` section and `lora_a`/`lora_b` parameters (`adapters`)."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"--from={hf_dir} is not a directory: give a save_pretrained directory")
    hf_config = read_json(os.path.join(hf_dir, HF_CONFIG), "not a save_pretrained directory")
    family = families.for_checkpoint(hf_config, os.path.join(hf_dir, HF_CONFIG))
    reader = TensorReader(hf_dir)
    fields = family.config(hf_config)
    if hasattr(family, "tensor_fields"):  # what config.json leaves to the tensors (T5's head)
        fields |= family.tensor_fields(reader.names())
    cfg, config_path = load_run_config(config_file, fields["architecture"])
    base = dict(cfg.model)
    base.update(fields, scan_layers=False)
    cfg.model = ConfigDict(base)
    for key, value in (overrides or {}).items():
        *sections, last = key.split(".")
        target = cfg
        for section in sections:
            target = target[section]
        target[last] = value
    if fields["architecture"] != "vision":
        cfg.data.vocab_size = fields["vocab_size"]
    run = resolve(cfg, config_file=config_path)
    groups = _import_groups(family, run.model, hf_config, reader.names())
    _check_tensors(family, groups, reader, hf_dir)
    if adapter is not None:
        run, reader, groups = _with_adapter(adapter, cfg, config_path, reader, groups)
    tokenizer = _vocabulary(hf_dir, run.model, hf_config)
    if layout.read_config_file(workdir) is not None or checkpointer.list_steps(
            layout.path(workdir, layout.PARAMS_SERIES)):
        raise ValueError(f"--workdir={workdir} already holds a run: import into a new "
                         f"directory")

    mesh = sharding.make_mesh(run.config.mesh)
    params = read_params(reader, family, run.model, mesh, groups)
    os.makedirs(workdir, exist_ok=True)
    series = averaging.ParamsSeries(workdir, every_minutes=1.0, keep=1, use_async=False)
    series.save(IMPORTED_STEP, params)  # every process writes its shards
    series.close()
    if jax.process_index() == 0:
        if tokenizer is not None:
            vocab_dir = layout.path(workdir, layout.VOCAB)
            tokenizer.save(vocab_dir)
            if family is families.T5 and os.path.isfile(os.path.join(hf_dir, t5.SPIECE_FILE)):
                shutil.copyfile(os.path.join(hf_dir, t5.SPIECE_FILE),  # exported back as is
                                os.path.join(vocab_dir, t5.SPIECE_FILE))
            if family is families.Marian:  # OPUS-MT's SentencePiece files, exported back
                marian.keep_vocabulary(hf_dir, hf_config, vocab_dir)
        provenance = {"huggingface": {"source": os.path.abspath(hf_dir),
                                      "model_type": hf_config["model_type"],
                                      "config": hf_config}, "mesh": dict(mesh.shape)}
        if adapter is not None:
            provenance["huggingface"]["adapter"] = os.path.abspath(adapter)
        layout.write_config(workdir, run.config.to_dict(), provenance)  # last: complete
    log.info("imported %s (%s) into %s", hf_dir, hf_config["model_type"], workdir)
    return layout.path(workdir, layout.PARAMS_SERIES, str(IMPORTED_STEP))


class _WithAdapter:
    """A checkpoint's `TensorReader` and a PEFT adapter's tensors, read by name."""

    def __init__(self, reader: TensorReader, tensors: dict[str, np.ndarray]):
        self.reader, self.tensors = reader, tensors

    def get(self, name: str) -> np.ndarray:
        return self.tensors[name] if name in self.tensors else self.reader.get(name)


def _with_adapter(adapter: str, cfg: ConfigDict, config_path: str, reader: TensorReader,
                  groups: list):
    """(run, reader, groups) with the PEFT adapter in `adapter` added: the run config's
    `finetune` section from its adapter_config.json and tensor names, the adapter's tensor
    groups after the base's. Each adapter tensor must map to one of ours, and back."""
    fields = adapters.read_config(adapter)
    tensors = adapters.read_tensors(adapter)
    fields["lora_targets"] = adapters.targets_of(tensors, groups, adapter)
    with cfg.unlocked():
        cfg.finetune = ConfigDict(fields)
    run = resolve(cfg, config_file=config_path)
    abstract = nn.unbox(abstract_params(run.model))
    shapes = {name: leaf.shape for name, leaf in zip(_names(abstract), jax.tree.leaves(abstract),
                                                      strict=True)}
    pairs = adapters.adapter_groups(groups, shapes, lora.targets(run.model), run.model.lora_rank)
    missing = sorted({name for group in pairs for name in group.hf} - set(tensors))
    if missing:
        raise ValueError(f"--adapter={adapter} lacks {missing[0]}: LoRA here adapts a module "
                         f"kind in every layer (finetune.lora_targets), not some layers")
    adapters.check_shapes(pairs, shapes, tensors, adapter)
    return run, _WithAdapter(reader, tensors), groups + pairs


def read_params(reader: TensorReader, family, model_cfg: TransformerConfig, mesh,
                groups: list | None = None):
    """The model's parameters from `reader` (as `groups` map them, default the family's), each
    array placed in its sharding on `mesh` as soon as its tensor group is read."""
    boxed = abstract_params(model_cfg)
    abstract = nn.unbox(boxed)
    names = _names(abstract)
    shardings = dict(zip(names, jax.tree.leaves(sharding.tree_shardings(boxed, mesh)),
                         strict=True))
    shapes = {name: leaf.shape for name, leaf in zip(names, jax.tree.leaves(abstract),
                                                      strict=True)}
    placed = {}
    for group in groups or family.tensors(model_cfg):
        for name, value in zip(group.ours, group.to_ours([reader.get(n) for n in group.hf]),
                               strict=True):
            if value.shape != shapes[name]:
                raise ValueError(f"{' + '.join(group.hf)} gives {name} shape {value.shape}; "
                                 f"the checkpoint's config.json implies {shapes[name]}")
            placed[name] = jax.make_array_from_callback(
                value.shape, shardings[name], lambda index, v=value: v[index])
    return jax.tree.unflatten(jax.tree.structure(abstract), [placed[name] for name in names])


def _vocabulary(hf_dir: str, model_cfg: TransformerConfig, hf_config: dict):
    """The checkpoint's own tokenizer as the run's vocabulary: its `tokenizer.json` (with the
    special ids of its config.json), else T5's `spiece.model` (`t5.read_spiece`), else its
    SentencePiece `tokenizer.model`; None, with a warning saying what the run then lacks, where
    there is neither or it does not fit the model (more pieces than embedding rows, or other
    special ids). A tokenizer with fewer pieces than the model has rows (T5 and Flan-T5: 32100
    pieces, 32128 rows) counts the padding rows in its `vocab_size`."""
    if model_cfg.architecture == "vision":
        return None
    lacks = ("the run gets no vocab/: generate, evaluate and init_from need one; "
             "the Python API takes token ids")
    json_path = os.path.join(hf_dir, tokenizer_lib.JSON_FILE)
    spiece = os.path.join(hf_dir, t5.SPIECE_FILE)
    is_marian = hf_config["model_type"] in families.Marian.model_types
    is_t5 = hf_config["model_type"] in families.T5.model_types
    if is_marian:  # MarianTokenizer's files
        path = os.path.join(hf_dir, marian.VOCAB_JSON)
    elif os.path.isfile(json_path):
        path = json_path
    elif is_t5:
        path = spiece
    else:
        path = os.path.join(hf_dir, TOKENIZER_MODEL)
    if not os.path.isfile(path):
        log.warning("%s has no %s or %s: %s", hf_dir, tokenizer_lib.JSON_FILE,
                    os.path.basename(path), lacks)
        return None
    ids = dict(bos_id=model_cfg.bos_id, eos_id=model_cfg.eos_id, pad_id=model_cfg.pad_id)
    generation = os.path.join(hf_dir, GENERATION_CONFIG)  # generate's ends, in its ids
    ends = end_ids(hf_config, read_json(generation, "") if os.path.isfile(generation) else None)
    try:
        if is_marian:
            tokenizer = marian.read_vocabulary(hf_dir, hf_config, ends)
        elif path == json_path:
            with open(path, "rb") as f:
                tokenizer = tokenizer_lib.HuggingFaceTokenizer(
                    f.read(), vocab_size=model_cfg.vocab_size, eos_ids=ends, **ids)
        elif path == spiece:
            tokenizer = t5.read_spiece(path, vocab_size=model_cfg.vocab_size, eos_ids=ends,
                                       **ids)
        else:
            tokenizer = tokenizer_lib.Tokenizer.load(path, vocab_size=model_cfg.vocab_size,
                                                     eos_ids=ends)
        if tokenizer.vocab_size != model_cfg.vocab_size:
            raise ValueError(f"{tokenizer.vocab_size} pieces, the model {model_cfg.vocab_size}")
        tokenizer_lib.check_special_ids(tokenizer, dataclasses.asdict(model_cfg))
    except (RuntimeError, ValueError) as error:  # not parsed, or not this model's
        log.warning("%s is not used (%s): %s", path, error, lacks)
        return None
    return tokenizer


def _names(tree) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [checkpointer.path_name(path) for path, _ in leaves]


def export_workdir(workdir: str, out_dir: str, *, step: int | None = None,
                   max_shard_bytes: int = MAX_SHARD_BYTES, merge_lora: bool = False) -> str:
    """Writes the run's parameters (checkpoint `step`, default the latest) to `out_dir` as a
    `transformers` checkpoint, converting one tensor group at a time and writing each shard as
    it fills. Returns the safetensors file (one shard) or the index (several). A LoRA run's
    adapters go to `<out_dir>/adapter` as a PEFT adapter of the base written to `out_dir`, or
    with `merge_lora` into the kernels (W + alpha/r A B): a plain checkpoint."""
    run = open_run(workdir, step=step, vocabulary="optional")
    model_cfg = run.model
    # The paper's embedding scale (the lm_* configs keep it) folds into an untied embedding.
    fold = (model_cfg.scale_embeddings and model_cfg.architecture == "decoder"
            and not model_cfg.tie_output_embedding)
    if fold:
        model_cfg = dataclasses.replace(model_cfg, scale_embeddings=False)
    family = families.for_model(model_cfg, f"--workdir={workdir}")
    vocab_dir = layout.path(workdir, layout.VOCAB)
    kept_dir, opus = kept.checked(workdir, run.tokenizer, model_cfg, family)  # files to keep
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    params = run.params
    if model_cfg.scan_layers:
        params = checkpointer.unstack_layers(params)
    if model_cfg.lora_rank and merge_lora:
        params = lora.merge(params, model_cfg)
        model_cfg = dataclasses.replace(model_cfg, lora_rank=0)
    ours = dict(zip(_names(params), jax.tree.leaves(params), strict=True))
    adapter = {name: ours.pop(name) for name in list(ours) if lora.is_adapter(name)}
    groups = (family.import_tensors(model_cfg, opus, set()) if opus
              else family.tensors(model_cfg))
    unused = sorted(set(ours) - {name for group in groups for name in group.ours})
    if unused:
        raise ValueError(f"--workdir={workdir}: parameter {unused[0]} has no place in a "
                         f"{family.__name__} checkpoint")
    if fold:
        table = np.asarray(ours[EMBEDDING], np.float32)
        ours[EMBEDDING] = table * np.sqrt(np.float32(model_cfg.d_model))
    os.makedirs(out_dir, exist_ok=True)
    for old in [*pathlib.Path(out_dir).glob("model*.safetensors*"),  # an earlier export's
                *(pathlib.Path(out_dir) / name for name in EXPORTED_FILES),
                *(pathlib.Path(out_dir, ADAPTER_DIR) / name
                  for name in (adapters.CONFIG_FILE, adapters.WEIGHTS_FILE))]:
        old.unlink(missing_ok=True)
    with ShardWriter(out_dir, max_shard_bytes) as writer:
        for group in groups:
            values = group.to_hf([np.asarray(ours[name]) for name in group.ours])
            for name, value in zip(group.hf, values, strict=True):
                writer.add(name, np.ascontiguousarray(value, np.float32))
    if adapter:
        path = adapters.write(os.path.join(out_dir, ADAPTER_DIR), adapter, groups, model_cfg,
                              out_dir)
        log.info("the LoRA adapter: %s", path)
    hf_config = family.hf_config(model_cfg) | {"dtype": "float32"}
    if opus:
        hf_config |= opus | {"decoder_vocab_size": opus["vocab_size"]}
    with open(os.path.join(out_dir, HF_CONFIG), "w") as f:
        json.dump(hf_config, f, indent=2)
    vocab = tokenizer_lib.vocabulary_file(vocab_dir)
    kept.write(kept_dir, out_dir, opus, run.tokenizer, model_cfg)  # an OPUS-MT's, T5's
    if run.tokenizer is not None and family is families.Marian and not opus:
        marian.write_vocabulary(vocab, out_dir, model_cfg)
    elif run.tokenizer is not None:
        name = TOKENIZER_MODEL if vocab.endswith(MODEL_FILE) else tokenizer_lib.JSON_FILE
        shutil.copyfile(vocab, os.path.join(out_dir, name))
        write_tokenizer_config(run.tokenizer, out_dir, model_cfg,
                               bos=hf_config["model_type"] not in NO_BOS_TOKEN)
    ends = run.tokenizer.eos_ids if run.tokenizer is not None and not opus else ()
    if len(ends) > 1:  # transformers' generate stops at each
        start = {key: hf_config[key] for key in ("decoder_start_token_id",
                                                 "forced_eos_token_id") if key in hf_config}
        with open(os.path.join(out_dir, GENERATION_CONFIG), "w") as f:
            json.dump(generation_config(model_cfg, ends) | start, f, indent=2)
    return writer.path


def write_tokenizer_config(tokenizer, out_dir: str, model_cfg: TransformerConfig, *,
                           bos: bool = True) -> None:
    """`tokenizer_config.json`, so that `AutoTokenizer.from_pretrained(out_dir)` reads the
    exported file as we do: the generic `TokenizersBackend` (a family's own class may rebuild
    the vocabulary on its assumptions: Gemma's adds pieces), the special tokens by their
    pieces (no BOS where the decoder starts from pad, as T5's), and for a SentencePiece model
    what ours put around a text: BOS before a prompt (decoder), EOS after a source
    (encoder-decoder). A tokenizer.json's own post-processor decides for it. `bos` False:
    no BOS named (Qwen2's, whose config.json's bos_token_id its tokenizer never uses)."""
    special = {"eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
    if bos and tokenizer.bos_id != tokenizer.pad_id:
        special["bos_token"] = tokenizer.bos_id
    config = {"tokenizer_class": "TokenizersBackend"} | {
        name: tokenizer.id_to_piece(i) for name, i in special.items() if i is not None}
    if isinstance(tokenizer, tokenizer_lib.Tokenizer):
        decoder = model_cfg.architecture == "decoder"
        config |= dict(add_bos_token=decoder, add_eos_token=not decoder)
    with open(os.path.join(out_dir, TOKENIZER_CONFIG), "w") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)


class ShardWriter:
    """Safetensors shards of at most `max_bytes` each (a bigger tensor gets a shard of its
    own), named and indexed as `save_pretrained` names them. One shard is `model.safetensors`
    without an index. Each shard is written as soon as the next tensor would overflow it."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.files: list[str] = []  # shards written, under temporary names
        self.weight_map: dict[str, int] = {}  # tensor -> shard number
        self.total_bytes = 0
        self.path = ""

    def __enter__(self) -> ShardWriter:
        return self

    def add(self, name: str, value: np.ndarray) -> None:
        if self.pending and self.pending_bytes + value.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = value
        self.pending_bytes += value.nbytes
        self.weight_map[name] = len(self.files)
        self.total_bytes += value.nbytes

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        path = os.path.join(self.out_dir, f"model.safetensors.part{len(self.files)}")
        save_file(self.pending, path, metadata={"format": "pt"})
        self.files.append(path)
        self.pending, self.pending_bytes = {}, 0

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            for path in self.files:
                os.unlink(path)
            return
        self._flush()
        count = len(self.files)
        names = ([SINGLE_FILE] if count == 1 else
                 [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        for path, name in zip(self.files, names, strict=True):
            os.replace(path, os.path.join(self.out_dir, name))
        self.path = os.path.join(self.out_dir, names[0])
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {tensor: names[shard]
                                    for tensor, shard in sorted(self.weight_map.items())}}
            self.path = os.path.join(self.out_dir, INDEX_FILE)
            with open(self.path, "w") as f:
                json.dump(index, f, indent=2)

