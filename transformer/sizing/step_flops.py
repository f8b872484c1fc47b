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
    `full`: the layers' forward but the last matmul of each sublayer (the output projection,
    the feed-forward's output), whose result only a residual sum takes and the backward pass
    does not need (JAX recomputes what it needs). `dots` and `dots_no_batch`: the attention's
    scores and values (Q K^T and A V have batch dimensions, and the splash kernel is a Pallas
    call: no policy saves it; `dots` would save XLA's einsums, counted all the same). `none`:
    0."""
    policy = model.remat_policy
    if policy == "none":
        return 0.0
    if policy != "full":
        return _per_device(model, memory_plan, lambda parts: parts["attention_scores_values"])
    head_dims = model.d_k + model.d_v
    projections = model.num_heads * head_dims + model.num_kv_heads * head_dims
    output = model.num_heads * model.d_v / projections  # the output projection's share
    return _per_device(model, memory_plan, lambda parts: (
        parts["attention_scores_values"] + parts["attention_projections"] * (1 - output)
        + parts["ffn"] * (1 - 1 / flops.ffn_matmuls(model))))
