"""Gemma 2 (`Gemma2ForCausalLM`): Llama's layout with a norm before and after each sublayer
(`model.post_sublayer_norm`), RMSNorm weights stored as scale - 1 (`norm_scale_offset=1`),
attention and output logits soft-capped (`attention_logit_softcap`, `logits_softcap`),
attention scaled by `query_pre_attn_scalar`^-1/2 (`attention_scale_dim`), a GELU-gated
feed-forward (`activation="geglu"`), embeddings times sqrt(D), a tied output, and local
(sliding window) and global layers alternating as its `layer_types` say.

Gemma 3's text model (`Gemma3ForCausalLM`, model_type gemma3_text) is Gemma 2's with an
RMSNorm of each query and key head before RoPE (`model.qk_norm="head"`, scale - 1 stored as
the other norms), usually no soft-capping, and its local layers' own RoPE base (10k beside the
global layers' 1M, `rope_local_theta`; its config.json's `rope_parameters` per layer type).

Checkpoint layout (`torch.nn.Linear` weight [out, in]): Llama's tensors, and per layer
    input_layernorm, post_attention_layernorm    (ours: norm_attention, post_norm_attention)
    pre_feedforward_layernorm, post_feedforward_layernorm   (norm_ffn, post_norm_ffn)
and Gemma 3's self_attn.q_norm, k_norm [H] (query_norm, key_norm).
"""

from __future__ import annotations

from transformer.huggingface.llama import WINDOWED, Llama
from transformer.huggingface.mapping import (
    Tensors,
    mismatches,
    norm,
    require,
    rope_fields,
    rope_parameters,
    token_ids,
    token_ids_config,
    unsupported,
)
from transformer.model.config import TransformerConfig

GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


class Gemma2:
    """`Gemma2ForCausalLM` <-> our decoder with Gemma 2's options (module docstring)."""

    model_types = ("gemma2",)

    @staticmethod
    def config(hf: dict) -> dict:
        kind = hf.get("model_type", "gemma2")
        require(hf, kind, "hidden_activation", GELU_TANH + ("gelu",), "a GELU gate")
        require(hf, kind, "attention_bias", (False,), "no biases")
        require(hf, kind, "use_bidirectional_attention", (None, False), "causal attention")
        require(hf, kind, "tie_word_embeddings", (True,), "Gemma's output is its embedding")
        heads = hf["num_attention_heads"]
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        pattern = ",".join(WINDOWED[t] for t in types)
        window = hf.get("sliding_window")
        if "local" in pattern and (window is None or window < 2):
            raise unsupported(kind, "sliding_window", window, "a window of at least 2 keys")
        local = "local" in pattern
        fields = rope_fields(hf, kind)
        return dict(
            architecture="decoder", vocab_size=hf["vocab_size"], num_encoder_layers=0,
            num_decoder_layers=layers, d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            d_k=hf["head_dim"], d_v=hf["head_dim"], dropout_rate=0.0,
            attention_dropout_rate=float(hf.get("attention_dropout") or 0.0),
            relu_dropout_rate=0.0, positional="rope", norm="rms_norm", norm_position="pre",
            activation="geglu", gelu_approximate=hf["hidden_activation"] != "gelu",
            use_bias=False, tie_output_embedding=True, max_len=hf["max_position_embeddings"],
            norm_eps=float(hf["rms_norm_eps"]), scale_embeddings=True,
            post_sublayer_norm=True, norm_scale_offset=1.0,
            attention_logit_softcap=hf.get("attn_logit_softcapping"),
            logits_softcap=hf.get("final_logit_softcapping"),
            attention_scale_dim=int(hf["query_pre_attn_scalar"]),
            attention_window=int(window) - 1 if local else None,
            attention_pattern=pattern if local else "global", **fields, **token_ids(hf))

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        layer_types = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention"
                       for i in range(cfg.num_decoder_layers)]
        return dict(
            model_type="gemma2", architectures=["Gemma2ForCausalLM"],
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.num_decoder_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.d_k,
            hidden_activation="gelu_pytorch_tanh" if cfg.gelu_approximate else "gelu",
            max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
            rope_parameters=rope_parameters(cfg), attention_bias=False,
            attention_dropout=cfg.attention_dropout_rate,
            query_pre_attn_scalar=cfg.attention_scale_dim or cfg.d_k,
            sliding_window=None if cfg.attention_window is None else cfg.attention_window + 1,
            layer_types=layer_types, final_logit_softcapping=cfg.logits_softcap,
            attn_logit_softcapping=cfg.attention_logit_softcap, tie_word_embeddings=True,
            **token_ids_config(cfg))

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        return mismatches(
            cfg, windows=True, rope_scaling=cfg.rope_scaling, architecture="decoder",
            positional="rope", norm="rms_norm", norm_position="pre", activation="geglu",
            use_bias=False, tie_output_embedding=True, scale_embeddings=True,
            post_sublayer_norm=True, norm_scale_offset=1.0,
            attention_logit_softcap=cfg.attention_logit_softcap,
            logits_softcap=cfg.logits_softcap, attention_scale_dim=cfg.attention_scale_dim)

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        """Llama's tensors with a norm after each sublayer: Llama's post_attention_layernorm
        (our norm_ffn) is Gemma's norm after the attention, and pre_feedforward_layernorm
        takes its place before the feed-forward."""
        out = []
        for group in Llama.tensors(cfg):
            if not group.hf[0].endswith(".post_attention_layernorm.weight"):
                out.append(group)
                continue
            hf = group.hf[0].removesuffix(".post_attention_layernorm.weight")
            ours = group.ours[0].removesuffix("/norm_ffn/scale")
            out += [
                *norm(f"{hf}.post_attention_layernorm", f"{ours}/post_norm_attention", False),
                *norm(f"{hf}.pre_feedforward_layernorm", f"{ours}/norm_ffn", False),
                *norm(f"{hf}.post_feedforward_layernorm", f"{ours}/post_norm_ffn", False)]
        return out


