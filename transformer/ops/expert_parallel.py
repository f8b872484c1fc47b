"""Expert parallelism: a routed layer over the mesh's "expert" axis, inside a
`jax.shard_map` (as MaxText's `layers/moe.py` runs its routed layer in one), in either dispatch.

The mesh is the one in context (`jax.sharding.use_abstract_mesh`, as the train step sets it).
Every device holds whole rows of the batch (split over data x fsdp x expert) and
E / mesh.expert experts (the `expert` axis of their weights, F split over "tensor"). Each
device routes its own tokens (`moe.route`; the counts and sums behind the load-balancing loss,
the z-loss and the loads are summed over the devices, so they are the whole batch's).

Capacity (`_all_to_all`): each device fills its rows' [B/n, E, C, D] buffer (`moe.dispatch`:
C slots per expert for each row, the row being the group, as for one device);
`jax.lax.all_to_all` over "expert" sends each expert's slots to the device that holds it, which
receives [mesh.expert * B/n, E/mesh.expert, C, D]: the rows of its expert group for its own
experts. Its experts run their matrix products (partial over "tensor", summed by `psum`), a
second all-to-all brings the outputs back, and each device combines its tokens' outputs with
their router weights. Drops are per row, so they are the single device's.

Dropless (`_all_gather`, Megatron's "allgather" token dispatcher): each device all-gathers its
expert group's tokens, chosen experts and router weights over "expert" (mesh.expert times its
own N tokens), runs its own experts on the assignments routed to them (`moe.grouped`: sorted,
`ragged_dot`, the others' assignments sorted last and left out), sums each token's outputs
with its weights, and a reduce-scatter (`psum_scatter`) over "expert" returns every device its
own tokens' sums (then `psum` over "tensor"). Nothing is dropped. Every collective runs on
XLA:CPU, which `jax.lax.ragged_all_to_all` does not (docs/moe.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer.ops import moe
from transformer.parallel import pipeline, sharding

EXPERT = sharding.EXPERT_AXIS
TENSOR = "tensor"
# The experts' weights inside the shard_map: their experts over "expert", F over "tensor",
# D whole (gathered from fsdp as a dense layer's weights are).
WEIGHT_SPECS = {"ff_in": P(EXPERT, None, TENSOR), "ff_gate": P(EXPERT, None, TENSOR),
                "ff_out": P(EXPERT, TENSOR, None), "bias_in": P(EXPERT, TENSOR),
                "bias_out": P(EXPERT, None)}


def expert_shards() -> int:
    """The "expert" size of the mesh in context; 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(EXPERT, 1)


def route_and_dispatch(x: jax.Array, logits: jax.Array, experts: moe.Experts, *, k: int,
                       capacity_factor: float, scores: str = "softmax",
                       renormalize: bool = True, valid: jax.Array | None = None,
                       activation: str, gelu_approximate: bool = True,
                       dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
                       ) -> tuple[moe.Routing, jax.Array, jax.Array]:
    """`moe.route` and, over the mesh in context (module docstring), `moe.with_capacity`
    (`capacity_factor` >= 1) or `moe.dropless` (0) for x [B, T, D], router logits [B, T, E]
    and `valid` [B, T]: (routing, its weights and experts [B*T, K] and its statistics those of
    the whole batch; y [B, T, D]; dropped assignments of the whole batch, 0 when dropless)."""
    mesh = jax.sharding.get_abstract_mesh()
    b, t, _ = x.shape
    num_experts = experts.ff_in.shape[0]
    rows_split = sharding.batch_shards(mesh.shape)
    if b % rows_split:
        raise ValueError(f"expert parallelism splits the batch's {b} rows over mesh data x fsdp "
                         f"x expert = {rows_split}: make the batch a multiple of it")
    weights = {name: w for name, w in experts._asdict().items() if w is not None}
    rows = P(sharding.BATCH_AXES)
    inputs = {"x": x, "logits": logits, "weights": weights, "valid": valid, "rng": dropout_rng}
    inputs = {name: value for name, value in inputs.items() if value is not None}
    specs = {"x": rows, "logits": rows, "valid": rows, "rng": P(),
             "weights": {name: WEIGHT_SPECS[name] for name in weights}}
    specs = {name: specs[name] for name in inputs}
    devices = (*sharding.BATCH_AXES, TENSOR)  # a dropout key of its own on each

    def local(inputs):
        x = inputs["x"]
        b, t, _ = x.shape
        routing = moe.route(
            inputs["logits"].reshape(b * t, num_experts), k, scores=scores,
            renormalize=renormalize,
            valid=inputs["valid"].reshape(-1) if "valid" in inputs else None,
            reduce=lambda sums: jax.lax.psum(sums, sharding.BATCH_AXES))
        chosen, weights = (a.reshape(b, t, k) for a in (routing.experts, routing.weights))
        rng = inputs.get("rng")
        ffn = dict(activation=activation, gelu_approximate=gelu_approximate,
                   dropout_rate=dropout_rate, dropout_rng=None if rng is None else
                   jax.random.fold_in(rng, jax.lax.axis_index(devices)))
        experts = moe.Experts(**inputs["weights"])
        if capacity_factor:
            y, dropped = _all_to_all(x, chosen, weights, experts, num_experts,
                                     moe.capacity(t, k, num_experts, capacity_factor), **ffn)
        else:
            y = _all_gather(x, chosen, weights, experts, **ffn)
            dropped = jnp.zeros((), jnp.int32)
        return routing._replace(weights=weights, experts=chosen), y, dropped

    routing_specs = moe.Routing(weights=rows, experts=rows, aux_loss=P(), z_loss=P(), load=P())
    # Inside pipeline stages (a vmap over "stage") jax's varying-axes check refuses the
    # routing's comparisons, so it is off there (as in ops/ring.py), where the stages' test
    # holds the plain model's figures. Elsewhere it stays on: off, the gradients' collectives
    # round differently (1e-3 relative on a few weights after two steps).
    routing, y, dropped = jax.shard_map(
        local, mesh=mesh, in_specs=(specs,), out_specs=(routing_specs, rows, P()),
        check_vma=pipeline.stages() == 1)(inputs)
    return routing._replace(weights=routing.weights.reshape(b * t, k),
                            experts=routing.experts.reshape(b * t, k)), y, dropped


