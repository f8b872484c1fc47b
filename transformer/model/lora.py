"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen model's projection kernels.

With `finetune.lora_rank` r > 0 (copied into `model.lora_*` by `transformer.config.resolve`),
each kernel W [in..., out...] named in `lora_targets` (`TARGETS`: the attention projections
query, key, value, out and the feed-forward ff_in, ff_gate, ff_out) gets two parameters beside
it, `lora_a` [in..., r] and `lora_b` [r, out...], and the layer computes with

    W + (lora_alpha / r) A B,    so that  y = x W + (alpha / r) x A B.

A starts as PEFT's (kaiming-uniform, a = sqrt(5): uniform within 1/sqrt(fan_in)) and B at zero,
so a fresh adapter leaves the model's outputs exactly the base's. A carries W's input axes and
B its output axes (logical names), the rank axis is replicated: the adapters shard on the mesh
as their kernel does. The update is added to the kernel (`Weights` calls `adapt`) rather than
computed beside it, so the pure functions of `transformer.ops` take one kernel; the price is
that the backward pass forms the kernel's gradient (as full fine-tuning does) before projecting
it onto A and B.

`lora_dropout` p > 0 (PEFT's `lora_B(lora_A(dropout(x))) * scaling`) has no kernel form, so in
training (not `deterministic`) the adapter runs beside the kernel instead: `adapt` returns W
and a `Branch`, and the layer adds

    (alpha / r) dropout_p(x) A B    to    x W (+ bias),

the mask drawn from the model's `dropout` rng stream (each module its own). In evaluation and
decoding dropout is the identity and the merged kernel gives the same outputs (within float32
rounding). Under Qwix (`model.quantization`) the branch's two einsums multiply the module's
weights, so they are quantized as the kernel's matmul is. `merge` folds trained adapters into
the kernels (a plain model).
"""

from __future__ import annotations

import math
import string
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.ops import layers

# `cfg` below is a `TransformerConfig` (model/config.py imports this module for `check`).
TARGETS = ("query", "key", "value", "out", "ff_in", "ff_gate", "ff_out")
A, B = "lora_a", "lora_b"  # the parameter names beside a target's `kernel`
FEED_FORWARD = ("ff_in", "ff_gate", "ff_out")


def targets(cfg) -> tuple[str, ...]:
    """The targeted kernels' names (`model.lora_targets`, comma-separated)."""
    return tuple(name.strip() for name in cfg.lora_targets.split(",") if name.strip())


def scale(cfg) -> float:
    """alpha / r, the factor of A B (PEFT's without rsLoRA)."""
    return cfg.lora_alpha / cfg.lora_rank


def check(cfg) -> None:
    """One line per bad setting, naming the `finetune` key and the fix."""
    if isinstance(cfg.lora_rank, bool) or not isinstance(cfg.lora_rank, int):
        raise ValueError(f"finetune.lora_rank={cfg.lora_rank!r} must be an int (0: no adapters)")
    if cfg.lora_rank < 0:
        raise ValueError(f"finetune.lora_rank={cfg.lora_rank} must be >= 0 (0: no adapters)")
    if not cfg.lora_rank:
        return
    if cfg.lora_alpha <= 0:
        raise ValueError(f"finetune.lora_alpha={cfg.lora_alpha} must be positive (the "
                         f"adapters' scale is lora_alpha / lora_rank; e.g. 2 * lora_rank)")
    rate = cfg.lora_dropout
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
        raise ValueError(f"finetune.lora_dropout={cfg.lora_dropout} must be in [0, 1) (the "
                         f"probability of dropping an adapter's input; 0: none)")
    names = targets(cfg)
    if not names:
        raise ValueError(f"finetune.lora_targets={cfg.lora_targets!r} names no module; give "
                         f"some of {', '.join(TARGETS)}")
    for name in names:
        if name not in TARGETS:
            raise ValueError(f"finetune.lora_targets: {name!r} names no module; the "
                             f"targets are {', '.join(TARGETS)}")
        if name == "ff_gate" and cfg.activation not in ("swiglu", "geglu"):
            raise ValueError(f"finetune.lora_targets: 'ff_gate' names no module with "
                             f"model.activation={cfg.activation!r} (gated ones only)")
        if name in FEED_FORWARD and cfg.num_experts:
            raise ValueError(f"finetune.lora_targets: {name!r} with model.num_experts="
                             f"{cfg.num_experts}: the routed experts take no adapters; "
                             f"target the attention projections only")


class Branch(NamedTuple):
    """An adapter beside its kernel: `branch(x)` is (alpha / r) dropout(x) A B for x
    [..., in...] (W's input axes last) -> [..., out...], in x's dtype."""
    a: jax.Array
    b: jax.Array
    factor: float
    rate: float
    rng: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        num_in, num_out = self.a.ndim - 1, self.b.ndim - 1
        ins, outs = string.ascii_lowercase[:num_in], string.ascii_lowercase[num_in:][:num_out]
        dropped = layers.dropout(x, self.rate, self.rng)
        low = jnp.einsum(f"...{ins},{ins}z->...z", dropped, self.a.astype(x.dtype))
        out = jnp.einsum(f"...z,z{outs}->...{outs}", low, self.b.astype(x.dtype))
        return (self.factor * out).astype(x.dtype)


def adapt(module: nn.Module, kernel: jax.Array, num_in_axes: int, axes: tuple[str, ...],
          deterministic: bool = True) -> tuple[jax.Array, Branch | None]:
    """(kernel, branch) for a `Weights` module: where the parent layer's config targets it (by
    its name), creates `lora_a` and `lora_b` in `module` and returns (`kernel` + (alpha / r)
    A B, None), or in training with `lora_dropout` > 0 (`kernel`, its `Branch`); elsewhere
    (`kernel`, None)."""
    cfg = getattr(module.parent, "config", None)
    if cfg is None or not cfg.lora_rank or module.name not in targets(cfg):
        return kernel, None
    rank = cfg.lora_rank
    in_shape, out_shape = kernel.shape[:num_in_axes], kernel.shape[num_in_axes:]
    bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform(a=sqrt(5)) over fan_in

    def init_a(rng, shape, dtype=jnp.float32):
        return jax.random.uniform(rng, shape, dtype, -bound, bound)

    a = module.param(A, nn.with_logical_partitioning(init_a, (*axes[:num_in_axes], None)),
                     (*in_shape, rank))
    b = module.param(B, nn.with_logical_partitioning(nn.initializers.zeros,
                                                     (None, *axes[num_in_axes:])),
                     (rank, *out_shape))
    if not deterministic and cfg.lora_dropout > 0.0:
        return kernel, Branch(a, b, scale(cfg), cfg.lora_dropout, module.make_rng("dropout"))
    return kernel + scale(cfg) * delta(a, b, num_in_axes).astype(kernel.dtype), None


def delta(a: jax.Array, b: jax.Array, num_in_axes: int) -> jax.Array:
    """A [in..., r] B [r, out...] -> [in..., out...] (float32 accumulation)."""
    flat = jnp.matmul(a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1),
                      preferred_element_type=jnp.float32)
    return flat.reshape(*a.shape[:num_in_axes], *b.shape[1:])


