"""The routed feed-forward sublayer (`MixtureOfExperts`, a layer's `moe` subtree) and the
statistics its layers record, over the pure functions of `transformer.ops.moe`.

Parameters (docs/architecture.md): `moe/router` [D, E] (float32 arithmetic), `moe/ff_in`,
`moe/ff_gate` (gated activations) [E, D, F], `moe/ff_out` [E, F, D], and with `use_bias`
`moe/bias_in` [E, F], `moe/bias_out` [E, D]. Logical axes `expert`, `embed`, `mlp`. Applied
with `mutable=["moe"]`, each routed layer records its router's statistics (`statistics` reads
them). Otherwise nothing is recorded. Under pipeline stages (mesh.stage > 1) it also records
the counts and sums behind them (`SUMS`): the load-balancing loss is a product of two means
over the batch, so the microbatches' records cannot be averaged; `combine` derives the whole
batch's from their summed sums (`model/pipelined.py`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.model.config import TransformerConfig
from transformer.ops import expert_parallel, layers, moe
from transformer.parallel import pipeline

COLLECTION = "moe"
SUMS = "sums"  # the record of `moe.route`'s token count and sums, sown under stages
# The buffers of capacity dispatch [B, E, C, D] where mesh.expert is 1: rows over the batch's
# mesh axes. Over several experts' chips, `ops/expert_parallel.py` runs either dispatch.
BUFFER_AXES = ("expert_batch", "expert", None, None)


class MixtureOfExperts(nn.Module):
    """`__call__(x [B, T, D], segments [B, T] or None, deterministic) -> y [B, T, D]`: each
    token through its `experts_per_token` experts, their outputs summed with the router's
    weights (`ops/moe.py`)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, *, segments=None, deterministic=True):
        cfg = self.config
        dtype = cfg.compute_dtype
        e = cfg.num_experts
        d = cfg.d_model
        f = cfg.d_ff
        b, t, _ = x.shape

        def weight(name, shape, axes, init):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape)

        expert_init = nn.initializers.xavier_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
        router = weight("router", (d, e), ("embed", None), nn.initializers.xavier_uniform())
        experts = moe.Experts(
            ff_in=weight("ff_in", (e, d, f), ("expert", "embed", "mlp"), expert_init),
            ff_out=weight("ff_out", (e, f, d), ("expert", "mlp", "embed"), expert_init),
            ff_gate=weight("ff_gate", (e, d, f), ("expert", "embed", "mlp"), expert_init)
            if cfg.activation in layers.GATED else None,
            bias_in=weight("bias_in", (e, f), ("expert", "mlp"), nn.initializers.zeros)
            if cfg.use_bias else None,
            bias_out=weight("bias_out", (e, d), ("expert", "embed"), nn.initializers.zeros)
            if cfg.use_bias else None)
        experts = jax.tree.map(lambda a: a.astype(dtype), experts)
        logits = jnp.einsum("BTD,DE->BTE", x.astype(jnp.float32), router)
        valid = None if segments is None else segments != 0
        route = dict(scores=cfg.moe_router_scores, renormalize=cfg.moe_renormalize)
        rate = 0.0 if deterministic else cfg.relu_dropout_rate
        kwargs = dict(activation=cfg.activation, gelu_approximate=cfg.gelu_approximate,
                      dropout_rate=rate, dropout_rng=self.make_rng("dropout") if rate else None)
        staged = pipeline.stages() > 1
        kept = []  # `moe.route`'s (count, chosen [E], probs [E], z) sums, for `SUMS`

        def keep(sums):
            kept.append(sums)
            return sums

        flat = dict(valid=None if valid is None else valid.reshape(-1), **route)
        if expert_parallel.expert_shards() > 1:
            routing, y, dropped = expert_parallel.route_and_dispatch(
                x.astype(dtype), logits, experts, k=cfg.experts_per_token,
                capacity_factor=cfg.moe_capacity_factor, valid=valid, **route, **kwargs)
            if staged:  # its sums stay inside the shard_map: routed again for them
                moe.route(logits.reshape(b * t, e), cfg.experts_per_token, reduce=keep, **flat)
        else:
            routing = moe.route(logits.reshape(b * t, e), cfg.experts_per_token, reduce=keep,
                                **flat)
            if cfg.moe_capacity_factor:
                y, dropped = moe.with_capacity(
                    x.astype(dtype), routing, experts, capacity_factor=cfg.moe_capacity_factor,
                    constrain=lambda a: nn.with_logical_constraint(a, BUFFER_AXES), **kwargs)
            else:
                y = moe.dropless(x.reshape(b * t, d).astype(dtype), routing, experts,
                                 **kwargs).reshape(b, t, d)
                dropped = jnp.zeros((), jnp.int32)
        self.sow(COLLECTION, "routing", {
            "aux_loss": routing.aux_loss, "z_loss": routing.z_loss, "load": routing.load,
            "dropped": dropped.astype(jnp.float32) / routing.experts.size})
        if staged:
            count, chosen, probs, z = kept[0]
            self.sow(COLLECTION, SUMS, {
                "count": count, "chosen": chosen, "probs": probs, "z": z,
                "dropped": dropped.astype(jnp.float32),
                "assignments": jnp.float32(routing.experts.size)})
        return y


def combine(sums: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """A `routing` record from `SUMS` records already summed over the microbatches that
    share a layer (leading axes kept): the statistics `moe.route` derives from the whole
    batch's sums (`moe.route_statistics`), and the dropped share of all the assignments."""
    aux_loss, z_loss, load = moe.route_statistics(sums["count"], sums["chosen"], sums["probs"],
                                                  sums["z"], k)
    return {"aux_loss": aux_loss, "z_loss": z_loss, "load": load,
            "dropped": sums["dropped"] / sums["assignments"]}


def statistics(collection) -> dict[str, jax.Array]:
    """The routed layers' records (the `moe` collection of an apply) as the mean over layers
    of `moe_aux_loss`, `router_z_loss`, `expert_load_max` / `expert_load_min` (fraction of the
    routed assignments that the most and the least loaded expert of a layer receives) and
    `moe_dropped` (fraction of assignments over capacity)."""
    records = [r for r in jax.tree.leaves(collection, is_leaf=lambda r: isinstance(r, dict)
                                          and "load" in r) if isinstance(r, dict)]
    load = jnp.concatenate([r["load"].reshape(-1, r["load"].shape[-1]) for r in records])
    mean = {name: jnp.mean(jnp.concatenate([r[name].reshape(-1) for r in records]))
            for name in ("aux_loss", "z_loss", "dropped")}
    return {"moe_aux_loss": mean["aux_loss"], "router_z_loss": mean["z_loss"],
            "expert_load_max": load.max(-1).mean(), "expert_load_min": load.min(-1).mean(),
            "moe_dropped": mean["dropped"]}
