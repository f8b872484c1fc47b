"""Optimizer state: Adam's moments stored in bfloat16, Adafactor's factored moments sharded as
their parameters, and which kernels Muon orthogonalizes (`optim.make_optimizer` picks them
from the config)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers


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


def applied_updates(opt_state) -> jax.Array:
    """The count of applied updates: the first ScaleByScheduleState's (Muon has two, equal)."""
    return optax.tree.get_all_with_path(opt_state, "ScaleByScheduleState")[0][1].count


def unbox_masked(opt_state):
    """``opt_state`` with the boxes around states optax masked out (Muon's) unboxed: no array."""
    def masked(x) -> bool:
        return _is_box(x) and not jax.tree.leaves(x.value)
    return jax.tree.map(lambda x: x.value if masked(x) else x, opt_state, is_leaf=_is_box)


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


# Muon: the blocks' projection kernels by name, with their rank before any stacked axes.
_MUON_RANKS = {"query": 3, "key": 3, "value": 3, "out": 3, "ff_in": 2, "ff_gate": 2,
               "ff_out": 2}
_INPUT_FIRST = ("query", "key", "value")  # [d_model, heads, d_k]: the rest is the output


def muon_dimensions(params):
    """How Muon sees each leaf of ``params`` (boxed or not) as matrices.

    The blocks' projection kernels get their input and output axes: query, key and value map
    d_model to heads x d_k, the others map all but their last axis to it. Leading axes beyond
    the kernel's own rank (stacked layers, experts) are batch axes, one matrix each. Every
    other leaf is None, left to Adam: embeddings and the output projection (Muon is for hidden
    layers, Jordan et al. 2024), biases, norm scales and any kernel of another name.
    """

    def dims(path, leaf):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if len(names) < 2 or names[-1] != "kernel" or names[-2] not in _MUON_RANKS:
            return None
        ndim = (leaf.value if _is_box(leaf) else leaf).ndim
        first = ndim - _MUON_RANKS[names[-2]]
        if first < 0:
            return None
        if names[-2] in _INPUT_FIRST:
            return MuonDimensionNumbers(first, tuple(range(first + 1, ndim)))
        return MuonDimensionNumbers(tuple(range(first, ndim - 1)), ndim - 1)

    return jax.tree_util.tree_map_with_path(dims, params, is_leaf=_is_box)


def muon(schedule: optax.Schedule, adam: optax.GradientTransformation, *, beta: float,
         rms: float, eps: float) -> optax.GradientTransformation:
    """Muon on the kernels ``muon_dimensions`` names, ``adam`` (the run's own) on the rest.

    optax's ``scale_by_muon`` (Nesterov momentum ``beta``, 5 Newton-Schulz steps), then each
    orthogonal update scaled to RMS ``rms`` x sqrt(max(fan_in, fan_out)) (Liu et al. 2025: an
    Adam-sized update, so Adam's learning rate carries over), then the schedule.
    ``optax.contrib.muon`` builds the same, but with Nesterov momentum in its Adam half too.
    """

    def scale(updates):
        def one(update, dims):
            if not isinstance(dims, MuonDimensionNumbers):  # masked: Adam's leaf
                return update
            reduction, output = (tuple(np.atleast_1d(axes)) for axes in dims)
            fan_in = math.prod(update.shape[a] for a in reduction)
            fan_out = math.prod(update.shape[a] for a in output)
            return update * (rms * math.sqrt(max(fan_in, fan_out)))
        return jax.tree.map(one, updates, muon_dimensions(updates),
                            is_leaf=lambda x: isinstance(x, optax.MaskedNode))

    orthogonal = optax.chain(
        optax.contrib.scale_by_muon(beta=beta, eps=eps, weight_dimension_numbers=muon_dimensions),
        optax.stateless(lambda updates, params=None: scale(updates)),
        optax.scale_by_learning_rate(schedule))

    def labels(params):
        return jax.tree.map(lambda dims: "adam" if dims is None else "muon",
                            muon_dimensions(params), is_leaf=lambda x: x is None or isinstance(
                                x, MuonDimensionNumbers))

    return optax.partition({"muon": orthogonal, "adam": adam}, labels)
