"""Marian (`MarianMTModel`), the paper's encoder-decoder as `transformers` holds the OPUS-MT
translation models: post-LN, sinusoidal positions, biases everywhere, one embedding shared by
source, target and output (times sqrt(D) where `scale_embedding`), a ReLU, GELU or SiLU
("swish") feed-forward and `final_logits_bias` (our `model.logits_bias`).

Checkpoint layout (`torch.nn.Linear` weight [out, in]):
    model.shared.weight [V, D]; final_logits_bias [1, V]
    model.{encoder,decoder}.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias}
    model.decoder.layers.{i}.encoder_attn.{q,k,v,out}_proj.{weight,bias}
    ...{self_attn,encoder_attn,final}_layer_norm.{weight,bias}, fc1 [F, D], fc2 [D, F]

Marian's sinusoidal table puts the sines in the first half of D and the cosines in the
second (`MarianSinusoidalPositionalEmbedding`). Ours interleaves them, as the paper's formula.
The same model is one in either layout up to an order of D's features: every tensor with a D
axis is read through `SPLIT` (our feature 2i is Marian's i, 2i + 1 is D/2 + i) and written
back through its inverse, so the paper's model exports exactly (LayerNorm, residuals and the
tied output do not depend on the order of the features).

Marian's LayerNorm epsilon is fixed at 1e-5: a model trained here with another `norm_eps`
(the paper's configs: 1e-6) exports with a warning, its logits then differ by ~1e-5.

The token ids are ours (pad 0, decoder start = BOS 2, EOS 3: what the translator reads). A
checkpoint with the OPUS-MT layout (EOS 0, pad = decoder start = the last id) is renumbered to
ours on import (`opus_order`), another layout refused, naming the ids. The exported
vocabulary is what `MarianTokenizer` reads: `source.spm` and `target.spm` (here one
SentencePiece model, shared) and `vocab.json` (piece -> id, the model's own ids). An
imported OPUS-MT checkpoint's own files are kept in the run's vocab/ and written back with
its ids (`keep_vocabulary`, `opus_ids`, `write_kept_vocabulary`; `huggingface/kept.py`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence

import numpy as np

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.huggingface.mapping import (
    Tensors,
    mismatches,
    require,
    token_ids_config,
    unsupported,
)
from transformer.model.config import TransformerConfig

log = logging.getLogger("transformer")
SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
VOCAB_JSON = "vocab.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# An OPUS-MT checkpoint's MarianTokenizer files, kept in the run's vocab/ for its export.
KEPT_FILES = (SOURCE_SPM, TARGET_SPM, VOCAB_JSON, TOKENIZER_CONFIG)
PADDING_PIECE = "<padding_{}>"  # vocab.json's name of a padded vocabulary's row past the pieces
NEVER = -1e9  # a logit bias no token wins with
HF_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which Marian's layers keep
ACTIVATIONS = {"relu": ("relu", {}), "swish": ("silu", {}), "silu": ("silu", {}),
               "gelu": ("gelu", dict(gelu_approximate=False)),
               "gelu_new": ("gelu", dict(gelu_approximate=True)),
               "gelu_pytorch_tanh": ("gelu", dict(gelu_approximate=True))}


def opus_order(hf: dict) -> np.ndarray | None:
    """Our id i's Marian id, where the checkpoint numbers them as OPUS-MT does (EOS 0, pad =
    decoder start = the last id): ours pad 0 and BOS 2 both read Marian's pad row (the
    decoder's start), unk 1 stays, EOS 3 is its 0, and its pieces 2.. follow from 4, so our
    vocabulary is one longer. None where the ids are ours already (pad 0, start 2, EOS 3).
    Another layout is refused naming the three ids."""
    ids = (hf.get("pad_token_id"), hf.get("decoder_start_token_id"), hf.get("eos_token_id"))
    if ids == (PAD_ID, BOS_ID, EOS_ID):
        return None
    last = hf["vocab_size"] - 1
    if ids != (last, last, 0):
        raise unsupported("marian", "pad_token_id/decoder_start_token_id/eos_token_id", ids,
                          f"ours ({PAD_ID}, {BOS_ID}, {EOS_ID}) or OPUS-MT's ({last}, {last}, 0)")
    return np.array([last, 1, last, 0] + list(range(2, last)))


def split_order(d_model: int) -> tuple[np.ndarray, np.ndarray]:
    """(to_hf, to_ours): Marian's feature j is our feature to_hf[j]. Ours i is its to_ours[i]."""
    to_hf = np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])
    return to_hf, np.argsort(to_hf)


