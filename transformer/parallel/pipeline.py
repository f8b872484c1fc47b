"""Pipeline stages: the circular schedule, its bubble, its checks, and a stack run through it.

S stages (the mesh's "stage" axis), M microbatches, R repeats (docs/architecture.md, "Pipeline
stages"). The layers are cut into S x R chunks; chunk r S + s runs on stage s in repeat r. At
tick t stage s runs microbatch (t - s) mod M of repeat (t - s) div M when 0 <= t - s < M R,
else idles: M R + S - 1 ticks, each stage busy M R of them (MaxText's circular schedule,
`layers/pipeline.py`). `run` is that schedule in plain JAX: a `lax.scan` over the ticks, the
stages `vmap`ped with the stage axis sharded over "stage", the activations rolled one stage a
tick (XLA: a collective permute). No library offers it for a Linen stack, hence our own.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

STAGE_AXIS = "stage"  # the mesh axis of the stages (`sharding.mesh_axes`)
IDLE = -1  # `schedule`'s entry for a stage that runs nothing at a tick


def stages() -> int:
    """How many stages the mesh in context (`jax.sharding.use_abstract_mesh`) has: its "stage"
    size, 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(STAGE_AXIS, 1)


def num_ticks(stages_: int, microbatches: int, repeats: int) -> int:
    """M R + S - 1: the ticks of one pass of every microbatch through every chunk."""
    return microbatches * repeats + stages_ - 1


def bubble_fraction(stages_: int, microbatches: int, repeats: int) -> float:
    """(S - 1) / (M R + S - 1): the share of a stage's ticks in which it idles."""
    return (stages_ - 1) / num_ticks(stages_, microbatches, repeats)


def tick_ids(tick, stages_: int, microbatches: int, repeats: int, xp=np):
    """(microbatch [S], repeat [S], busy [S]) of each stage at `tick` (a number or a traced
    scalar; `xp` numpy or jax.numpy). An idle stage's ids are clipped into range."""
    done = tick - xp.arange(stages_)  # how many items stage s has started before this tick
    busy = (done >= 0) & (done < microbatches * repeats)
    done = xp.clip(done, 0, microbatches * repeats - 1)
    return done % microbatches, done // microbatches, busy


def schedule(stages_: int, microbatches: int, repeats: int) -> np.ndarray:
    """[ticks, S, 2] int: (microbatch, repeat) that stage s runs at each tick, IDLE in both
    where it runs nothing."""
    rows = []
    for tick in range(num_ticks(stages_, microbatches, repeats)):
        m, r, busy = tick_ids(tick, stages_, microbatches, repeats)
        rows.append(np.where(busy[:, None], np.stack([m, r], axis=1), IDLE))
    return np.stack(rows).astype(np.int64)


def stack_field(architecture: str) -> str:
    """The model field counting the layers the stages split: the ViT's encoder's, else the
    decoder's."""
    return "num_encoder_layers" if architecture == "vision" else "num_decoder_layers"


def check(*, stages_: int, layers: int, repeats: int, microbatches: int, architecture: str,
          scan_layers: bool) -> None:
    """One line naming the setting where a model cannot be pipelined over `stages_` (> 1).
    The context and expert axes compose: each stage's self-attention and routed layers run
    `ops/ring.py`'s and `ops/expert_parallel.py`'s shard_maps, which the stages' vmap
    (spmd_axis_name "stage") also splits over "stage", and the routed layers' router sums come
    out of `run` per microbatch and chunk (`model/pipelined.py` combines them)."""
    if stages_ <= 1:
        return
    if architecture not in ("decoder", "vision"):
        raise ValueError(f"mesh.stage={stages_} pipelines decoder-only models and the ViT "
                         f"alone: model.architecture={architecture!r} has a text encoder "
                         f"stack, which the schedule does not run yet (nor carries the encoded "
                         f"rows to a decoder's stages): set mesh.stage=1")
    if not scan_layers:
        raise ValueError(f"mesh.stage={stages_} splits the stacked layers: set "
                         f"model.scan_layers=True (checkpoints convert either way)")
    if repeats < 1 or layers % (stages_ * repeats):
        raise ValueError(f"model.{stack_field(architecture)}={layers} is not divisible by "
                         f"mesh.stage={stages_} x mesh.pipeline_repeats={repeats}")
    if microbatches < stages_:
        raise ValueError(f"mesh.pipeline_microbatches={microbatches} is fewer than "
                         f"mesh.stage={stages_}: the last stage's output would come back "
                         f"before stage 0 is free; use at least {stages_} (0: as many as stages)")


