"""The global train batch a config implies, from the config alone: its keys and shapes
[A, rows per microbatch, length], and those as sharded `jax.ShapeDtypeStruct`s for a compile
that allocates nothing. No dataset is read.

Shape legend: A accumulation microbatches, S source length, T target length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.data import span_corruption
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding

TRANSLATION_KEYS = ("inputs", "targets", "inputs_positions", "targets_positions",
                    "inputs_segmentation", "targets_segmentation")


def batch_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The global train batch's keys and shapes [A, rows per microbatch, length], from the
    config alone (no dataset is read). `grad_accum_steps` must be resolved (>= 1).

    Language-model configs (`data.objective` causal | prefix | sft | dpo | masked) and
    translation configs use rows of `data.max_length`. The synthetic task's targets carry one
    more token (EOS). Span corruption's targets are as long as one piece's noise and
    sentinels. Classifiers have "label" [A, rows] beside "inputs" (text) or "image" [A, rows,
    image_size, image_size, num_channels]."""
    accum = int(cfg.grad_accum_steps)
    rows = int(cfg.data.batch_size) // accum
    if cfg.model.architecture == "vision":
        side = int(cfg.model.image_size)
        channels = int(cfg.model.num_channels)
        return {"image": (accum, rows, side, side, channels), "label": (accum, rows)}
    length = int(cfg.data.max_length)
    objective = cfg.data.get("objective")
    if objective in ("causal", "prefix", "sft", "dpo"):
        keys = ["targets", "targets_positions", "targets_segmentation"]
        keys += ["targets_prefix"] if objective == "prefix" else []
        # sft: the assistant's tokens; dpo: the responses' (data/preference.py)
        keys += ["targets_loss_mask"] if objective in ("sft", "dpo") else []
        return {k: (accum, rows, length) for k in keys}
    if objective == "masked":
        return {k: (accum, rows, length) for k in ("inputs", "inputs_positions",
                                                   "inputs_segmentation", "targets")}
    if objective == "span_corruption":  # targets: the noise and sentinels of a whole piece
        targets = span_corruption.corrupted_lengths(span_corruption.raw_length(length))[1]
        return {k: (accum, rows, length if k.startswith("inputs") else targets)
                for k in TRANSLATION_KEYS}
    if objective == "classification":
        return {"inputs": (accum, rows, length), "label": (accum, rows)}
    if objective is not None:
        raise ValueError(f"data.objective={objective!r} is not one of causal, prefix, sft, "
                         f"dpo, masked, span_corruption, classification")
    if cfg.data.dataset == "synthetic":
        from transformer.data.synthetic import SyntheticTask

        task = SyntheticTask(cfg.data.task, int(cfg.data.vocab_size), int(cfg.data.min_length),
                             length, int(cfg.seed))
        return {"inputs": (accum, rows, task.source_length),
                "targets": (accum, rows, task.target_length)}
    return {k: (accum, rows, length) for k in TRANSLATION_KEYS}


def abstract_batch(cfg, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as `ShapeDtypeStruct`s sharded P(None, ("data", "fsdp")): int32, the
    images float32."""
    batch_sharding = NamedSharding(mesh, P(None, sharding.BATCH_AXES))
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "image" else jnp.int32,
                                    sharding=batch_sharding)
            for k, shape in batch_shapes(cfg).items()}


def batch_lengths(model: TransformerConfig,
                  shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int]:
    """(A, global rows per microbatch, source length S, target length T) of `batch_shapes`.
    The vision model's S = T = its tokens (`vit.num_tokens`). The text classifier's T = 1."""
    accum, rows = next(iter(shapes.values()))[:2]
    if model.architecture == "vision":
        from transformer.model import vit

        return accum, rows, vit.num_tokens(model), vit.num_tokens(model)
    if model.architecture == "classifier":
        return accum, rows, shapes["inputs"][2], 1
    target = shapes["targets"][2]
    return accum, rows, shapes.get("inputs", shapes["targets"])[2], target