def _reordered(hf: str, ours: str, d_axis: int, d_model: int, to_ours=None, to_hf=None):
    """One tensor whose axis `d_axis` is D, reordered between the layouts. Then `to_ours`
    (numpy array -> array) and back with `to_hf`."""
    to_hf_order, to_ours_order = split_order(d_model)
    to_ours = to_ours or (lambda a: a)
    to_hf = to_hf or (lambda a: a)
    return Tensors((hf,), (ours,),
                   lambda a: [to_ours(np.take(a[0], to_ours_order, axis=d_axis))],
                   lambda a: [np.take(to_hf(a[0]), to_hf_order, axis=d_axis)])


def _attention(hf: str, ours: str, cfg: TransformerConfig) -> list[Tensors]:
    n = cfg.num_heads
    h = cfg.d_k
    d = cfg.d_model
    out = []
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        out += [_reordered(f"{hf}.{proj}.weight", f"{ours}/{name}/kernel", 1, d,
                           lambda a: a.T.reshape(d, n, h), lambda a: a.reshape(d, -1).T),
                Tensors((f"{hf}.{proj}.bias",), (f"{ours}/{name}/bias",),
                        lambda a: [a[0].reshape(n, h)], lambda a: [a[0].reshape(-1)])]
    return out + [
        _reordered(f"{hf}.out_proj.weight", f"{ours}/out/kernel", 0, d,
                   lambda a: a.T.reshape(n, h, d), lambda a: a.reshape(n * h, d).T),
        _reordered(f"{hf}.out_proj.bias", f"{ours}/out/bias", 0, d)]


def _layer_norm(hf: str, ours: str, d: int) -> list[Tensors]:
    return [_reordered(f"{hf}.weight", f"{ours}/scale", 0, d),
            _reordered(f"{hf}.bias", f"{ours}/bias", 0, d)]


def _feed_forward(hf: str, ours: str, d: int) -> list[Tensors]:
    return [_reordered(f"{hf}.fc1.weight", f"{ours}/ffn/ff_in/kernel", 1, d, lambda a: a.T,
                       lambda a: a.T),
            Tensors((f"{hf}.fc1.bias",), (f"{ours}/ffn/ff_in/bias",), list, list),
            _reordered(f"{hf}.fc2.weight", f"{ours}/ffn/ff_out/kernel", 0, d, lambda a: a.T,
                       lambda a: a.T),
            _reordered(f"{hf}.fc2.bias", f"{ours}/ffn/ff_out/bias", 0, d)]


def _renumbered(group: Tensors, order: np.ndarray, axis: int, banned=None,
                pad_row: int = PAD_ID) -> Tensors:
    """`group` (one tensor with a vocabulary axis) read with our ids (`opus_order`); `banned`
    (a value) put at our BOS, which Marian's pad row gives and OPUS-MT never generates.
    Written back, Marian's pad row is our row `pad_row` (ours pad and BOS both read it)."""
    def to_ours(arrays):
        value = np.take(arrays[0], order, axis=axis)
        if banned is not None:
            np.moveaxis(value, axis, 0)[BOS_ID] = banned
        return group.to_ours([value])

    inverse = np.argsort(order, kind="stable")[np.arange(len(order) - 1)]
    inverse[order[PAD_ID]] = pad_row
    return Tensors(group.hf, group.ours, to_ours,
                   lambda a: [np.take(group.to_hf(a)[0], inverse, axis=axis)])


