"""Llama's family: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and
`Qwen3ForCausalLM`, and OLMo 2 (`Olmo2ForCausalLM`) beside it. Mixtral, Qwen3 MoE and the
Gemmas build on its tensors (`families.py`, `gemma.py`).

Checkpoint layout (`torch.nn.Linear` weight [out, in]): q_proj [N*H, D], k_proj/v_proj
[K*H, D], o_proj [D, N*H], gate/up_proj [F, D], down_proj [D, F], RMSNorm weights, lm_head
[V, D] (absent when tied); Mistral the same; Qwen2 adds q_proj/k_proj/v_proj biases [N*H],
[K*H]; Qwen3 instead q_norm/k_norm [H] (RMSNorm of each head, `model.qk_norm="head"`). OLMo 2:
Llama's tensors with q_norm [N*H], k_norm [K*H] (over all heads, `qk_norm="full"`) and, per
layer, post_attention_layernorm and post_feedforward_layernorm (ours: norm_attention, norm_ffn)
normalising each sublayer's output (`norm_position="output"`), no input_layernorm.
"""

from __future__ import annotations

import dataclasses

from transformer.huggingface.mapping import (
    Tensors,
    bias_heads,
    heads_in,
    heads_out,
    mismatches,
    norm,
    require,
    rope_fields,
    rope_parameters,
    same,
    token_ids,
    token_ids_config,
    transposed,
    unsupported,
)
from transformer.model.config import TransformerConfig

WINDOWED = {"sliding_attention": "local", "full_attention": "global"}  # layer_types entries
QWEN = ("qwen2", "qwen3", "qwen3_moe")  # a window only where use_sliding_window says so


def _window_fields(hf: dict, kind: str) -> dict:
    """`attention_window` and `attention_pattern` of a sliding window: Mistral's (every layer)
    or Qwen2's and Qwen3's (`use_sliding_window`, the layers its `layer_types` say, else those
    from `max_window_layers` on), or Qwen3 MoE's (`use_sliding_window`, every layer).
    `transformers`' window of w keys (the query's own included) is our attention_window w - 1
    (the keys before it)."""
    window = hf.get("sliding_window")
    if kind in QWEN and not hf.get("use_sliding_window"):
        window = None
    if window is None:
        return {}
    if window < 2:
        raise unsupported(kind, "sliding_window", window, "a window of at least 2 keys")
    layers = hf["num_hidden_layers"]
    if kind in ("qwen2", "qwen3"):  # Qwen3 MoE's window is in every layer
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)]
        pattern = ",".join(WINDOWED[t] for t in types)
    else:
        pattern = "local"
    if "local" not in pattern:
        return {}
    return dict(attention_window=int(window) - 1, attention_pattern=pattern)


