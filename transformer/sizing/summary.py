"""A readable account of a config's model: parameters per module and training FLOPs per token.

`summarize(run)` is what `train.py --summary` prints. Shapes come from `jax.eval_shape`, so
nothing is allocated and any size (big, or bigger) summarises in about a second on a CPU. The
last line is always `total_params: <int>` for tools to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from transformer.config import Resolved
from transformer.model import vit
from transformer.model.config import TransformerConfig
from transformer.sizing import flops
from transformer.training import train_state

_COMPONENT_ORDER = ("self_attention", "cross_attention", "ffn", "norm_attention", "norm_cross",
                    "norm_ffn")
_LEAF_ORDER = ("query", "key", "value", "out", "ff_in", "ff_gate", "ff_out", "scale", "bias")
_NAME_WIDTH = 26
_SHAPE_WIDTH = 66
_COUNT_WIDTH = 12


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def _leaves(tree) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [("/".join(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf in flat]

    def rank(item):
        first = item[0].split("/")[0]
        return _LEAF_ORDER.index(first) if first in _LEAF_ORDER else len(_LEAF_ORDER)

    return sorted(leaves, key=rank)


def _describe(tree, *, drop_leading: bool = False) -> str:
    """`query, key, value 512x8x64, out 8x64x512 (+bias)`: kernels and other leaves by shape
    (neighbours of equal shape share it). Biases beside a kernel are summarised as `(+bias)`.
    `drop_leading` strips a scan axis."""
    leaves = _leaves(tree) if isinstance(tree, Mapping) else [("", tree)]
    names = {name for name, _ in leaves}
    items: list[tuple[list[str], str]] = []  # ([labels], shape)
    has_bias = False
    for name, leaf in leaves:
        shape = _shape(leaf.shape[1:] if drop_leading else leaf.shape)
        if name.endswith("bias") and name[:-4] + "kernel" in names:
            has_bias = True
            continue
        label = name.removesuffix("kernel").removesuffix("/")
        if items and items[-1][1] == shape and label:
            items[-1][0].append(label)
        else:
            items.append(([label], shape))
    text = "; ".join(f"{', '.join(labels)} {shape}".strip() for labels, shape in items)
    return text + (" (+bias)" if has_bias else "")


def _size(tree) -> int:
    return sum(int(leaf.size) for leaf in jax.tree.leaves(tree))


def _row(name: str, shapes: str, count: int | str) -> str:
    count = f"{count:,}" if isinstance(count, int) else count
    return f"{name:<{_NAME_WIDTH}} {shapes:<{_SHAPE_WIDTH}} {count:>{_COUNT_WIDTH}}"


def _stack_rows(name: str, stack: Mapping, total: int, num_layers: int) -> list[str]:
    """A header for encoder/decoder, one row per component of one layer, then the rest."""
    scanned = "layers" in stack
    layer = stack["layers"] if scanned else stack.get("layers_0", {})
    per_layer = _size(layer) // (num_layers if scanned else 1)
    rows = [_row(name, f"{num_layers} layers x {per_layer:,}", total)]
    order = [c for c in _COMPONENT_ORDER if c in layer] + sorted(
        c for c in layer if c not in _COMPONENT_ORDER)
    for component in order:
        rows.append(_row(f"  layer.{component}", _describe(layer[component], drop_leading=scanned),
                         _size(layer[component]) // (num_layers if scanned else 1)))
    for key in sorted(stack):
        if key == "layers" or key.startswith("layers_") or key in ("embedder", "logits"):
            continue
        rows.append(_row(f"  {key}", _describe(stack[key]), _size(stack[key])))
    return rows


def _flops_lines(config: TransformerConfig, source_length: int, target_length: int) -> list[str]:
    per_token = flops.train_flops_per_token(config, source_length=source_length,
                                            target_length=target_length)
    forward = flops.forward_flops(config, source_length=source_length,
                                  target_length=target_length)
    causal = "; causal self-attention counts half its T x T scores"
    if config.architecture == "vision":
        where = f"S = {vit.num_tokens(config)} tokens"
        unit = "image"
        causal = ""
    elif config.architecture == "encoder":
        where = f"S = {source_length}"
        unit = "input token"
        causal = ""
    elif config.architecture == "decoder":
        where = f"T = {target_length}"
        unit = "target token"
    else:
        where = f"S = {source_length}, T = {target_length}"
        unit = "target token"
    labels = {"attention_projections": "q/k/v/out projections", "attention_scores_values":
              "QK^T and AV", "ffn": "feed-forward", "logits": "logits"}
    if "patch_embedding" in forward:
        labels["patch_embedding"] = "patch embedding"
    parts = ", ".join(f"{label} {forward[name] / forward['total']:.0%}"
                      for name, label in labels.items())
    return [
        f"training FLOPs per {unit}: {per_token:.4g}  ({where}; 3 x forward matmul "
        f"FLOPs{causal})",
        f"forward FLOPs per sequence: {forward['total']:.4g} = {parts}",
    ]


def optimizer_state_bytes(run: Resolved, params) -> int:
    """Bytes of the optimizer's state for `params` (abstract), all of it on one device: with
    LoRA the adapters' moments alone, with DPO the frozen reference too (as train_state)."""
    tx, _ = train_state.make_optimizer(run)
    return sum(leaf.size * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(jax.eval_shape(tx.init, params)))