def is_adapter(path: str) -> bool:
    """Whether a parameter path (`a/b/c`) is an adapter's."""
    return path.rsplit("/", 1)[-1] in (A, B)


def merge(params: dict, cfg) -> dict:
    """The params with each target's W + (alpha / r) A B as its kernel and no adapters: a plain
    model's (the same layout, per-layer or scanned: a scanned layer axis leads all three)."""
    factor = scale(cfg)

    def walk(tree):
        if not isinstance(tree, dict):
            return tree
        if A in tree:
            a, b, kernel = tree[A], tree[B], tree["kernel"]
            merged = jnp.asarray(kernel) + factor * _batched_delta(a, b, kernel.ndim)
            rest = {k: walk(v) for k, v in tree.items() if k not in (A, B, "kernel")}
            return {"kernel": merged.astype(kernel.dtype), **rest}
        return {k: walk(v) for k, v in tree.items()}

    return walk(params)


def _batched_delta(a, b, kernel_ndim: int) -> jax.Array:
    """A B for a kernel of `kernel_ndim` dims, a leading (scanned) layer axis included."""
    lead = a.ndim + b.ndim - 2 - kernel_ndim  # 1 with a scanned layer axis, else 0
    if lead:
        return jax.vmap(lambda x, y: _batched_delta(x, y, kernel_ndim - 1))(a, b)
    return delta(jnp.asarray(a), jnp.asarray(b), a.ndim - 1)