class Marian:
    """`MarianMTModel` <-> our post-LN encoder-decoder with shared, tied embeddings."""

    model_types = ("marian",)

    @staticmethod
    def config(hf: dict) -> dict:
        kind = "marian"
        require(hf, kind, "activation_function", tuple(ACTIVATIONS), "ReLU, GELU or SiLU")
        for ours, theirs in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
            if hf[ours] != hf[theirs]:
                raise unsupported(kind, theirs, hf[theirs], f"our encoder and decoder share "
                                  f"it: {ours}={hf[ours]}")
        require(hf, kind, "share_encoder_decoder_embeddings", (True,),
                "one vocabulary for source and target")
        require(hf, kind, "tie_word_embeddings", (True,), "the output is the embedding")
        require(hf, kind, "decoder_vocab_size", (hf["vocab_size"], None),
                "one vocabulary for source and target")
        order = opus_order(hf)
        activation, extra = ACTIVATIONS[hf["activation_function"]]
        return dict(
            architecture="encoder_decoder",
            vocab_size=hf["vocab_size"] if order is None else len(order),
            num_encoder_layers=hf["encoder_layers"], num_decoder_layers=hf["decoder_layers"],
            d_model=hf["d_model"], d_ff=hf["encoder_ffn_dim"],
            num_heads=hf["encoder_attention_heads"], num_kv_heads=None, d_k=None, d_v=None,
            dropout_rate=float(hf.get("dropout", 0.1)),
            attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
            relu_dropout_rate=float(hf.get("activation_dropout", 0.0)), positional="sinusoidal",
            norm="layer_norm", norm_position="post", activation=activation, use_bias=True,
            share_embeddings=True, tie_output_embedding=True, logits_bias=True,
            max_len=hf["max_position_embeddings"], norm_eps=1e-5,
            scale_embeddings=bool(hf.get("scale_embedding", False)), **extra)

    @staticmethod
    def tensor_fields(names: set[str]) -> dict:
        """A logits bias where the checkpoint holds `final_logits_bias` (`save_pretrained`
        always writes one; an export of a run without one writes none)."""
        return dict(logits_bias="final_logits_bias" in names)

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        activation = {"relu": "relu", "silu": "swish"}.get(cfg.activation) or (
            "gelu_new" if cfg.gelu_approximate else "gelu")
        ids = token_ids_config(cfg)
        return dict(
            model_type="marian", architectures=["MarianMTModel"], vocab_size=cfg.vocab_size,
            decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
            encoder_layers=cfg.num_encoder_layers, decoder_layers=cfg.num_decoder_layers,
            encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
            encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
            activation_function=activation, max_position_embeddings=cfg.max_len,
            dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout_rate,
            activation_dropout=cfg.relu_dropout_rate, scale_embedding=cfg.scale_embeddings,
            share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
            static_position_embeddings=True, is_encoder_decoder=True,
            pad_token_id=ids["pad_token_id"], eos_token_id=ids["eos_token_id"],
            decoder_start_token_id=ids["bos_token_id"], forced_eos_token_id=ids["eos_token_id"])

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        out = mismatches(cfg, architecture="encoder_decoder", positional="sinusoidal",
                         norm="layer_norm", norm_position="post", use_bias=True,
                         share_embeddings=True, tie_output_embedding=True,
                         num_kv_heads=cfg.num_heads, d_k=cfg.d_model // cfg.num_heads,
                         d_v=cfg.d_model // cfg.num_heads, logits_bias=cfg.logits_bias)
        if cfg.activation == "swiglu":
            out.append("model.activation='swiglu' (wants relu, gelu or silu)")
        if (cfg.pad_id, cfg.bos_id, cfg.eos_id) != (PAD_ID, BOS_ID, EOS_ID):
            out.append(f"model.pad_id/bos_id/eos_id={cfg.pad_id, cfg.bos_id, cfg.eos_id} "
                       f"(wants ours, {PAD_ID, BOS_ID, EOS_ID})")
        return out

    @staticmethod
    def import_tensors(cfg: TransformerConfig, hf: dict, names: set[str]) -> list[Tensors]:
        """`tensors` of a checkpoint with OPUS-MT's ids, its vocabulary rows renumbered
        (`opus_order`); OPUS-MT's `bad_words_ids` (its pad) becomes a logits bias that our
        BOS never wins."""
        order = opus_order(hf)
        if order is None:
            return Marian.tensors(cfg)
        out = []
        for group in Marian.tensors(cfg):
            if group.ours == ("embedding/embedding",):  # the pad row: the decoder's start
                group = _renumbered(group, order, 0, pad_row=BOS_ID)
            elif group.ours == ("decoder/logits_bias",):
                group = _renumbered(group, order, 1, banned=NEVER)
            out.append(group)
        return out

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        d = cfg.d_model
        out = [_reordered("model.shared.weight", "embedding/embedding", 1, d)]
        for stack, count in (("encoder", cfg.num_encoder_layers),
                             ("decoder", cfg.num_decoder_layers)):
            for i in range(count):
                hf = f"model.{stack}.layers.{i}"
                ours = f"{stack}/layers_{i}"
                out += _attention(f"{hf}.self_attn", f"{ours}/self_attention", cfg)
                out += _layer_norm(f"{hf}.self_attn_layer_norm", f"{ours}/norm_attention", d)
                if stack == "decoder":
                    out += _attention(f"{hf}.encoder_attn", f"{ours}/cross_attention", cfg)
                    out += _layer_norm(f"{hf}.encoder_attn_layer_norm", f"{ours}/norm_cross",
                                       d)
                out += _feed_forward(hf, ours, d)
                out += _layer_norm(f"{hf}.final_layer_norm", f"{ours}/norm_ffn", d)
        if cfg.logits_bias:
            out.append(Tensors(("final_logits_bias",), ("decoder/logits_bias",),
                               lambda a: [a[0].reshape(-1)], lambda a: [a[0].reshape(1, -1)]))
        return out


def write_vocabulary(spm_path: str, out_dir: str, cfg: TransformerConfig) -> None:
    """`MarianTokenizer`'s files from our SentencePiece model: it as `source.spm` and
    `target.spm`, `vocab.json` mapping each piece to its id, and `tokenizer_config.json`.
    A padded vocabulary's rows past the pieces (up to `cfg.vocab_size`) are `PADDING_PIECE`s,
    special tokens, so that `MarianTokenizer.decode` reads every id the model may generate
    (and drops them with `skip_special_tokens`, as ours)."""
    from transformer.data.tokenizer import Tokenizer

    if not spm_path.endswith(".model"):
        raise ValueError(f"{spm_path}: a Marian export needs a SentencePiece vocabulary")
    tokenizer = Tokenizer.load(spm_path)
    for name in (SOURCE_SPM, TARGET_SPM):
        shutil.copyfile(spm_path, os.path.join(out_dir, name))
    padding = _padding(tokenizer.pieces, cfg.vocab_size)
    vocab = {tokenizer.id_to_piece(i): i for i in range(tokenizer.pieces)} | padding
    with open(os.path.join(out_dir, VOCAB_JSON), "w") as f:
        json.dump(vocab, f, ensure_ascii=False, indent=0)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "MarianTokenizer", "model_max_length": cfg.max_len,
                   "separate_vocabs": False} | (
                       {"extra_special_tokens": list(padding)} if padding else {}), f, indent=2)
    if cfg.norm_eps != HF_NORM_EPS:
        log.warning("model.norm_eps=%g becomes Marian's LayerNorm epsilon %g: its logits "
                    "differ from the run's by about 1e-5", cfg.norm_eps, HF_NORM_EPS)


