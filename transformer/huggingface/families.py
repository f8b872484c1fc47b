"""The Hugging Face families we read and write: each one's config.json <-> `TransformerConfig`
fields, and its tensors <-> our parameter paths (docs/architecture.md, "Parameter paths").

A `Family` maps a `transformers` config dict to our `model.*` fields (refusing, in one line, an
option our model does not compute exactly) and back, and lists its `Tensors`: which checkpoint
tensors make which of our parameters, and the two functions between them (transposes, heads
split out of fused projections). Arrays here are numpy, one tensor group at a time.

Llama, Mistral, Qwen2, Qwen3 and OLMo 2 are in `llama.py`, the Gemmas, Marian and T5 in modules
of their own.
The others' checkpoint layouts (`torch.nn.Linear` stores weight [out, in]; GPT-2's `Conv1D`
[in, out]):
    Mixtral  Mistral's tensors but the feed-forward: per layer block_sparse_moe.gate [E, D]
           (the router) and block_sparse_moe.experts.{j}.w1 (gate), w3 (up) [F, D] and w2
           (down) [D, F] for each expert j, as `save_pretrained` writes them and the Hub's
           checkpoints hold them. Or, as `transformers` 5 holds them in memory (its
           `state_dict` saved as it is), mlp.gate [E, D], mlp.experts.gate_up_proj [E, 2F, D]
           (each expert's gate rows, then its up rows) and mlp.experts.down_proj [E, D, F]
    Qwen3 MoE  Qwen3's tensors but a routed layer's feed-forward: mlp.gate [E, D] (the router)
           and mlp.experts.{j}.gate_proj, up_proj [F, D] and down_proj [D, F] (F its
           moe_intermediate_size); or `transformers` 5's fused experts, as Mixtral's
    GPT-2  c_attn [D, 3*D] (q, k, v side by side), c_proj [D, D], c_fc [D, F], mlp c_proj
           [F, D], LayerNorms, wte [V, D] (tied output), wpe [max_len, D]
    ViT    patch projection: a convolution [D, C, P, P]; cls_token [1, 1, D],
           position_embeddings [1, S, D], q/k/v/output Linear layers, classifier [classes, D]
Shapes in the package's legend; C is num_channels, P the patch size.
"""

from __future__ import annotations

import numpy as np

from transformer.huggingface.gemma import Gemma2, Gemma3
from transformer.huggingface.llama import Llama, Olmo2
from transformer.huggingface.mapping import (
    Tensors,
    bias_heads,
    heads_in,
    heads_out,
    mismatches,
    norm,
    require,
    same,
    token_ids,
    token_ids_config,
    transposed,
    unsupported,
)
from transformer.huggingface.marian import Marian
from transformer.huggingface.t5 import T5
from transformer.model.config import TransformerConfig


def _experts(hf: str, num_experts: int, weight: str, ours: str) -> Tensors:
    """One weight of every expert (a Linear [out, in] each) <-> our stacked kernel
    [E, in, out]."""
    return Tensors(tuple(f"{hf}.experts.{j}.{weight}.weight" for j in range(num_experts)),
                   (ours,), lambda a: [np.stack([w.T for w in a])],
                   lambda a: [w.T for w in a[0]])


def _fused_experts(hf: str, ours: str) -> list[Tensors]:
    """Every expert's gate and up weights fused, gate_up_proj [E, 2F, D], and its down_proj
    [E, D, F] <-> our stacked kernels [E, D, F] and [E, F, D]."""
    return [Tensors((f"{hf}.experts.gate_up_proj",), (f"{ours}/ff_gate", f"{ours}/ff_in"),
                    lambda a: [w.transpose(0, 2, 1) for w in np.split(a[0], 2, axis=1)],
                    lambda a: [np.concatenate([w.transpose(0, 2, 1) for w in a], axis=1)]),
            Tensors((f"{hf}.experts.down_proj",), (f"{ours}/ff_out",),
                    lambda a: [a[0].transpose(0, 2, 1)], lambda a: [a[0].transpose(0, 2, 1)])]


def _routed_mismatches(cfg: TransformerConfig, family: str) -> list[str]:
    """What a routed family (Mixtral, Qwen3 MoE) wants beyond its keys: routed layers, and one
    window in every layer."""
    out = []
    if not cfg.num_experts:
        out.append("model.num_experts=0 (wants routed layers)")
    if len({cfg.layer_window(i) for i in range(cfg.num_decoder_layers)}) > 1:
        out.append(f"model.attention_pattern={cfg.attention_pattern!r} ({family}'s window "
                   f"is in every layer)")
    return out

