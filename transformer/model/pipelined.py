"""A scanned stack of blocks runs through the pipeline stages (`parallel/pipeline.py`): the
decoder's layers (`decoder/layers`) and the ViT's encoder layers (`encoder/layers`).

The stack's parameters stay as `model.scan_layers` makes them ([L, ...], the same paths with
or without stages); here they are read, viewed as [S, R, L / (S R), ...] chunks, and each
chunk is applied as a scanned block of L / (S R) layers (the class `layer_stack` builds, so remat
and scan are those of the unpipelined stack). With mesh.context > 1 the chunks' self-attention
is `ops/ring.py`'s shard_map, run inside the stages' vmap as in the unpipelined stack. Routed
layers return their router sums (`experts.SUMS`) per microbatch and chunk; summed over the
microbatches they give each layer's whole-batch record (`experts.combine`), sown as the
unpipelined stack sows it. docs/architecture.md, "Pipeline stages", is the contract.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from transformer.model import experts
from transformer.ops import ring
from transformer.parallel import pipeline, sharding


def applies(module: nn.Module, cache) -> bool:
    """Whether a stack's layers run pipelined: the mesh in context has stages, no decoding
    cache is passed, and the parameters exist (init runs the plain stack, which makes them)."""
    return cache is None and pipeline.stages() > 1 and not module.is_initializing()


def decoder_layers(module: nn.Module, stack: Callable[[int], type[nn.Module]], x, args,
                   deterministic: bool, bias) -> jax.Array:
    """x [B, T, D] through `module`'s (the Decoder's) `layers`, pipelined -> [B, T, D].

    `args` are the block's arguments that come before the cache (encoded, self_mask,
    cross_mask, positions, segments, in_prefix); no cache and no index follow them."""
    return stack_layers(module, stack, x, tuple(args) + (None, None), deterministic, bias,
                        layers=module.config.num_decoder_layers)


def stack_layers(module: nn.Module, stack: Callable[[int], type[nn.Module]], x, args,
                 deterministic: bool, bias, *, layers: int) -> jax.Array:
    """x [B, S, D] through `module`'s `layers` (a scanned stack of `layers` blocks),
    pipelined -> [B, S, D].

    `stack(n)` is the block class of n scanned layers, built as the stack's
    `(config, attention_fn, window, routed)` and called `(x, *args, deterministic, bias)`.
    Those of `args` with a leading B axis, and `bias`, are cut into microbatches with the
    rows; None passes as None."""
    cfg = module.config
    stages = pipeline.stages()
    repeats = cfg.pipeline_repeats
    microbatches = cfg.pipeline_microbatches or stages
    pipeline.check(stages_=stages, layers=layers, repeats=repeats, microbatches=microbatches,
                   architecture=cfg.architecture, scan_layers=cfg.scan_layers)
    rows = x.shape[0]
    if rows % microbatches:
        raise ValueError(f"{rows} rows a step (per accumulation microbatch) are not divisible "
                         f"by mesh.pipeline_microbatches={microbatches}")
    batch = sharding.batch_shards(jax.sharding.get_abstract_mesh().shape)
    if ring.context_shards() > 1 and (rows // microbatches) % batch:
        raise ValueError(f"mesh.pipeline_microbatches={microbatches} leaves {rows // microbatches}"
                         f" rows a microbatch, which the {batch} batch shards (data x fsdp x "
                         f"expert) do not divide, as context parallelism's attention needs: "
                         f"use fewer microbatches")
    block = stack(layers // (stages * repeats))(cfg, module.attention_fn, cfg.layer_window(0),
                                                cfg.routed(0), parent=None)
    chunks = pipeline.to_stages(nn.unbox(module.variables["params"]["layers"]), stages,
                                repeats)
    args = tuple(args) + (bias,)
    per_row = tuple(a is not None and a.shape[0] == rows for a in args)
    side = tuple(pipeline.split_rows(a, microbatches) if split else None
                 for a, split in zip(args, per_row, strict=True))
    key = None if deterministic else module.make_rng("dropout")

    def stage_fn(params, inp, side_m, microbatch, chunk):
        full = [s if split else a for a, s, split in zip(args, side_m, per_row, strict=True)]
        rngs = None
        if key is not None:  # one key per (microbatch, chunk)
            rngs = {"dropout": jax.random.fold_in(jax.random.fold_in(key, microbatch), chunk)}
        (out, _), sown = block.apply({"params": params}, inp, *full[:-1], deterministic,
                                     full[-1], rngs=rngs, mutable=[experts.COLLECTION])
        sums = [r for r in jax.tree.leaves(sown, is_leaf=lambda r: isinstance(r, dict)
                                           and "assignments" in r) if isinstance(r, dict)]
        return out, sums  # a routed chunk's one record, leaves [L / (S R), ...]; else none

    out, sums = pipeline.run(stage_fn, chunks, pipeline.split_rows(x, microbatches), side,
                             stages_=stages, repeats=repeats)
    for record in sums:  # [M, S R, L / (S R), ...]: summed over M, chunks in layer order
        record = jax.tree.map(lambda a: a.sum(0).reshape((layers,) + a.shape[3:]), record)
        module.sow(experts.COLLECTION, "routing", experts.combine(record, cfg.experts_per_token))
    return nn.with_logical_constraint(pipeline.join_rows(out), ("batch", "length", None))
