"""Training only the adapters (`finetune.lora_rank` > 0, `transformer.model.lora`).

`freeze_base(tx, model)` wraps the run's optimizer so that it updates the `lora_a` and
`lora_b` parameters alone: every other parameter gets a zero update and
holds no optimizer state (`optax.multi_transform` gives the wrapped optimizer only the
adapters), so the base stays bit-identical and Adam's moments cost 2 x the adapters' size
instead of 2 x the model's.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformer.model import lora
from transformer.model.config import TransformerConfig

TRAIN, FREEZE = "adapter", "frozen"


def labels(params):
    """Each parameter's label: TRAIN for an adapter, FREEZE for the base."""
    def label(path, _):  # a boxed (logically partitioned) leaf's path ends in its box
        keys = {getattr(entry, "key", None) for entry in path}
        return TRAIN if keys & {lora.A, lora.B} else FREEZE

    return jax.tree_util.tree_map_with_path(label, params)


def freeze_base(tx: optax.GradientTransformation,
                model: TransformerConfig) -> optax.GradientTransformation:
    """`tx` on the adapters only where the model has them (`lora_rank` > 0), else `tx`."""
    if not model.lora_rank:
        return tx
    inner = optax.multi_transform({TRAIN: tx, FREEZE: optax.stateless(_zero)}, labels)

    def init(params):  # boxed params (train_state._init_boxed) leave boxes around the
        return jax.tree.map(_unboxed_mask, inner.init(params),  # frozen leaves' MaskedNode
                            is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))

    return optax.GradientTransformation(init, inner.update)


def _zero(updates, params):
    """+0 updates shaped and sharded as the gradients. (`optax.set_to_zero`'s `zeros_like` is a
    constant that the partitioner placed unsharded: the whole frozen model, 30 GiB more per
    device for an 8B model on a v5e-8. |g| x 0 is an elementwise op on the sharded
    gradient, +0 where g is finite, NaN where it is not, as the full model's update.)"""
    del params
    return jax.tree.map(lambda g: jnp.abs(g) * 0, updates)


def _unboxed_mask(leaf):
    """A logical-axis box holding a frozen parameter's `MaskedNode` (no state) -> the node."""
    if isinstance(leaf, nn.meta.AxisMetadata) and isinstance(leaf.unbox(), optax.MaskedNode):
        return leaf.unbox()
    return leaf
