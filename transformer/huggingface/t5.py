"""T5 (`T5ForConditionalGeneration`) in the T5 v1.1 / Flan-T5 layout: pre-LN with RMSNorm
without bias (`norm="rms_norm"`, `norm_position="pre"`, a final norm per stack), no biases,
one embedding for source and target read unscaled, an unscaled (untied) `lm_head`, a gated-GELU
feed-forward (`activation="geglu"`; transformers' "gated-gelu" is gelu_new, the tanh
approximation: `gelu_approximate=True`), and no position embeddings but T5's relative position
bias (`positional="relative"`, `relative_buckets`, `relative_max_distance`).

T5 scales no attention logits by 1/sqrt(d_k) (its initialisation folds the factor into the
query). Ours are scaled by `attention_scale_dim`^-1/2 where it is set, so T5 is
`attention_scale_dim=1`: a scale of exactly 1.0, the checkpoint's kernels read as they are,
which keeps export bit-exact (folding 1/sqrt(d_k) into the query kernel instead would round it
on the way in and out).

The bias table lives in the first layer of each stack (`relative_attention_bias`
[num_buckets, N]) and every layer of the stack adds it. Ours is the stack's
`relative_bias/embedding` (`blocks.RelativeBias`), bidirectional buckets in the encoder,
causal in the decoder. The decoder starts from pad (id 0: `bos_id=0`), ends at EOS (1).

Checkpoint layout (`torch.nn.Linear` weight [out, in]):
    shared.weight [V, D]; lm_head.weight [V, D]; {encoder,decoder}.final_layer_norm.weight
    {stack}.block.{i}.layer.0.SelfAttention.{q,k,v} [N*H, D], .o [D, N*H], layer.0.layer_norm
    {stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight [num_buckets, N]
    decoder.block.{i}.layer.1.EncDecAttention.{q,k,v,o}, layer.1.layer_norm
    ...layer.{1 encoder, 2 decoder}.DenseReluDense.wi_0 (gate), wi_1 [F, D], wo [D, F]
    (ReLU: one `wi`), and that layer's layer_norm

The head: the hub's v1.1 / Flan-T5 config.json says `tie_word_embeddings: false` and holds its
own `lm_head.weight`; `transformers` 5 writes `tie_word_embeddings: true` with
`scale_decoder_outputs: false` and saves `lm_head.weight` only where it differs from the
embedding, so a checkpoint without it is read tied and unscaled (`tie_output_embedding=True`)
and exported so again. The original T5 (a tied head scaled by d_model^-0.5, which
`transformers` 5 reads as `scale_decoder_outputs` true) is refused in one line. Its ReLU
feed-forward is read. Training-time differences that change no logits: T5 also drops out after
each stack's final norm, and its one `dropout_rate` is also its attention and feed-forward
dropout (an import sets ours to it; an export writes `model.dropout_rate`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transformer.data.tokenizer import SENTINEL_PIECE, HuggingFaceTokenizer
from transformer.huggingface.mapping import (
    Tensors,
    heads_in,
    heads_out,
    mismatches,
    same,
    transposed,
    unsupported,
)
from transformer.model.config import TransformerConfig

# transformers' activation names -> (ours, gelu_approximate)
ACTIVATIONS = {"relu": ("relu", True), "gelu": ("gelu", False), "gelu_new": ("gelu", True),
               "gelu_pytorch_tanh": ("gelu", True), "silu": ("silu", True),
               "swish": ("silu", True)}
GATED = {"gelu": "geglu", "silu": "swiglu"}  # ours, gated
SPIECE_FILE = "spiece.model"  # T5Tokenizer's SentencePiece model (google/t5-v1_1-* hold no other)
EXTRA_IDS = 100  # T5Tokenizer's extra_ids: <extra_id_99> .. <extra_id_0> after the pieces
SPECIAL_TYPES = (2, 3)  # SentencePiece's unknown and control pieces: <unk>, <pad>, </s>


def _activation(hf: dict) -> dict:
    """`activation` and `gelu_approximate` of `feed_forward_proj` ("{act}" or
    "gated-{act}"; "gated-gelu" is gelu_new, as transformers reads it)."""
    proj = hf.get("feed_forward_proj", "relu")
    gated, _, name = proj.rpartition("-")
    name = "gelu_new" if proj == "gated-gelu" else name
    if gated not in ("", "gated") or name not in ACTIVATIONS or (
            gated and ACTIVATIONS[name][0] not in GATED):
        raise unsupported("t5", "feed_forward_proj", proj,
                          "relu, gelu, gelu_new, silu, gated-gelu, gated-gelu_new, gated-silu")
    activation, approximate = ACTIVATIONS[name]
    return dict(activation=GATED[activation] if gated else activation,
                gelu_approximate=approximate)


def _feed_forward_proj(cfg: TransformerConfig) -> str:
    gated = cfg.activation in GATED.values()
    base = {"geglu": "gelu", "swiglu": "silu"}.get(cfg.activation, cfg.activation)
    if base == "gelu":
        base = "gelu_new" if cfg.gelu_approximate else "gelu"
    return "gated-gelu" if gated and base == "gelu_new" else ("gated-" if gated else "") + base


def _attention(hf: str, ours: str, n: int, h: int) -> list[Tensors]:
    return [heads_in(f"{hf}.q.weight", f"{ours}/query/kernel", n, h),
            heads_in(f"{hf}.k.weight", f"{ours}/key/kernel", n, h),
            heads_in(f"{hf}.v.weight", f"{ours}/value/kernel", n, h),
            heads_out(f"{hf}.o.weight", f"{ours}/out/kernel", n, h)]


def _feed_forward(hf: str, ours: str, gated: bool) -> list[Tensors]:
    ff = f"{hf}.DenseReluDense"
    inner = ([transposed(f"{ff}.wi_0.weight", f"{ours}/ffn/ff_gate/kernel"),
              transposed(f"{ff}.wi_1.weight", f"{ours}/ffn/ff_in/kernel")] if gated
             else [transposed(f"{ff}.wi.weight", f"{ours}/ffn/ff_in/kernel")])
    return inner + [transposed(f"{ff}.wo.weight", f"{ours}/ffn/ff_out/kernel"),
                    same(f"{hf}.layer_norm.weight", f"{ours}/norm_ffn/scale")]


class T5:
    """`T5ForConditionalGeneration` (v1.1 / Flan-T5) <-> our pre-LN encoder-decoder with the
    relative position bias (module docstring)."""

    model_types = ("t5",)
    ignored = ("embed_tokens.weight",)  # copies of shared.weight some checkpoints hold

    @staticmethod
    def config(hf: dict) -> dict:
        if hf.get("tie_word_embeddings", True) is not False and hf.get(
                "scale_decoder_outputs") is not False:
            raise unsupported("t5", "tie_word_embeddings", hf.get("tie_word_embeddings", True),
                              "T5 v1.1 / Flan-T5's unscaled head only: the original T5 "
                              "scales the decoder output by d_model^-0.5 into the embedding")
        dropout = float(hf.get("dropout_rate", 0.1))
        return dict(
            architecture="encoder_decoder", vocab_size=hf["vocab_size"],
            num_encoder_layers=hf["num_layers"],
            num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
            d_model=hf["d_model"], d_ff=hf["d_ff"], num_heads=hf["num_heads"],
            num_kv_heads=None, d_k=hf["d_kv"], d_v=hf["d_kv"], dropout_rate=dropout,
            attention_dropout_rate=dropout, relu_dropout_rate=dropout, positional="relative",
            relative_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_max_distance=hf.get("relative_attention_max_distance", 128),
            norm="rms_norm", norm_position="pre", use_bias=False, share_embeddings=True,
            tie_output_embedding=False, logits_bias=False, scale_embeddings=False,
            attention_scale_dim=1, max_len=hf.get("n_positions") or 512,
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
            bos_id=hf.get("decoder_start_token_id") or 0, eos_id=hf.get("eos_token_id", 1),
            pad_id=hf.get("pad_token_id", 0), **_activation(hf))

    @staticmethod
    def tensor_fields(names: set[str]) -> dict:
        """The head is untied where the checkpoint holds `lm_head.weight` (module docstring)."""
        return dict(tie_output_embedding="lm_head.weight" not in names)

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        return dict(
            model_type="t5", architectures=["T5ForConditionalGeneration"],
            vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_k, d_ff=cfg.d_ff,
            num_layers=cfg.num_encoder_layers, num_decoder_layers=cfg.num_decoder_layers,
            num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.relative_buckets,
            relative_attention_max_distance=cfg.relative_max_distance,
            dropout_rate=cfg.dropout_rate, layer_norm_epsilon=cfg.norm_eps,
            feed_forward_proj=_feed_forward_proj(cfg), n_positions=cfg.max_len,
            tie_word_embeddings=cfg.tie_output_embedding, scale_decoder_outputs=False,
            is_encoder_decoder=True,
            pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id,
            decoder_start_token_id=cfg.bos_id)

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        out = mismatches(cfg, architecture="encoder_decoder", positional="relative",
                         norm="rms_norm", norm_position="pre", use_bias=False,
                         share_embeddings=True, scale_embeddings=False, attention_scale_dim=1,
                         num_kv_heads=cfg.num_heads, d_v=cfg.d_k, pad_id=0)
        if cfg.activation == "geglu" and not cfg.gelu_approximate:
            out.append("model.gelu_approximate=False with activation='geglu' (wants True: "
                       "T5's gated-gelu is the tanh approximation)")
        return out

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        n = cfg.num_heads
        h = cfg.d_k
        gated = cfg.activation in GATED.values()
        out = [same("shared.weight", "embedding/embedding")]
        if not cfg.tie_output_embedding:
            out.append(transposed("lm_head.weight", "decoder/logits/kernel"))
        for stack, count in (("encoder", cfg.num_encoder_layers),
                             ("decoder", cfg.num_decoder_layers)):
            first = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
            out += [same(first, f"{stack}/relative_bias/embedding"),
                    same(f"{stack}.final_layer_norm.weight", f"{stack}/norm/scale")]
            for i in range(count):
                hf = f"{stack}.block.{i}.layer"
                ours = f"{stack}/layers_{i}"
                out += _attention(f"{hf}.0.SelfAttention", f"{ours}/self_attention", n, h)
                out.append(same(f"{hf}.0.layer_norm.weight", f"{ours}/norm_attention/scale"))
                if stack == "decoder":
                    out += _attention(f"{hf}.1.EncDecAttention", f"{ours}/cross_attention",
                                      n, h)
                    out.append(same(f"{hf}.1.layer_norm.weight", f"{ours}/norm_cross/scale"))
                out += _feed_forward(f"{hf}.{2 if stack == 'decoder' else 1}", ours, gated)
        return out


def read_spiece(path: str, *, vocab_size: int, pad_id: int, eos_id: int, bos_id: int,
                eos_ids: Sequence[int] = ()) -> HuggingFaceTokenizer:
    """A `spiece.model` as the tokenizer `T5Tokenizer.from_pretrained` builds from it
    (transformers 5): its pieces and scores, then the `EXTRA_IDS` sentinels counting down
    (`<extra_id_0>` is the last id), its normaliser (the precompiled charsmap), split at
    whitespace with "▁" before each word, `</s>` appended by the post-processor (which our
    encode leaves out), ending texts at `eos_ids` too (generate's further ends). ValueError
    where its pad or EOS is not the model's."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    with open(path, "rb") as f:
        proto = sentencepiece_model_pb2.ModelProto.FromString(f.read())
    spec = proto.trainer_spec
    if (spec.pad_id, spec.eos_id) != (pad_id, eos_id):
        raise ValueError(f"pad {spec.pad_id} and EOS {spec.eos_id}, the model's are {pad_id} "
                         f"and {eos_id}")
    extras = [SENTINEL_PIECE.format(i) for i in reversed(range(EXTRA_IDS))]
    vocab = [(p.piece, p.score) for p in proto.pieces] + [(e, 0.0) for e in extras]
    tokenizer = Tokenizer(Unigram(vocab, unk_id=spec.unk_id, byte_fallback=False))
    if proto.normalizer_spec.precompiled_charsmap:
        tokenizer.normalizer = normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)
    metaspace = dict(replacement="\u2581", prepend_scheme="always", split=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(**metaspace)])
    tokenizer.decoder = decoders.Metaspace(**metaspace)
    special = [p.piece for p in proto.pieces if p.type in SPECIAL_TYPES] + extras
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t in special])
    eos = proto.pieces[eos_id].piece
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)])
    return HuggingFaceTokenizer(tokenizer.to_str().encode("utf-8"), bos_id=bos_id,
                                eos_id=eos_id, pad_id=pad_id, vocab_size=vocab_size,
                                eos_ids=eos_ids)


def check_spiece(vocab_dir: str, tokenizer) -> None:
    """Where `vocab_dir` keeps the imported checkpoint's `spiece.model` (exported back as it
    is), that the run's vocabulary is still the one it gives: the same piece at every id
    (the sentinels included). ValueError in one line otherwise."""
    path = os.path.join(vocab_dir, SPIECE_FILE)
    if tokenizer is None or not os.path.isfile(path):
        return
    try:
        kept = read_spiece(path, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                           eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id)
        same = kept.pieces == tokenizer.pieces and all(
            kept.id_to_piece(i) == tokenizer.id_to_piece(i) for i in range(kept.pieces))
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"{path}: the run's vocabulary is no longer the one this imported "
                         f"{SPIECE_FILE} gives: export a run that keeps the imported vocabulary")