class Gemma3:
    """`Gemma3ForCausalLM` (gemma3_text) <-> our decoder with Gemma 2's options, q/k norm and
    the local layers' RoPE base (module docstring)."""

    model_types = ("gemma3_text",)

    @staticmethod
    def config(hf: dict) -> dict:
        kind = "gemma3_text"
        rope = hf.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5: one RoPE per layer type
            local = dict(rope.get("sliding_attention") or {})
            hf = hf | dict(rope_parameters=rope["full_attention"])
        else:  # older configs: rope_theta (and rope_scaling) global, rope_local_base_freq
            local = dict(rope_theta=hf.get("rope_local_base_freq", 10000.0))
        require(local, kind, "rope_type", ("default",), "the local layers' RoPE is unscaled")
        if not hf.get("layer_types"):
            every = int(hf.get("sliding_window_pattern") or 6)
            hf = hf | dict(layer_types=[
                "sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(hf["num_hidden_layers"])])
        fields = Gemma2.config(hf | dict(model_type=kind)) | dict(qk_norm="head")
        if "local" in fields["attention_pattern"].split(","):
            fields.update(rope_local_theta=float(local.get("rope_theta", 10000.0)))
        return fields

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        glob = rope_parameters(cfg)
        local = glob if cfg.rope_local_theta is None else {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta}
        return Gemma2.hf_config(cfg) | dict(
            model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
            rope_parameters={"full_attention": glob, "sliding_attention": local})

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        out = mismatches(
            cfg, windows=True, rope_scaling=cfg.rope_scaling, architecture="decoder",
            positional="rope", norm="rms_norm", norm_position="pre", activation="geglu",
            use_bias=False, tie_output_embedding=True, scale_embeddings=True,
            post_sublayer_norm=True, norm_scale_offset=1.0,
            attention_logit_softcap=cfg.attention_logit_softcap,
            logits_softcap=cfg.logits_softcap, attention_scale_dim=cfg.attention_scale_dim,
            qk_norm="head", rope_local_theta=cfg.rope_local_theta)
        if cfg.rope_local_theta is None and cfg.rope_scaling != "none" and (
                cfg.attention_window is not None):
            out.append(f"model.rope_scaling={cfg.rope_scaling!r} in local layers (Gemma 3's "
                       f"are unscaled: set model.rope_local_theta)")
        return out

    tensors = staticmethod(Gemma2.tensors)