def optimizer_line(run: Resolved, params, total: int) -> str:
    """`optimizer state: adamw, float32 moments: 8.00 bytes per parameter (...)`."""
    opt = run.config.optimizer
    name = opt.get("name", "adam")
    kind = (f"{name}, factored second moments" if name == "adafactor"
            else f"{name}, {opt.get('moments_dtype', 'float32')} moments")
    state = optimizer_state_bytes(run, params)
    return f"optimizer state: {kind}: {state / total:.2f} bytes per parameter ({state:,} bytes)"


def summarize(run: Resolved) -> str:
    """The summary table of a resolved config; FLOPs are counted at `data.max_length` (the
    source and target length; else model.max_len)."""
    config = run.model
    length = int(run.config.data.get("max_length") or config.max_len)
    params = flops.abstract_params(config)
    counts = flops.param_counts(config)

    encoder_layers = 0 if config.architecture == "decoder" else config.num_encoder_layers
    decoder_layers = (0 if config.architecture in ("encoder", "vision")
                      else config.num_decoder_layers)
    inputs = f"vocab {config.vocab_size}"
    if config.architecture == "vision":
        inputs = (f"{config.image_size}px x {config.num_channels} images in {config.patch_size}px "
                  f"patches ({config.num_patches}), {config.pooling} pooling, "
                  f"{config.num_classes} classes")
    lines = [
        f"Transformer {config.architecture}: {encoder_layers} encoder + {decoder_layers} "
        f"decoder layers, d_model {config.d_model}, d_ff {config.d_ff}, heads {config.num_heads} "
        f"(kv {config.num_kv_heads}) x d_k {config.d_k}/d_v {config.d_v}, "
        f"{config.norm_position}-{config.norm}, {config.activation}, {config.positional} "
        f"positions, {inputs}, compute {config.dtype}",
        _row("module", "shapes (one layer for layer.*)", "params"),
        "-" * (_NAME_WIDTH + _SHAPE_WIDTH + _COUNT_WIDTH + 2),
    ]
    for name in ("embedding", "source_embedding", "patch_embedding", "class_token"):
        if name in params:
            lines.append(_row(name, _describe(params[name]), counts[name]))
    positions = {stack: params[stack]["embedder"] for stack in ("encoder", "decoder")
                 if stack in params and "embedder" in params[stack]}
    if "position_embedding" in params:  # the vision model's, beside its patch embedding
        lines.append(_row("position_embedding", _describe(params["position_embedding"]),
                          counts["position_embedding"]))
    if positions:
        lines.append(_row("position_embedding", ", ".join(
            f"{stack} {_shape(leaf.shape)}" for stack, tree in positions.items()
            for leaf in jax.tree.leaves(tree)),
            counts["position_embedding"]))
    for name, num_layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        if name in params:
            lines += _stack_rows(name, params[name], counts[name], num_layers)
    if "head" in params:
        lines.append(_row("head", _describe(params["head"]), counts["head"]))
    elif "decoder" in params and "logits" in params["decoder"]:
        lines.append(_row("logits", _describe(params["decoder"]["logits"]), counts["logits"]))
    else:
        lines.append(_row("logits", "tied to embedding (x @ embedding^T)", 0))
    lines.append("-" * (_NAME_WIDTH + _SHAPE_WIDTH + _COUNT_WIDTH + 2))
    lines.append(_row("total", f"{counts['total'] / 1e6:.1f}M", counts["total"]))
    if config.num_experts:  # what one token goes through: k of the E experts
        active = flops.active_params(config)
        lines.append(_row(f"active ({config.experts_per_token} of {config.num_experts} experts)",
                          f"{active / 1e6:.1f}M", active))
    lines.append(optimizer_line(run, params, counts["total"]))
    lines.append("")
    lines += _flops_lines(config, length, length)
    lines.append(f"total_params: {counts['total']}")
    return "\n".join(lines)