def _all_to_all(x: jax.Array, chosen: jax.Array, weights: jax.Array, experts: moe.Experts,
                num_experts: int, capacity_: int, **ffn) -> tuple[jax.Array, jax.Array]:
    """(y [B, T, D], dropped assignments of the whole batch) of this device's rows x [B, T, D]
    and their routing [B, T, K]: capacity buffers all-to-all to the experts and back."""
    buffer, where = moe.dispatch(x, chosen, num_experts, capacity_)
    buffer = jax.lax.all_to_all(buffer, EXPERT, 1, 0, tiled=True)
    out = moe.expert_ffn(buffer, experts, **ffn,
                         reduce=lambda partial: jax.lax.psum(partial, TENSOR))
    out = jax.lax.all_to_all(out, EXPERT, 0, 1, tiled=True)
    dropped = jax.lax.psum((~where.kept).sum(), sharding.BATCH_AXES)
    return moe.combine(out, where, weights), dropped


def _all_gather(x: jax.Array, chosen: jax.Array, weights: jax.Array, experts: moe.Experts,
                **ffn) -> jax.Array:
    """y [B, T, D] of this device's rows x [B, T, D] and their routing [B, T, K], dropless:
    the expert group's tokens gathered, this device's experts run on theirs, each token's sum
    reduce-scattered back. F is split over "tensor": the partial sums are added there after
    the scatter, and the output bias only on the first "tensor" device."""
    b, t, d = x.shape
    held = experts.ff_in.shape[0]

    def gather(a):
        return jax.lax.all_gather(a.reshape(b * t, *a.shape[2:]), EXPERT, tiled=True)

    x, chosen, weights = gather(x), gather(chosen), gather(weights)  # [n * B*T, ...]
    chosen = chosen - jax.lax.axis_index(EXPERT) * held
    here = (chosen >= 0) & (chosen < held)
    chosen = jnp.where(here, chosen, held)  # another device's expert: sorted last, zeros
    out = moe.grouped(x, chosen, experts._replace(bias_out=None), **ffn)
    weights = weights.astype(out.dtype)
    y = jnp.einsum("NKD,NK->ND", out, weights)
    if experts.bias_out is not None:
        bias = experts.bias_out.at[chosen].get(mode="fill", fill_value=0)  # 0 where not here
        first = jax.lax.axis_index(TENSOR) == 0
        y = y + jnp.where(first, jnp.einsum("NKD,NK->ND", bias, weights), 0)
    y = jax.lax.psum(jax.lax.psum_scatter(y, EXPERT, tiled=True), TENSOR)
    return y.reshape(b, t, d)