class Llama:
    """`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`:
    pre-RMSNorm, half-split RoPE (scaled as Llama 3.1's, linearly or by YaRN), SwiGLU,
    grouped-query attention; Mistral's sliding window and Qwen2's and Qwen3's (the project's
    local attention, layer by layer), Qwen2's query, key and value biases and Qwen3's RMSNorm
    of each query and key head."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    @staticmethod
    def config(hf: dict) -> dict:
        kind = hf["model_type"]
        require(hf, kind, "hidden_act", ("silu",), "only SwiGLU's silu gate")
        for option in ("attention_bias", "mlp_bias"):
            require(hf, kind, option, (None, False), "our Llama blocks have no biases but "
                     "Qwen2's on the query, key and value")
        if kind == "llama":
            require(hf, kind, "sliding_window", (None,), "a sliding window is Mistral's")
        require(hf, kind, "pretraining_tp", (1,), "save the checkpoint unsplit")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return dict(
            architecture="decoder", vocab_size=hf["vocab_size"], num_encoder_layers=0,
            num_decoder_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
            d_ff=hf["intermediate_size"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads, d_k=head_dim, d_v=head_dim,
            dropout_rate=0.0, attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
            relu_dropout_rate=0.0, positional="rope", norm="rms_norm", norm_position="pre",
            activation="swiglu", use_bias=False, qkv_bias=kind == "qwen2",
            qk_norm="head" if kind in ("qwen3", "qwen3_moe") else "none",
            tie_output_embedding=bool(hf.get("tie_word_embeddings", False)),
            max_len=hf["max_position_embeddings"], norm_eps=float(hf["rms_norm_eps"]),
            scale_embeddings=False, **rope_fields(hf, kind), **_window_fields(hf, kind),
            **token_ids(hf))

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        """Qwen2 where the projections carry biases, Qwen3 where each head's query and key are
        normalised, else Mistral where every layer has a window, else Llama."""
        out = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.num_decoder_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.d_k, hidden_act="silu",
            max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
            rope_parameters=rope_parameters(cfg), attention_dropout=cfg.attention_dropout_rate,
            tie_word_embeddings=cfg.tie_output_embedding, **token_ids_config(cfg))
        windows = [cfg.layer_window(i) for i in range(cfg.num_decoder_layers)]
        if cfg.qkv_bias or cfg.qk_norm == "head":
            kind = "qwen2" if cfg.qkv_bias else "qwen3"
            out.update(model_type=kind, architectures=[f"{kind.title()}ForCausalLM"],
                       use_sliding_window=cfg.attention_window is not None,
                       sliding_window=None if cfg.attention_window is None
                       else cfg.attention_window + 1,
                       layer_types=["full_attention" if w is None else "sliding_attention"
                                    for w in windows])
            if kind == "qwen3":
                out.update(attention_bias=False)
        elif cfg.attention_window is not None:
            out.update(model_type="mistral", architectures=["MistralForCausalLM"],
                       sliding_window=cfg.attention_window + 1)
        else:
            out.update(model_type="llama", architectures=["LlamaForCausalLM"],
                       attention_bias=False, mlp_bias=False)
        return out

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        qk_norm = "head" if cfg.qk_norm == "head" and not cfg.qkv_bias else "none"
        out = mismatches(cfg, windows=True, qkv_bias=cfg.qkv_bias, qk_norm=qk_norm,
                          rope_scaling=cfg.rope_scaling, architecture="decoder",
                          positional="rope", norm="rms_norm", norm_position="pre",
                          activation="swiglu", use_bias=False, scale_embeddings=False)
        windows = {cfg.layer_window(i) for i in range(cfg.num_decoder_layers)}
        if not (cfg.qkv_bias or qk_norm == "head") and None in windows and len(windows) > 1:
            out.append(f"model.attention_pattern={cfg.attention_pattern!r} (Mistral's window "
                       f"is in every layer; local and global layers are Qwen2's, with "
                       f"model.qkv_bias=True, or Qwen3's, with model.qk_norm='head')")
        return out

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        n = cfg.num_heads
        k = cfg.num_kv_heads
        h = cfg.d_k
        out = [same("model.embed_tokens.weight", "embedding/embedding")]
        for i in range(cfg.num_decoder_layers):
            hf = f"model.layers.{i}"
            ours = f"decoder/layers_{i}"
            attn = f"{hf}.self_attn"
            mlp = f"{hf}.mlp"
            out += [
                heads_in(f"{attn}.q_proj.weight", f"{ours}/self_attention/query/kernel", n, h),
                heads_in(f"{attn}.k_proj.weight", f"{ours}/self_attention/key/kernel", k, h),
                heads_in(f"{attn}.v_proj.weight", f"{ours}/self_attention/value/kernel", k, h),
                heads_out(f"{attn}.o_proj.weight", f"{ours}/self_attention/out/kernel", n, h),
                transposed(f"{mlp}.gate_proj.weight", f"{ours}/ffn/ff_gate/kernel"),
                transposed(f"{mlp}.up_proj.weight", f"{ours}/ffn/ff_in/kernel"),
                transposed(f"{mlp}.down_proj.weight", f"{ours}/ffn/ff_out/kernel"),
                *norm(f"{hf}.input_layernorm", f"{ours}/norm_attention", False),
                *norm(f"{hf}.post_attention_layernorm", f"{ours}/norm_ffn", False)]
            if cfg.qkv_bias:
                out += [bias_heads(f"{attn}.{name[0]}_proj.bias",
                                    f"{ours}/self_attention/{name}/bias", heads, h)
                        for name, heads in (("query", n), ("key", k), ("value", k))]
            out += _qk_norms(cfg, attn, f"{ours}/self_attention")
        out += norm("model.norm", "decoder/norm", False)
        if not cfg.tie_output_embedding:
            out.append(transposed("lm_head.weight", "decoder/logits/kernel"))
        return out


def _qk_norms(cfg: TransformerConfig, hf: str, ours: str) -> list[Tensors]:
    """q_norm and k_norm of attention `hf` <-> our query_norm and key_norm scales: [H] each
    ("head"), or [N*H] and [K*H] <-> [N, H] and [K, H] ("full"); none without `qk_norm`."""
    if cfg.qk_norm == "none":
        return []
    if cfg.qk_norm == "head":
        return [same(f"{hf}.q_norm.weight", f"{ours}/query_norm/scale"),
                same(f"{hf}.k_norm.weight", f"{ours}/key_norm/scale")]
    return [bias_heads(f"{hf}.q_norm.weight", f"{ours}/query_norm/scale", cfg.num_heads,
                       cfg.d_k),
            bias_heads(f"{hf}.k_norm.weight", f"{ours}/key_norm/scale", cfg.num_kv_heads,
                       cfg.d_k)]


# Llama's norm before each sublayer -> OLMo 2's after it, by the checkpoint's names.
OLMO2_NORMS = {".input_layernorm.weight": ".post_attention_layernorm.weight",
               ".post_attention_layernorm.weight": ".post_feedforward_layernorm.weight"}


class Olmo2:
    """`Olmo2ForCausalLM`: Llama's decoder with each sublayer's output normalised inside the
    residual branch, x + RMSNorm(Sublayer(x)) (`norm_position="output"`; a final norm as
    pre-LN's), and RMSNorm over all heads' queries and over all heads' keys before RoPE
    (`qk_norm="full"`)."""

    model_types = ("olmo2",)

    @staticmethod
    def config(hf: dict) -> dict:
        return Llama.config(hf) | dict(norm_position="output", qk_norm="full")

    @staticmethod
    def hf_config(cfg: TransformerConfig) -> dict:
        out = {key: value for key, value in Llama.hf_config(cfg).items()
               if key not in ("mlp_bias",)}
        return out | dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"],
                          attention_bias=False)

    @staticmethod
    def matches(cfg: TransformerConfig) -> list[str]:
        return mismatches(cfg, rope_scaling=cfg.rope_scaling, architecture="decoder",
                          positional="rope", norm="rms_norm", norm_position="output",
                          activation="swiglu", use_bias=False, scale_embeddings=False,
                          qk_norm="full")

    @staticmethod
    def tensors(cfg: TransformerConfig) -> list[Tensors]:
        """Llama's tensors, its two norms of a layer renamed to OLMo 2's (`OLMO2_NORMS`)."""
        out = []
        for group in Llama.tensors(cfg):
            name = group.hf[0]
            suffix = next((old for old in OLMO2_NORMS if name.endswith(old)), None)
            if suffix and name.startswith("model.layers."):
                name = name.removesuffix(suffix) + OLMO2_NORMS[suffix]
                group = dataclasses.replace(group, hf=(name,))
            out.append(group)
        return out