class Mixtral:
    """`MixtralForCausalLM`: Mistral's decoder (its window in every layer or none) with every
    feed-forward layer routed (docs/moe.md): the softmax (float32) of a router picks the top
    `num_experts_per_tok` of `num_local_experts` SwiGLU experts, their weights renormalised to
    sum to 1 (`moe_router_scores="softmax"`, `moe_renormalize`), no shared expert. Dropless."""

    model_types = ("mixtral",)

    @staticmethod
    def config(hf: dict) -> dict:
        require(hf, "mixtral", "router_jitter_noise", (0.0, None), "our router has no jitter, "
                "which only perturbs training: set it to 0 to import the weights")
        return Llama.config(hf) | dict(
            num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
            moe_layer_interval=1, moe_router_scores="softmax", moe_renormalize=True,
            moe_shared_expert=False, moe_capacity_factor=0.0,
            moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss_coef=0.0)

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        out = {key: value for key, value in Llama.hf_config(cfg).items()
               if key not in ("attention_bias", "mlp_bias")}
        return out | dict(
            model_type="mixtral", architectures=["MixtralForCausalLM"],
            sliding_window=None if cfg.attention_window is None else cfg.attention_window + 1,
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.moe_aux_loss_coef, router_jitter_noise=0.0,
            output_router_logits=False)

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        out = mismatches(cfg, windows=True, rope_scaling=cfg.rope_scaling,
                          architecture="decoder", positional="rope", norm="rms_norm",
                          norm_position="pre", activation="swiglu", use_bias=False,
                          scale_embeddings=False, num_experts=cfg.num_experts,
                          moe_layer_interval=1, moe_router_scores="softmax",
                          moe_renormalize=True, moe_shared_expert=False)
        return out + _routed_mismatches(cfg, "Mixtral")

    @staticmethod
    def import_tensors(cfg: TransformerConfig, hf: dict, names: set[str]) -> list[Tensors]:
        """`tensors`, or where the checkpoint holds `transformers`' fused experts
        (mlp.experts.gate_up_proj: a `state_dict` saved as it is), those."""
        if "model.layers.0.mlp.experts.gate_up_proj" not in names:
            return Mixtral.tensors(cfg)
        out = [group for group in Llama.tensors(cfg) if "/ffn/" not in group.ours[0]]
        for i in range(cfg.num_decoder_layers):
            hf_moe = f"model.layers.{i}.mlp"
            ours = f"decoder/layers_{i}/moe"
            out += [transposed(f"{hf_moe}.gate.weight", f"{ours}/router"),
                    *_fused_experts(hf_moe, ours)]
        return out

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        """Llama's groups but the dense feed-forward's, and each layer's router and experts
        (per expert, as the Hub's checkpoints and `save_pretrained` hold them)."""
        out = [group for group in Llama.tensors(cfg) if "/ffn/" not in group.ours[0]]
        for i in range(cfg.num_decoder_layers):
            hf = f"model.layers.{i}.block_sparse_moe"
            ours = f"decoder/layers_{i}/moe"
            out += [transposed(f"{hf}.gate.weight", f"{ours}/router"),
                    _experts(hf, cfg.num_experts, "w1", f"{ours}/ff_gate"),
                    _experts(hf, cfg.num_experts, "w3", f"{ours}/ff_in"),
                    _experts(hf, cfg.num_experts, "w2", f"{ours}/ff_out")]
        return out


