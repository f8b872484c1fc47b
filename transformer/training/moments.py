"""Optimizer state: Adam's moments stored in bfloat16, and Adafactor's factored moments
sharded as their parameters (`optim.make_optimizer` picks them from the config)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


def scale_by_adam(b1: float, b2: float, eps: float,
                  moments_dtype: str = "float32") -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with both moments stored in ``moments_dtype``.

    Stored in ``moments_dtype``, computed in float32: the moments are cast to float32 before
    each update and the new ones rounded back after it, so each step rounds a moment once and
    the update uses the unrounded new moments. optax's own ``mu_dtype`` covers the first moment
    only (the second stays in the params' dtype) and multiplies the stored bfloat16 moment by
    b1 in bfloat16, a second rounding; hence this wrapper for both. float32 is optax's Adam
    exactly. In bfloat16 (8 significant bits) an increment of nu below 2**-9 of it rounds
    away: ``1 - b2`` must stay well above that (0.98 and 0.95 do; with 0.999 nu would stall
    wherever the gradient's square is near its mean).
    """
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    if moments_dtype == "float32":
        return inner

    def stored(state, dtype):
        return state._replace(mu=optax.tree.cast(state.mu, dtype),
                              nu=optax.tree.cast(state.nu, dtype))

    def init(params):
        return stored(inner.init(params), moments_dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, stored(state, jnp.float32), params)
        return updates, stored(state, moments_dtype)

    return optax.GradientTransformation(init, update)


def adafactor(learning_rate: optax.Schedule, *, decay_rate: float = 0.8,
              min_dim_size_to_factor: int = 128, weight_decay: float = 0.0,
              decay_mask=None) -> optax.GradientTransformation:
    """``optax.adafactor`` as T5 ran it (Shazeer and Stern, 2018): factored second moments
    (a row and a column mean of the squared gradient for every matrix whose two largest axes
    are >= ``min_dim_size_to_factor``; a full one otherwise), decay 1 - step**-0.8, updates
    clipped to RMS 1, no first moment, and the step relative to the parameter's RMS
    (``learning_rate`` ~1e-2, T5's). ``weight_decay`` > 0 decays where ``decay_mask`` says, by
    ``weight_decay`` x the learning rate a step, as AdamW's (T5 used none).

    The attention projections' kernels, stored 3-D, are factored as T5 factored its 2-D ones:
    a query, key or value kernel ``[..., d_model, heads, d_k]`` over d_model and heads x d_k,
    the output's ``[..., heads, d_k, d_model]`` over heads x d_k and d_model (``merge_heads``:
    optax sees them, their gradients and their statistics with the two head axes merged).
    optax alone would factor over the two largest axes, and d_k (64) is under the threshold,
    so they kept a full second moment (96% of the state on lm_default).

    Its ``init`` also takes params boxed with logical axis names (the trainer's): the factored
    statistics, which drop one axis of their parameter, get the names of the axes they keep,
    so they shard as their parameter does (a merged head axis is named as its heads axis)."""
    factored_rule = optax.adafactor(
        learning_rate, min_dim_size_to_factor=min_dim_size_to_factor, decay_rate=decay_rate,
        # As AdamW's: times the learning rate (optax's rate is per step).
        weight_decay_rate=(lambda count: weight_decay * learning_rate(count))
        if weight_decay else None,
        weight_decay_mask=decay_mask if weight_decay else None)
    inner = merge_heads(factored_rule)

    def init(params):
        if not _is_boxed(params):
            return inner.init(params)
        # merged once here, with their names: a kernel with a leading layer axis (scanned
        # layers) would look like another 3-D kernel to `inner`, which would merge it again
        params = _merged_boxes(params)
        state = factored_rule.init(nn.unbox(params))
        factored = state[0]
        boxes = jax.tree.leaves(params, is_leaf=_is_box)
        treedef = jax.tree.structure(params, is_leaf=_is_box)

        def rebox(stats, keep):  # keep(shape) -> the kept axes of the parameter
            leaves = [box.replace(value=leaf, names=_kept_names(box, leaf, keep))
                      if _is_box(box) else leaf
                      for box, leaf in zip(boxes, treedef.flatten_up_to(stats), strict=True)]
            return treedef.unflatten(leaves)

        dims = functools.partial(_factored_dims, min_dim=min_dim_size_to_factor)
        factored = factored._replace(
            v_row=rebox(factored.v_row, lambda shape: _without(shape, dims(shape), 1)),
            v_col=rebox(factored.v_col, lambda shape: _without(shape, dims(shape), 0)),
            v=rebox(factored.v, lambda shape: tuple(range(len(shape)))))
        return (factored, *state[1:])

    return optax.GradientTransformation(init, inner.update)