def to_stages(stack, stages_: int, repeats: int):
    """A tree of [L, ...] layer stacks as [S, R, L / (S R), ...]: chunk r S + s at [s, r]."""

    def one(x):
        chunks = x.reshape((repeats, stages_, x.shape[0] // (stages_ * repeats)) + x.shape[1:])
        return _on_stages(jnp.swapaxes(chunks, 0, 1))

    return jax.tree.map(one, stack)


def _on_stages(x):
    """x with its leading axis sharded over "stage", the others left to XLA (no constraint
    without a mesh)."""
    if stages() == 1:
        return x
    return jax.lax.with_sharding_constraint(
        x, P(STAGE_AXIS, *(P.UNCONSTRAINED,) * (x.ndim - 1)))


def split_rows(x, microbatches: int):
    """[B, ...] -> [M, B / M, ...]: row b in microbatch b mod M (rows keep their batch
    sharding: each microbatch takes rows from every batch shard)."""
    rows = x.shape[0] // microbatches
    return jnp.swapaxes(x.reshape((rows, microbatches) + x.shape[1:]), 0, 1)


def join_rows(x):
    """`split_rows` undone: [M, B / M, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:])


def run(stage_fn: Callable, params, x, side, *, stages_: int, repeats: int):
    """The microbatches x [M, b, ...] through the S x R chunks of `params` ([S, R, ...] trees,
    `to_stages`) on the circular schedule -> (their outputs [M, b, ...], the chunks' `aux`
    trees with leaves [M, S R, ...]: microbatch m's chunk c at [m, c]).

    `stage_fn(chunk_params, x [b, ...], side_m, microbatch, chunk) -> ([b, ...], aux)` runs
    one chunk (its index r S + s); `aux` is a tree of arrays (router sums, or empty) the same
    for every chunk. `side` is a tree of [M, ...] per-microbatch inputs (masks, positions),
    each stage given its microbatch's slice.
    """
    microbatches = x.shape[0]
    state = _on_stages(jnp.zeros((stages_,) + x.shape[1:], x.dtype))  # each stage's input

    def one_stage(chunks, inp, microbatch, repeat, stage):
        chunk = jax.tree.map(lambda p: p[repeat], chunks)
        side_m = jax.tree.map(lambda a: a[microbatch], side)
        return stage_fn(chunk, inp, side_m, microbatch, repeat * stages_ + stage)

    stage_step = jax.vmap(one_stage, spmd_axis_name=STAGE_AXIS)

    def tick(carry, t):
        state, buffer = carry
        microbatch, repeat, _ = tick_ids(t, stages_, microbatches, repeats, xp=jnp)
        # stage 0 reads its microbatch's slot: the input, or the last repeat's output
        first = jax.lax.dynamic_index_in_dim(buffer, microbatch[0], keepdims=False)
        state = _on_stages(state.at[0].set(first))
        out, aux = stage_step(params, state, microbatch, repeat, jnp.arange(stages_))
        out = _on_stages(out)
        # the last stage's output goes back to its microbatch's slot
        last = t - (stages_ - 1)
        slot = jnp.clip(last, 0, None) % microbatches
        kept = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
        written = jnp.where(last >= 0, out[-1], kept)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, written, slot, 0)
        return (_on_stages(jnp.roll(out, 1, axis=0)), buffer), aux

    ticks = jnp.arange(num_ticks(stages_, microbatches, repeats))
    (_, buffer), aux = jax.lax.scan(tick, (state, x), ticks)  # aux leaves [ticks, S, ...]
    # microbatch m's chunk c = r S + s ran on stage s at tick r M + m + s (`tick_ids`)
    repeat, stage = np.divmod(np.arange(stages_ * repeats)[None, :], stages_)
    at = repeat * microbatches + np.arange(microbatches)[:, None] + stage  # [M, S R]
    return buffer, jax.tree.map(lambda a: a[at, stage], aux)
