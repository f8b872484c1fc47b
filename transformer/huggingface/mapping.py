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
    where it lists several (Llama 3.1's chat ends); pad 0 only where the checkpoint pads with
    id 0, else None (id 0 is an ordinary token)."""
    bos, eos = hf.get("bos_token_id"), hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if bos is None or eos is None:
        raise unsupported(hf["model_type"], "bos_token_id/eos_token_id", (bos, eos),
                           "the decoder needs a start and an end token")
    return dict(bos_id=int(bos), eos_id=int(eos), pad_id=0 if hf.get("pad_token_id") == 0
                else None)


def token_ids_config(cfg: TransformerConfig) -> dict:
    """config.json's special token ids of our model `cfg` (`token_ids` read back)."""
    return dict(bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id)


# Model options a family computes only where it says so (`_mismatches`' `wanted`): their
# values in the paper's model.
FEATURE_DEFAULTS = dict(qkv_bias=False, rope_scaling="none")


def mismatches(cfg: TransformerConfig, windows: bool = False, **wanted) -> list[str]:
    """`model.<field>=<ours> (wants <theirs>)` for each field that differs (those of
    `FEATURE_DEFAULTS` the family does not name included); also every self-attention option
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
