"""FLOPs of one update per device: the model's training matmuls (`flops.py`) and what remat
recomputes of them, over the batch and mesh of a `memory.MemoryPlan`."""

from __future__ import annotations

import math

from transformer.model.config import TransformerConfig
from transformer.sizing import flops
from transformer.sizing.batches import batch_lengths
from transformer.sizing.memory import MemoryPlan


def _per_device(model: TransformerConfig, memory_plan: MemoryPlan, forward) -> float:
    """`forward(flops.forward_flops parts of one row)` over one update's rows, per device."""
    accum, rows, source, target = batch_lengths(model, memory_plan.batch)
    parts = flops.forward_flops(model, source_length=source, target_length=target)
    return forward(parts) * accum * rows / math.prod(memory_plan.mesh_shape.values())


def step_flops_per_device(model: TransformerConfig, memory_plan: MemoryPlan) -> float:
    """Training matmul FLOPs of one update per device (`flops.py`: 3 x forward, over all the
    batch's rows at their full lengths)."""
    return _per_device(model, memory_plan, lambda parts: 3.0 * parts["total"])


def remat_flops(model: TransformerConfig, memory_plan: MemoryPlan) -> float:
    """The forward matmul FLOPs remat recomputes in one update per device (`flops.py`'s).

    `full` recomputes each layer's forward pass, less what the backward pass never reads. In a
    pre-LN layer that is the feed-forward's last matmul: only the residual sum that ends the
    layer takes its result. The attention's output projection is recomputed, since the next
    sublayer's norm reads its sum with the residual. In a post-LN layer every matmul is
    recomputed, since each sublayer's norm reads the sum before it. `dots` and `dots_no_batch`
    recompute the attention's scores and values: Q K^T and A V have batch dimensions, and the
    splash kernel is a Pallas call that no policy saves. `dots` would save XLA's einsums but
    they are counted all the same. `none` recomputes nothing.
    """
    policy = model.remat_policy
    if policy == "none":
        return 0.0
    if policy != "full":
        return _per_device(model, memory_plan, lambda parts: parts["attention_scores_values"])
    unread = 1 / flops.ffn_matmuls(model) if model.norm_position == "pre" else 0.0
    return _per_device(model, memory_plan, lambda parts: (
        parts["attention_scores_values"] + parts["attention_projections"]
        + parts["ffn"] * (1 - unread)))
