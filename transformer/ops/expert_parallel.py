"""Expert parallelism's capacity dispatch: tokens travel to their experts and back by
all-to-all over the mesh's "expert" axis, inside a `jax.shard_map` (as MaxText's
`layers/moe.py` runs its routed layer in one).

The mesh is the one in context (`jax.sharding.use_abstract_mesh`, as the train step sets it).
Every device holds whole rows of the batch (split over data x fsdp x expert) and
E / mesh.expert experts (the `expert` axis of their weights, F split over "tensor"). Each
device fills its rows' [B/n, E, C, D] buffer (`moe.dispatch`: C slots per expert for each row,
the row being the group, as for one device); `jax.lax.all_to_all` over "expert" sends each
expert's slots to the device that holds it, which receives [mesh.expert * B/n, E/mesh.expert,
C, D]: the rows of its expert group for its own experts. Its experts run their matrix products
(partial over "tensor", summed by `psum`), a second all-to-all brings the outputs back, and each
device combines its tokens' outputs with their router weights. Drops are per row, so they are
the single device's: the same assignments are kept and counted.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from transformer.ops import moe
from transformer.training import sharding

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


def with_capacity(x: jax.Array, routing: moe.Routing, experts: moe.Experts, *,
                  capacity_factor: float, activation: str, gelu_approximate: bool = True,
                  dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`moe.with_capacity` over the mesh in context (module docstring): (y [B, T, D], dropped
    assignments of the whole batch)."""
    mesh = jax.sharding.get_abstract_mesh()
    b, t, _ = x.shape
    num_experts = experts.ff_in.shape[0]
    k = routing.experts.shape[-1]
    rows_split = sharding.batch_shards(mesh.shape)
    if b % rows_split:
        raise ValueError(f"expert parallelism splits the batch's {b} rows over mesh data x fsdp "
                         f"x expert = {rows_split}: make the batch a multiple of it")
    c = moe.capacity(t, k, num_experts, capacity_factor)
    weights = {name: w for name, w in experts._asdict().items() if w is not None}
    rows = P(sharding.BATCH_AXES)
    devices = (*sharding.BATCH_AXES, TENSOR)  # a dropout key of its own on each

    def local(x, chosen, combine_weights, weights, *rng):
        buffer, where = moe.dispatch(x, chosen, num_experts, c)
        buffer = jax.lax.all_to_all(buffer, EXPERT, 1, 0, tiled=True)
        out = moe.expert_ffn(
            buffer, moe.Experts(**weights), activation=activation,
            gelu_approximate=gelu_approximate, dropout_rate=dropout_rate,
            dropout_rng=jax.random.fold_in(rng[0], jax.lax.axis_index(devices)) if rng else None,
            reduce=lambda partial: jax.lax.psum(partial, TENSOR))
        out = jax.lax.all_to_all(out, EXPERT, 0, 1, tiled=True)
        dropped = jax.lax.psum((~where.kept).sum(), sharding.BATCH_AXES)
        return moe.combine(out, where, combine_weights), dropped

    rng = () if dropout_rng is None else (dropout_rng,)
    return jax.shard_map(
        local, mesh=mesh, out_specs=(rows, P()),
        in_specs=(rows, rows, rows, {name: WEIGHT_SPECS[name] for name in weights},
                  *(P() for _ in rng)),
    )(x, routing.experts.reshape(b, t, k), routing.weights.reshape(b, t, k), weights, *rng)
