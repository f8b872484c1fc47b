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
computed beside it, so the pure functions of `transformer.ops` are unchanged; the price is
that the backward pass forms the kernel's gradient (as full fine-tuning does) before projecting
it onto A and B. That is also why `lora_dropout` must be 0 here: dropout(x) A B has no
kernel form. `merge` folds trained adapters into the kernels (a plain model).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

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
    if cfg.lora_dropout != 0.0:
        raise ValueError(f"finetune.lora_dropout={cfg.lora_dropout} is not supported: the "
                         f"adapters are added to the kernel (W + alpha/r A B), which leaves "
                         f"no place for dropout(x); set it to 0")
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


def adapt(module: nn.Module, kernel: jax.Array, num_in_axes: int,
          axes: tuple[str, ...]) -> jax.Array:
    """`kernel` + (alpha / r) A B where the parent layer's config targets this `Weights`
    module (by its name), else `kernel` unchanged. Creates `lora_a` and `lora_b` in `module`."""
    cfg = getattr(module.parent, "config", None)
    if cfg is None or not cfg.lora_rank or module.name not in targets(cfg):
        return kernel
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
    return kernel + scale(cfg) * delta(a, b, num_in_axes).astype(kernel.dtype)


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
