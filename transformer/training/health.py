"""Per-layer health: gradient, parameter and update norms grouped by layer and module kind, and
where a non-finite step went wrong.

A parameter's group is its layer (`{stack}/layers_{i}`, a scanned stack's `layers` split by its
leading L axis; a stack's own parameters outside its layers: `{stack}`; none for the rest) and
the kind of its module (`KINDS`): `decoder/layers_3/attention`, `decoder/norms`, `embeddings`.
Train lines carry `grad_norm/<group>`, `param_norm/<group>` (the parameters the step started
from) and `update_norm/<group>` (the optimizer's update, applied or not).

Evaluation lines carry, per layer, `attention_logit_max/{stack}/layers_{i}/{self,cross}_attention`
(the largest scaled q.k logit over heads, positions and the eval batches, where the attention
materialises its scores) and `activation_rms/{stack}/layers_{i}` (the RMS of the block's output,
the residual stream): `eval_sums` reads the model's `HEALTH` collection inside the eval step,
`add_eval_sums` reduces over batches (max of maxima, sums of squares and counts) and
`eval_figures` gives the line's keys.

`group_squares` runs inside the jitted train step: one sum of squares per parameter (per layer
for a scanned one) added up by group, so only a few scalars per group leave the device.
`line_figures` turns them into the train line's keys on the host; `locate_nonfinite` names the
first group whose parameter, gradient or update is not finite.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer.model.records import HEALTH

# The module kinds, in the order a layer's groups are listed.
KINDS = ("attention", "feed_forward", "experts", "norms", "embeddings", "head")
# The quantities of a train line, each `<quantity>/<group>`.
QUANTITIES = ("param_norm", "grad_norm", "update_norm")
_LAYER = re.compile(r"layers(_\d+)?")
STACKS = ("encoder", "decoder")
SCANNED = "layers"  # a scanned stack's one subtree; its leaves have a leading L axis


def kind_of(module: str) -> str:
    """The kind of a layer's (or the model's) module, from its name (docs/architecture.md's
    parameter paths)."""
    if module.startswith(("norm", "post_norm")):  # norm_attention is a norm
        return "norms"
    if "attention" in module:
        return "attention"
    if module == "moe":
        return "experts"
    if module == "ffn":
        return "feed_forward"
    if module in ("head", "pre_logits"):
        return "head"
    return "embeddings"  # embedding, logits, logits_bias, relative_bias, patch and position


def group_of(path: tuple[str, ...]) -> str:
    """The group of the parameter at `path` (its dict keys): `{stack}/layers_{i}/{kind}`,
    `{stack}/layers/{kind}` for a scanned stack (all L layers at once), `{stack}/{kind}` for a
    stack's own modules (its final norm, output projection) or `{kind}` outside the stacks."""
    if path[0] in STACKS and len(path) > 1:
        if _LAYER.fullmatch(path[1]) and len(path) > 3:
            return f"{path[0]}/{path[1]}/{kind_of(path[2])}"
        return f"{path[0]}/{kind_of(path[1])}"
    return kind_of(path[0])


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def group_squares(tree: Any) -> dict[str, jax.Array]:
    """{group: the sum of its leaves' squares} in float32: a scalar, or [L] for a scanned
    stack's group (one per layer). Runs inside jit."""
    sums: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = _keys(path)
        group = group_of(keys)
        scanned = keys[0] in STACKS and len(keys) > 3 and keys[1] == SCANNED
        squares = jnp.square(leaf.astype(jnp.float32))
        total = (jnp.sum(squares, axis=tuple(range(1, leaf.ndim))) if scanned
                 else jnp.sum(squares))
        sums[group] = sums[group] + total if group in sums else total
    return sums


def group_norms(params: Any, grads: Any, updates: Any) -> dict[str, dict[str, jax.Array]]:
    """{quantity: {group: norm}} of the step's parameters, gradients and updates (`QUANTITIES`);
    a scanned group's norms are [L]. Runs inside jit."""
    return {name: jax.tree.map(jnp.sqrt, group_squares(tree))
            for name, tree in zip(QUANTITIES, (params, grads, updates), strict=True)}


def group_order(group: str) -> tuple:
    """Groups in model order: embeddings, then each stack's layers by index, then the rest."""
    parts = group.split("/")
    layer = next((int(p[7:]) for p in parts if p.startswith("layers_")), -1)
    stack = 0 if len(parts) == 1 else {"encoder": 1, "decoder": 2}.get(parts[0], 3)
    kind = KINDS.index(parts[-1]) if parts[-1] in KINDS else len(KINDS)
    return (stack, layer if layer >= 0 else math.inf, parts[0], kind)