class Qwen3Moe:
    """`Qwen3MoeForCausalLM`: Qwen3's decoder (`Llama`) with every `decoder_sparse_step`-th
    feed-forward layer routed: the softmax (float32) of a router picks the top
    `num_experts_per_tok` of its SwiGLU experts, their weights renormalised to sum to 1 where
    `norm_topk_prob` (`moe_renormalize`), no shared expert. Dropless. Its window, where
    `use_sliding_window`, is in every layer."""

    model_types = ("qwen3_moe",)

    @staticmethod
    def config(hf: dict) -> dict:
        kind = "qwen3_moe"
        require(hf, kind, "mlp_only_layers", ([], None), "dense layers only where "
                "decoder_sparse_step puts them (model.moe_layer_interval)")
        step = int(hf.get("decoder_sparse_step") or 1)
        if step > 1 and hf["moe_intermediate_size"] != hf["intermediate_size"]:
            raise unsupported(kind, "decoder_sparse_step", step, "our dense and routed "
                              "layers share model.d_ff: set 1, or moe_intermediate_size "
                              "equal to intermediate_size")
        return Llama.config(hf) | dict(
            d_ff=hf["moe_intermediate_size"],
            num_experts=hf.get("num_local_experts") or hf["num_experts"],
            experts_per_token=hf["num_experts_per_tok"], moe_layer_interval=step,
            moe_router_scores="softmax", moe_renormalize=bool(hf.get("norm_topk_prob")),
            moe_shared_expert=False, moe_capacity_factor=0.0,
            moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss_coef=0.0)

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        out = {key: value for key, value in Llama.hf_config(cfg).items()
               if key != "layer_types"}
        return out | dict(
            model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
            moe_intermediate_size=cfg.d_ff, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            decoder_sparse_step=cfg.moe_layer_interval, mlp_only_layers=[],
            norm_topk_prob=cfg.moe_renormalize, router_aux_loss_coef=cfg.moe_aux_loss_coef,
            output_router_logits=False)

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        out = mismatches(cfg, windows=True, rope_scaling=cfg.rope_scaling,
                          architecture="decoder", positional="rope", norm="rms_norm",
                          norm_position="pre", activation="swiglu", use_bias=False,
                          scale_embeddings=False, num_experts=cfg.num_experts, qk_norm="head",
                          moe_router_scores="softmax", moe_shared_expert=False)
        return out + _routed_mismatches(cfg, "Qwen3 MoE")

    @staticmethod
    def import_tensors(cfg: TransformerConfig, hf: dict, names: set[str]) -> list[Tensors]:
        """`tensors`, or `transformers`' fused experts where the checkpoint holds them."""
        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in names)
        return Qwen3Moe.tensors(cfg, fused)

    @staticmethod
    def tensors(cfg: TransformerConfig, fused: bool = False) -> list[Tensors]:
        """Llama's (Qwen3's) groups but a routed layer's dense feed-forward, and each routed
        layer's router and experts (per expert, as the Hub's checkpoints hold them, or
        fused)."""
        routed = [i for i in range(cfg.num_decoder_layers) if cfg.routed(i)]
        dense = [group for group in Llama.tensors(cfg) if not any(
            group.ours[0].startswith(f"decoder/layers_{i}/ffn/") for i in routed)]
        out = dense
        for i in routed:
            hf = f"model.layers.{i}.mlp"
            ours = f"decoder/layers_{i}/moe"
            out.append(transposed(f"{hf}.gate.weight", f"{ours}/router"))
            out += _fused_experts(hf, ours) if fused else [
                _experts(hf, cfg.num_experts, f"{name}_proj", f"{ours}/ff_{part}")
                for name, part in (("gate", "gate"), ("up", "in"), ("down", "out"))]
        return out


