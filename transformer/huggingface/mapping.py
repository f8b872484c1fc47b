"""What every Hugging Face family mapping is made of (`families`, `marian`): `Tensors`, a group
of checkpoint tensors <-> our parameters and the functions between them, the common layout
changes (transposes, heads split out of projections), and the one-line refusals of a config
option or of a model a family cannot express. Arrays are numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from transformer.model.config import TransformerConfig

Arrays = list[np.ndarray]


@dataclasses.dataclass(frozen=True)
class Tensors:
    """Checkpoint tensors `hf` <-> our parameters `ours` (paths), as one group."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Callable[[Arrays], Arrays]
    to_hf: Callable[[Arrays], Arrays]


def same(hf: str, ours: str) -> Tensors:
    return Tensors((hf,), (ours,), list, list)


def transposed(hf: str, ours: str) -> Tensors:
    """A Linear weight [out, in] <-> our kernel [in, out]."""
    return Tensors((hf,), (ours,), lambda a: [a[0].T], lambda a: [a[0].T])


def heads_in(hf: str, ours: str, heads: int, head_dim: int) -> Tensors:
    """A Linear weight [heads*head_dim, D] <-> our projection kernel [D, heads, head_dim]."""
    return Tensors((hf,), (ours,), lambda a: [a[0].T.reshape(-1, heads, head_dim)],
                   lambda a: [a[0].reshape(a[0].shape[0], -1).T])


def heads_out(hf: str, ours: str, heads: int, head_dim: int) -> Tensors:
    """A Linear weight [D, heads*head_dim] <-> our output kernel [heads, head_dim, D]."""
    return Tensors((hf,), (ours,), lambda a: [a[0].T.reshape(heads, head_dim, -1)],
                   lambda a: [a[0].reshape(heads * head_dim, -1).T])


def bias_heads(hf: str, ours: str, heads: int, head_dim: int) -> Tensors:
    return Tensors((hf,), (ours,), lambda a: [a[0].reshape(heads, head_dim)],
                   lambda a: [a[0].reshape(-1)])


def norm(hf: str, ours: str, bias: bool) -> list[Tensors]:
    return [same(f"{hf}.weight", f"{ours}/scale")] + (
        [same(f"{hf}.bias", f"{ours}/bias")] if bias else [])


def unsupported(model_type: str, option: str, value, fix: str) -> ValueError:
    return ValueError(f"config.json: {model_type} option {option}={value!r} is not supported "
                      f"({fix})")


def require(hf: dict, model_type: str, option: str, allowed, fix: str) -> None:
    value = hf.get(option, allowed[0])
    if value not in allowed:
        raise unsupported(model_type, option, value, fix)


def token_ids(hf: dict) -> dict:
    """A language model's `bos_id`, `eos_id` and `pad_id` from its config.json: the first eos
    where it lists several (Llama 3.1's chat ends). Pad 0 only where the checkpoint pads with
    id 0, else None (id 0 is an ordinary token)."""
    bos = hf.get("bos_token_id")
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if bos is None or eos is None:
        raise unsupported(hf["model_type"], "bos_token_id/eos_token_id", (bos, eos),
                           "the decoder needs a start and an end token")
    return dict(bos_id=int(bos), eos_id=int(eos), pad_id=0 if hf.get("pad_token_id") == 0
                else None)


def end_ids(hf: dict, generation: dict | None) -> tuple[int, ...]:
    """Every id `transformers`' `generate` ends a text at: generation_config.json's
    `eos_token_id` (an int or a list) where `generation` gives one, else config.json's (the
    tokenizer puts our `eos_id` first and drops repeats)."""
    listed = (generation or {}).get("eos_token_id")
    listed = hf.get("eos_token_id") if listed is None else listed
    listed = listed if isinstance(listed, list) else [listed]
    return tuple(int(i) for i in listed if i is not None)


def generation_config(cfg: TransformerConfig, eos_ids: tuple[int, ...]) -> dict:
    """generation_config.json of our model `cfg` whose vocabulary ends texts at `eos_ids`
    (`end_ids` read back)."""
    return dict(bos_token_id=cfg.bos_id, eos_token_id=list(eos_ids), pad_token_id=cfg.pad_id)


def token_ids_config(cfg: TransformerConfig) -> dict:
    """config.json's special token ids of our model `cfg` (`token_ids` read back)."""
    return dict(bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id)


# Model options a family computes only where it says so (`_mismatches`' `wanted`): their
# values in the paper's model.
FEATURE_DEFAULTS = dict(qkv_bias=False, rope_scaling="none", logits_bias=False,
                        post_sublayer_norm=False, norm_scale_offset=0.0,
                        attention_logit_softcap=None, logits_softcap=None,
                        attention_scale_dim=None, num_experts=0, qk_norm="none",
                        rope_local_theta=None)


def mismatches(cfg: TransformerConfig, windows: bool = False, **wanted) -> list[str]:
    """`model.<field>=<ours> (wants <theirs>)` for each field that differs (those of
    `FEATURE_DEFAULTS` the family does not name included). Also every self-attention option
    beyond softmax over all positions, or over a causal window where `windows`."""
    wanted = FEATURE_DEFAULTS | wanted
    out = [f"model.{field}={getattr(cfg, field)!r} (wants {value!r})"
           for field, value in wanted.items() if getattr(cfg, field) != value]
    if cfg.attention_kind != "softmax" or cfg.attention_global_tokens or (
            cfg.attention_window is not None and not windows):
        out.append("model.attention_kind/attention_window/attention_global_tokens (wants "
                   "softmax over " + ("all positions or a window)" if windows
                                      else "all positions)"))
    return out


ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


def rope_fields(hf: dict, kind: str) -> dict:
    """`model.rope_*` of a config.json's RoPE (`rope_parameters`, or the older `rope_scaling`
    and `rope_theta`): its base and scaling, the scaled context defaulting to
    max_position_embeddings as `transformers` defaults it."""
    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        rope.update(hf["rope_scaling"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise unsupported(kind, "rope_type", rope_type,
                           f"supported: {', '.join(ROPE_TYPES)}; 'dynamic' rescales with each "
                           f"call's length, which static-shape decoding does not reproduce")
    for option in ("partial_rotary_factor", "mscale", "mscale_all_dim"):
        require(rope, kind, option, (None, 1.0) if option == "partial_rotary_factor"
                 else (None,), "not implemented")
    require(rope, kind, "truncate", (True,), "only YaRN's truncated correction range")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields = dict(rope_theta=float(theta), rope_scaling=ROPE_TYPES[rope_type])
    if rope_type == "default":
        return fields
    original = rope.get("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings",
                               hf["max_position_embeddings"]))
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    fields.update(rope_scaling_factor=float(factor))
    if rope_type in ("llama3", "yarn"):
        fields.update(rope_original_max_len=int(original))
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]))
    if rope_type == "yarn":
        fields.update(rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                      rope_beta_slow=float(rope.get("beta_slow") or 1.0))
        if rope.get("attention_factor") is not None:
            fields.update(rope_attention_factor=float(rope["attention_factor"]))
    return fields


def rope_parameters(cfg: TransformerConfig) -> dict:
    """config.json's `rope_parameters` of our model (`rope_fields` read back)."""
    rope = {"rope_type": {v: k for k, v in ROPE_TYPES.items()}[cfg.rope_scaling],
            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope_original_max_len
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    return rope