def per_layer(norms: Mapping[str, Any]) -> dict[str, float]:
    """One quantity's {group: norm} fetched to the host, a scanned group's [L] norms split
    into `layers_{i}` groups, in model order."""
    flat: dict[str, float] = {}
    for group, value in norms.items():
        values = [float(v) for v in np.ravel(value)]
        parts = group.split("/")
        if SCANNED in parts:
            at = parts.index(SCANNED)
            for i, v in enumerate(values):
                flat["/".join((*parts[:at], f"layers_{i}", *parts[at + 1:]))] = v
        else:
            flat[group] = values[0]
    return dict(sorted(flat.items(), key=lambda item: group_order(item[0])))


def line_figures(health: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """A train line's keys from a step's fetched `group_norms`: `grad_norm/decoder/layers_3/
    attention` and so on."""
    return {f"{quantity}/{group}": value for quantity in QUANTITIES if quantity in health
            for group, value in per_layer(health[quantity]).items()}


def locate_nonfinite(loss: float, health: Mapping[str, Mapping[str, Any]] | None) -> str:
    """Where a non-finite step went wrong, in words: the first group (model order) whose
    parameter is not finite, else the loss, else the first group whose gradient, else whose
    update is not finite."""
    def first(quantity: str) -> str | None:
        if not health or quantity not in health:
            return None
        return next((group for group, value in per_layer(health[quantity]).items()
                     if not math.isfinite(value)), None)

    if group := first("param_norm"):
        return f"a parameter in {group} is not finite (before this step)"
    if not math.isfinite(loss):
        return "the loss is not finite (the parameters are)"
    if group := first("grad_norm"):
        return f"the gradient is first not finite in {group}"
    if group := first("update_norm"):
        return f"the update is first not finite in {group}"
    return "the loss, gradients and updates of every layer are finite: the global norm overflowed"


# --------------------------------------------------------------------------- evaluation

LOGIT_MAX = "attention_logit_max"
EVAL_QUANTITIES = (LOGIT_MAX, "activation_rms")  # an eval line's, each `<quantity>/<layer>...`
_SQUARES = "activation_squares"
_COUNT = "activation_count"
_RECORDS = {"attention_logit_max": LOGIT_MAX, "residual_squares": _SQUARES,
            "residual_count": _COUNT}


def eval_sums(variables: Mapping[str, Any]) -> dict[str, jax.Array]:
    """An eval batch's scalars from an apply's mutated `HEALTH` collection, a scanned stack's
    [L] records split by layer index: `attention_logit_max/decoder/layers_3/self_attention`,
    `activation_squares/decoder/layers_3` and `activation_count/...`. Runs inside jit."""
    sums: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables.get(HEALTH, {}))[0]:
        keys = [k for k in _keys(path) if not k.startswith("[")]  # sow's tuple index out
        record = _RECORDS[keys[-1]]
        where = keys[:-1] if record == LOGIT_MAX else keys[:2]  # the block for the RMS
        layers = ([(where, leaf)] if SCANNED not in where else
                  [([f"layers_{i}" if k == SCANNED else k for k in where], leaf[i])
                   for i in range(leaf.shape[0])])
        for names, value in layers:
            key = "/".join((record, *names))
            if key in sums:
                value = (jnp.maximum if record == LOGIT_MAX else jnp.add)(sums[key], value)
            sums[key] = value
    return sums


def add_eval_sums(totals: Mapping[str, float], sums: Mapping[str, Any]) -> dict[str, float]:
    """`totals` with one more eval batch's figures: the largest of the logit maxima, sums of
    everything else (NLL, tokens, squares and counts)."""
    added = dict(totals)
    for key, value in sums.items():
        value = float(value)
        if key not in added:
            added[key] = value
        elif key.startswith(LOGIT_MAX + "/"):
            added[key] = max(added[key], value)
        else:
            added[key] = added[key] + value
    return added


def eval_figures(totals: Mapping[str, float]) -> dict[str, float]:
    """The eval line's health keys from summed totals: `attention_logit_max/...` as is and
    `activation_rms/{stack}/layers_{i}` = sqrt(summed squares / summed count), in model order."""
    figures = {key: value for key, value in totals.items() if key.startswith(LOGIT_MAX + "/")}
    for key, squares in totals.items():
        if key.startswith(_SQUARES + "/"):
            layer = key[len(_SQUARES) + 1:]
            count = totals.get(f"{_COUNT}/{layer}", 0.0)
            figures[f"activation_rms/{layer}"] = math.sqrt(squares / count) if count else 0.0
    return dict(sorted(figures.items(),
                       key=lambda item: group_order(item[0].split("/", 1)[1])))