GPT2_UNSUPPORTED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                    "add_cross_attention")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class GPT2:
    """`GPT2LMHeadModel`: pre-LayerNorm, learned positions, tanh GELU, biases, tied output."""

    model_types = ("gpt2",)
    ignored = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old checkpoints

    @staticmethod
    def config(hf: dict) -> dict:
        require(hf, "gpt2", "activation_function", GELU_TANH, "only GELU's tanh approximation")
        require(hf, "gpt2", "scale_attn_weights", (True,), "attention scales by 1/sqrt(H)")
        for option in GPT2_UNSUPPORTED:
            require(hf, "gpt2", option, (False,), "not implemented")
        require(hf, "gpt2", "tie_word_embeddings", (True,), "GPT-2's output is the embedding")
        d = hf["n_embd"]
        return dict(
            architecture="decoder", vocab_size=hf["vocab_size"], num_encoder_layers=0,
            num_decoder_layers=hf["n_layer"], d_model=d, d_ff=hf.get("n_inner") or 4 * d,
            num_heads=hf["n_head"], num_kv_heads=hf["n_head"],
            dropout_rate=float(hf.get("resid_pdrop", 0.1)),
            attention_dropout_rate=float(hf.get("attn_pdrop", 0.1)), relu_dropout_rate=0.0,
            positional="learned", norm="layer_norm", norm_position="pre", activation="gelu",
            gelu_approximate=True, use_bias=True, tie_output_embedding=True,
            max_len=hf["n_positions"], norm_eps=float(hf["layer_norm_epsilon"]),
            scale_embeddings=False, **token_ids(hf))

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        return dict(
            model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
            n_embd=cfg.d_model, n_inner=cfg.d_ff, n_layer=cfg.num_decoder_layers,
            n_head=cfg.num_heads, n_positions=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
            activation_function="gelu_new", resid_pdrop=cfg.dropout_rate,
            embd_pdrop=cfg.dropout_rate, attn_pdrop=cfg.attention_dropout_rate,
            tie_word_embeddings=True, **token_ids_config(cfg))

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        return mismatches(cfg, architecture="decoder", positional="learned",
                           norm="layer_norm", norm_position="pre", activation="gelu",
                           gelu_approximate=True, use_bias=True, tie_output_embedding=True,
                           scale_embeddings=False, num_kv_heads=cfg.num_heads,
                           d_k=cfg.d_model // cfg.num_heads, d_v=cfg.d_model // cfg.num_heads)

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        n = cfg.num_heads
        h = cfg.d_k
        d = cfg.d_model
        out = [same("transformer.wte.weight", "embedding/embedding"),
               same("transformer.wpe.weight", "decoder/embedder/position_embedding/embedding")]
        for i in range(cfg.num_decoder_layers):
            hf = f"transformer.h.{i}"
            ours = f"decoder/layers_{i}"
            attn = f"{ours}/self_attention"
            qkv = tuple(f"{attn}/{name}" for name in ("query", "key", "value"))
            out += [
                Tensors((f"{hf}.attn.c_attn.weight",), tuple(f"{p}/kernel" for p in qkv),
                        lambda a: [w.reshape(d, n, h) for w in np.split(a[0], 3, axis=1)],
                        lambda a: [np.concatenate([w.reshape(d, -1) for w in a], axis=1)]),
                Tensors((f"{hf}.attn.c_attn.bias",), tuple(f"{p}/bias" for p in qkv),
                        lambda a: [b.reshape(n, h) for b in np.split(a[0], 3)],
                        lambda a: [np.concatenate([b.reshape(-1) for b in a])]),
                Tensors((f"{hf}.attn.c_proj.weight",), (f"{attn}/out/kernel",),
                        lambda a: [a[0].reshape(n, h, d)], lambda a: [a[0].reshape(n * h, d)]),
                same(f"{hf}.attn.c_proj.bias", f"{attn}/out/bias"),
                same(f"{hf}.mlp.c_fc.weight", f"{ours}/ffn/ff_in/kernel"),
                same(f"{hf}.mlp.c_fc.bias", f"{ours}/ffn/ff_in/bias"),
                same(f"{hf}.mlp.c_proj.weight", f"{ours}/ffn/ff_out/kernel"),
                same(f"{hf}.mlp.c_proj.bias", f"{ours}/ffn/ff_out/bias"),
                *norm(f"{hf}.ln_1", f"{ours}/norm_attention", True),
                *norm(f"{hf}.ln_2", f"{ours}/norm_ffn", True)]
        return out + norm("transformer.ln_f", "decoder/norm", True)


class ViT:
    """`ViTForImageClassification`: the Vision Transformer with its class-token classifier."""

    model_types = ("vit",)

    @staticmethod
    def config(hf: dict) -> dict:
        require(hf, "vit", "hidden_act", ("gelu",) + GELU_TANH, "GELU only")
        require(hf, "vit", "qkv_bias", (True,), "our ViT's projections all carry biases")
        labels = hf.get("id2label") or {}
        return dict(
            architecture="vision", num_encoder_layers=hf["num_hidden_layers"],
            num_decoder_layers=0, d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
            num_heads=hf["num_attention_heads"],
            dropout_rate=float(hf.get("hidden_dropout_prob", 0.0)),
            attention_dropout_rate=float(hf.get("attention_probs_dropout_prob", 0.0)),
            relu_dropout_rate=0.0, positional="learned", norm="layer_norm",
            norm_position="pre", activation="gelu", gelu_approximate=hf["hidden_act"] != "gelu",
            use_bias=True, norm_eps=float(hf["layer_norm_eps"]), image_size=hf["image_size"],
            patch_size=hf["patch_size"], num_channels=hf.get("num_channels", 3),
            num_classes=hf.get("num_labels") or len(labels) or 2, pooling="cls")

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        return dict(
            model_type="vit", architectures=["ViTForImageClassification"],
            hidden_size=cfg.d_model, num_hidden_layers=cfg.num_encoder_layers,
            num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff,
            hidden_act="gelu_pytorch_tanh" if cfg.gelu_approximate else "gelu",
            hidden_dropout_prob=cfg.dropout_rate,
            attention_probs_dropout_prob=cfg.attention_dropout_rate, layer_norm_eps=cfg.norm_eps,
            image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.num_channels,
            qkv_bias=True, id2label={str(i): f"LABEL_{i}" for i in range(cfg.num_classes)},
            label2id={f"LABEL_{i}": i for i in range(cfg.num_classes)})

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        return mismatches(cfg, architecture="vision", positional="learned", norm="layer_norm",
                           norm_position="pre", activation="gelu", use_bias=True,
                           pooling="cls", num_kv_heads=cfg.num_heads,
                           d_k=cfg.d_model // cfg.num_heads, d_v=cfg.d_model // cfg.num_heads)

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        n = cfg.num_heads
        h = cfg.d_k
        p = cfg.patch_size
        c = cfg.num_channels
        emb = "vit.embeddings"
        # Our patch vector is flattened (row, column, channel): the conv weight [D, C, P, P]
        # read as [P, P, C, D].
        out = [
            Tensors((f"{emb}.patch_embeddings.projection.weight",), ("patch_embedding/kernel",),
                    lambda a: [a[0].transpose(2, 3, 1, 0).reshape(p * p * c, -1)],
                    lambda a: [a[0].reshape(p, p, c, -1).transpose(3, 2, 0, 1)]),
            same(f"{emb}.patch_embeddings.projection.bias", "patch_embedding/bias"),
            Tensors((f"{emb}.cls_token",), ("class_token",), lambda a: [a[0].reshape(-1)],
                    lambda a: [a[0].reshape(1, 1, -1)]),
            Tensors((f"{emb}.position_embeddings",), ("position_embedding",),
                    lambda a: [a[0][0]], lambda a: [a[0][None]])]
        for i in range(cfg.num_encoder_layers):
            hf = f"vit.encoder.layer.{i}"
            ours = f"encoder/layers_{i}"
            attn = f"{ours}/self_attention"
            for name in ("query", "key", "value"):
                weight = f"{hf}.attention.attention.{name}"
                out += [heads_in(f"{weight}.weight", f"{attn}/{name}/kernel", n, h),
                        bias_heads(f"{weight}.bias", f"{attn}/{name}/bias", n, h)]
            out += [
                heads_out(f"{hf}.attention.output.dense.weight", f"{attn}/out/kernel", n, h),
                same(f"{hf}.attention.output.dense.bias", f"{attn}/out/bias"),
                transposed(f"{hf}.intermediate.dense.weight", f"{ours}/ffn/ff_in/kernel"),
                same(f"{hf}.intermediate.dense.bias", f"{ours}/ffn/ff_in/bias"),
                transposed(f"{hf}.output.dense.weight", f"{ours}/ffn/ff_out/kernel"),
                same(f"{hf}.output.dense.bias", f"{ours}/ffn/ff_out/bias"),
                *norm(f"{hf}.layernorm_before", f"{ours}/norm_attention", True),
                *norm(f"{hf}.layernorm_after", f"{ours}/norm_ffn", True)]
        return out + norm("vit.layernorm", "encoder/norm", True) + [
            transposed("classifier.weight", "head/kernel"), same("classifier.bias", "head/bias")]


# Mixtral before Llama: a routed model one option away from it is closest to Mixtral.
FAMILIES = (Mixtral, Qwen3Moe, Llama, Olmo2, Gemma2, Gemma3, GPT2, ViT, Marian, T5)
BY_MODEL_TYPE = {kind: family for family in FAMILIES for kind in family.model_types}


def for_checkpoint(hf_config: dict, source: str) -> type:
    """The family of a checkpoint's config.json (`source` names it in errors)."""
    kind = hf_config.get("model_type")
    if kind not in BY_MODEL_TYPE:
        raise ValueError(f"{source}: model_type={kind!r} is not supported; supported: "
                         f"{', '.join(sorted(BY_MODEL_TYPE))}")
    return BY_MODEL_TYPE[kind]


def for_model(cfg: TransformerConfig, source: str) -> type:
    """The family our model config `cfg` is exactly (`source` names the run in errors)."""
    problems = {}
    for family in FAMILIES:
        problems[family.__name__] = family.matches(cfg)
        if not problems[family.__name__]:
            return family
    closest = min(problems, key=lambda name: len(problems[name]))
    raise ValueError(f"{source}: the model is none of the exportable families; closest is "
                     f"{closest}, which differs in {'; '.join(problems[closest])}")