def _padding(pieces: int, rows: int) -> dict[str, int]:
    """vocab.json's entries of a padded vocabulary's rows `pieces` .. `rows` - 1."""
    return {PADDING_PIECE.format(i): i for i in range(pieces, rows)}


def read_vocabulary(hf_dir: str, hf: dict, eos_ids: Sequence[int] = ()):
    """The run's vocabulary from `MarianTokenizer`'s files: where they are one SentencePiece
    model whose own ids `vocab.json` lists (as `write_vocabulary` writes them), that model
    with config.json's `vocab_size` rows (more where a padded run's export counts rows past
    the pieces, which vocab.json may list as `PADDING_PIECE`s).
    With OPUS-MT's ids, `source.spm` as a `tokenizer.json` with our ids (`opus_vocabulary`);
    ValueError naming the file otherwise. It ends texts at `eos_ids` (the checkpoint's ids:
    generate's ends) too."""
    from transformer.data.tokenizer import Tokenizer

    paths = [os.path.join(hf_dir, name) for name in (SOURCE_SPM, TARGET_SPM, VOCAB_JSON)]
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"{missing[0]} is missing (MarianTokenizer's files)")
    source, target, vocab = paths
    order = opus_order(hf)
    if order is not None:
        to_ours = np.argsort(order, kind="stable")  # Marian id -> ours (its pad: our pad)
        return opus_vocabulary(source, vocab, order, [int(to_ours[i]) for i in eos_ids])
    with open(source, "rb") as f, open(target, "rb") as g:
        if f.read() != g.read():
            raise ValueError(f"{source} and {target} differ: one shared vocabulary only")
    tokenizer = Tokenizer.load(source, vocab_size=hf["vocab_size"], eos_ids=eos_ids)
    with open(vocab) as f:
        ids = json.load(f)
    pieces = {tokenizer.id_to_piece(i): i for i in range(tokenizer.pieces)}
    if not pieces.items() <= ids.items() <= (pieces | _padding(tokenizer.pieces,
                                                               tokenizer.vocab_size)).items():
        raise ValueError(f"{vocab} numbers the pieces otherwise than {source}")
    return tokenizer