# The attention projections whose kernels hold two head axes, and the first of the two
# (from the end: [..., d_model, heads, d_k] and [..., heads, d_k, d_model]).
_HEAD_AXES = {"query": -2, "key": -2, "value": -2, "out": -3}


def _head_axis(path, ndim: int) -> int | None:
    """The first head axis of an attention kernel at ``path`` (None: not one)."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if ndim < 3 or len(names) < 2 or names[-1] != "kernel" or names[-2] not in _HEAD_AXES:
        return None
    return ndim + _HEAD_AXES[names[-2]]


def _merged_shape(shape, axis: int) -> tuple[int, ...]:
    return (*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])


def _merge(tree):
    """``tree`` (params or gradients) with each attention kernel's two head axes merged."""
    def merge(path, leaf):
        axis = _head_axis(path, jnp.ndim(leaf))
        return leaf if axis is None else jnp.reshape(
            leaf, _merged_shape(jnp.shape(leaf), axis))
    return jax.tree_util.tree_map_with_path(merge, tree)


def merge_heads(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run on the attention kernels (and their gradients) with the two head axes
    merged into one; the updates come back in the kernels' own shapes. A reshape, not a
    reimplementation: optax's factored rule, unchanged, sees the 2-D matrix T5 stored."""

    def init(params):
        return inner.init(_merge(params))

    def update(updates, state, params=None):
        merged, state = inner.update(_merge(updates), state,
                                     None if params is None else _merge(params))
        return jax.tree.map(lambda new, old: jnp.reshape(new, jnp.shape(old)), merged,
                            updates), state

    return optax.GradientTransformation(init, update)


def _merged_boxes(params):
    """Boxed params with the attention kernels' head axes merged, named as the heads axis."""
    def merge(path, box):
        axis = _head_axis(path, box.value.ndim) if _is_box(box) else None
        if axis is None:
            return box
        names = (*box.names[:axis + 1], *box.names[axis + 2:])
        return box.replace(value=jnp.reshape(box.value, _merged_shape(box.value.shape, axis)),
                           names=names)
    return jax.tree_util.tree_map_with_path(merge, params, is_leaf=_is_box)


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def _is_boxed(tree) -> bool:
    return any(map(_is_box, jax.tree.leaves(tree, is_leaf=_is_box)))


def _factored_dims(shape, *, min_dim: int) -> tuple[int, int] | None:
    """optax's choice (``factorized._factored_dims``): the indices of the second largest and
    the largest axis, or None when the second largest is below ``min_dim``."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    return None if shape[order[-2]] < min_dim else (int(order[-2]), int(order[-1]))


def _without(shape, dims, which: int) -> tuple[int, ...] | None:
    """The axes a statistic keeps: all but ``dims[which]`` (None: not factored, a [1] stub)."""
    return None if dims is None else tuple(a for a in range(len(shape)) if a != dims[which])


def _kept_names(box, leaf, keep) -> tuple:
    kept = keep(box.value.shape)
    if kept is None or len(kept) != leaf.ndim:  # a [1] stub: replicated
        return (None,) * leaf.ndim
    return tuple(box.names[a] for a in kept)