def opus_vocabulary(source_spm: str, vocab_json: str, order: np.ndarray,
                    eos_ids: Sequence[int] = ()):
    """OPUS-MT's source vocabulary with our ids (`opus_order`): `source.spm`'s segmentation
    (its normaliser, pieces and scores, as `transformers` converts a SentencePiece model) over
    `vocab.json`'s pieces renumbered. Pieces only the target side has get a score no
    segmentation picks, as control pieces do. Encodes a source as `MarianTokenizer` does
    without its Moses punctuation normaliser. Ends texts at `eos_ids` (ours) too."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    from transformer.data.tokenizer import HuggingFaceTokenizer

    proto = import_protobuf().ModelProto()
    with open(source_spm, "rb") as f:
        proto.ParseFromString(f.read())
    with open(vocab_json) as f:
        pieces = {i: piece for piece, i in json.load(f).items()}
    scores = {p.piece: p.score for p in proto.pieces if p.type == 1}  # normal pieces
    never = min(scores.values(), default=0.0) - 100.0
    vocab = [(pieces[m], scores.get(pieces[m], never)) for m in order]
    vocab[BOS_ID] = ("<s>" if "<s>" not in pieces.values() else "<bos>", never)
    proto.trainer_spec.unk_id = next(i for i, (piece, _) in enumerate(vocab)
                                     if piece == proto.trainer_spec.unk_piece)
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    return HuggingFaceTokenizer(tokenizer.to_str().encode("utf-8"), bos_id=BOS_ID,
                                eos_id=EOS_ID, pad_id=PAD_ID, eos_ids=eos_ids)


def keep_vocabulary(hf_dir: str, hf: dict, vocab_dir: str) -> None:
    """Keeps a checkpoint's `KEPT_FILES` in the run's `vocab_dir` where its ids are OPUS-MT's
    (the run's vocabulary is then a `tokenizer.json` with our ids, `opus_vocabulary`), so that
    an export writes them back (`opus_ids`, `write_kept_vocabulary`)."""
    if opus_order(hf) is None:
        return  # the run's vocabulary is the SentencePiece model, which exports as it is
    for name in KEPT_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(vocab_dir, name))


def opus_ids(vocab_dir: str, tokenizer, cfg: TransformerConfig) -> dict | None:
    """config.json's ids (OPUS-MT's) of a run that keeps its checkpoint's SentencePiece files
    (`keep_vocabulary`; None where it keeps none), after checking that the run's vocabulary is
    still the one they give (the same piece at every id); ValueError in one line otherwise."""
    source = os.path.join(vocab_dir, SOURCE_SPM)
    if not os.path.isfile(source):
        return None
    last = cfg.vocab_size - 2  # ours is one row longer (`opus_order`)
    hf = dict(vocab_size=last + 1, pad_token_id=last, decoder_start_token_id=last,
              eos_token_id=0)
    kept = opus_vocabulary(source, os.path.join(vocab_dir, VOCAB_JSON), opus_order(hf))
    if tokenizer is None or tokenizer.vocab_size != kept.vocab_size or any(
            tokenizer.id_to_piece(i) != kept.id_to_piece(i) for i in range(kept.vocab_size)):
        raise ValueError(f"{vocab_dir}: the run's vocabulary is no longer the one the imported "
                         f"Marian's {SOURCE_SPM} and {VOCAB_JSON} there give: export a run "
                         f"that keeps the imported vocabulary")
    return hf | dict(forced_eos_token_id=0)


def write_kept_vocabulary(vocab_dir: str, out_dir: str, hf: dict,
                          cfg: TransformerConfig) -> dict:
    """The imported Marian's files (`KEPT_FILES`, checked by `opus_ids`) copied to `out_dir`,
    a `tokenizer_config.json` where the checkpoint had none; returns generation_config.json's
    fields: OPUS-MT's ids, its pad never generated (`bad_words_ids`, as OPUS-MT's say)."""
    for name in KEPT_FILES:
        if os.path.isfile(os.path.join(vocab_dir, name)):
            shutil.copyfile(os.path.join(vocab_dir, name), os.path.join(out_dir, name))
    config = os.path.join(out_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(config):
        with open(config, "w") as f:
            json.dump({"tokenizer_class": "MarianTokenizer", "model_max_length": cfg.max_len,
                       "separate_vocabs": False}, f, indent=2)
    return {key: hf[key] for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id",
                                     "forced_eos_token_id")} | {
        "bad_words_ids": [[hf["pad_token_id"]]]}
