"""Learning-rate schedules, optimizers and the label-smoothed cross-entropy (pure JAX/optax).

The paper's recipe (Vaswani et al., 2017, section 5.3): Adam with b1 0.9, b2 0.98, eps 1e-9 and

    lrate = d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)

with warmup_steps 4000 (peak 6.99e-4 for d_model 512, 4.94e-4 for 1024, at step 4000), and label
smoothing eps_ls 0.1 (section 5.4).

Step convention: optax calls a schedule with the 0-based count of updates already applied, so
every schedule here evaluates its formula at ``step = count + 1``: the k-th update (1-based, the
``step`` of metrics.jsonl) uses the formula at k, never at 0.

Float16 training scales the loss dynamically (`LossScaleState`, as NVIDIA's AMP and `jmp` do):
the loss is multiplied by the scale before differentiation and the float32 gradients divided by
it. A step whose gradients overflow is skipped and halves the scale (down to 1), and every
``period`` consecutive finite steps double it.

Shapes are written in the package's legend (`transformer/__init__.py`).
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer.training import moments

SCHEDULES = ("paper_rsqrt", "cosine", "linear", "wsd", "rsqrt", "constant")
OPTIMIZERS = ("adam", "adamw", "adafactor", "muon")
MOMENTS_DTYPES = ("float32", "bfloat16")


def _step(count) -> jax.Array:
    """The 1-based update index, as float32, from optax's 0-based count."""
    return jnp.asarray(count, jnp.float32) + 1.0


def _warmup(peak: float, warmup_steps: int, step: jax.Array) -> jax.Array:
    """Linear warmup: peak * step / warmup_steps, capped at peak (no warmup when 0)."""
    return peak * jnp.minimum(1.0, step / max(warmup_steps, 1))


def rsqrt_schedule(d_model: int, warmup_steps: int) -> optax.Schedule:
    """The paper's schedule: d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5).

    Linear warmup for ``warmup_steps`` updates, then decay with the inverse square root of the
    step. The peak d_model**-0.5 * warmup_steps**-0.5 is reached at update ``warmup_steps``.
    """
    scale = d_model**-0.5
    warmup = float(warmup_steps) ** -1.5

    def schedule(count):
        step = _step(count)
        return scale * jnp.minimum(jax.lax.rsqrt(step), step * warmup)

    return schedule


def warmup_rsqrt_schedule(peak: float, warmup_steps: int) -> optax.Schedule:
    """Linear warmup to ``peak`` at update ``warmup_steps``, then peak * sqrt(warmup / step)."""

    def schedule(count):
        step = _step(count)
        decay = peak * jnp.sqrt(warmup_steps / jnp.maximum(step, float(warmup_steps)))
        return jnp.where(step < warmup_steps, _warmup(peak, warmup_steps, step), decay)

    return schedule


def warmup_cosine_schedule(
    peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.0
) -> optax.Schedule:
    """Linear warmup to ``peak`` at update ``warmup_steps``, then a half cosine that reaches
    ``end_fraction * peak`` at update ``total_steps`` and stays there."""
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(count):
        step = _step(count)
        progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = 0.5 * (1.0 + jnp.cos(math.pi * progress))
        decay = peak * (end_fraction + (1.0 - end_fraction) * cosine)
        return jnp.where(step < warmup_steps, _warmup(peak, warmup_steps, step), decay)

    return schedule


def warmup_linear_schedule(
    peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.0
) -> optax.Schedule:
    """Linear warmup to ``peak`` at update ``warmup_steps``, then a straight line to
    ``end_fraction * peak`` at update ``total_steps``, where it stays.

    Decaying linearly to zero is what Bergsma et al. (2025, "Straight to Zero") found best for
    LLMs trained on many tokens per parameter.
    """
    return warmup_stable_decay_schedule(peak, warmup_steps, total_steps, 1.0, end_fraction)


def warmup_stable_decay_schedule(
    peak: float, warmup_steps: int, total_steps: int, decay_fraction: float,
    end_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warmup to ``peak``, ``peak`` until the last ``decay_fraction`` of
    ``total_steps``, then a straight line to ``end_fraction * peak`` at ``total_steps``.

    This is warmup-stable-decay (WSD, Hägele et al. 2024). With ``decay_fraction`` 1 the
    decay starts at the end of the warmup: the linear schedule.
    """
    decay_start = max(total_steps - decay_fraction * total_steps, warmup_steps)
    decay_steps = max(total_steps - decay_start, 1)

    def schedule(count):
        step = _step(count)
        progress = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
        decay = peak * (1.0 - (1.0 - end_fraction) * progress)
        return jnp.where(step < warmup_steps, _warmup(peak, warmup_steps, step), decay)

    return schedule


def warmup_constant_schedule(peak: float, warmup_steps: int) -> optax.Schedule:
    """Linear warmup to ``peak`` at update ``warmup_steps`` (none when 0), then constant."""
    return lambda count: _warmup(peak, warmup_steps, _step(count))


# The defaults of the keys only some choices read (configs/common.py holds them for the flags).
DECAY_FRACTION, MUON_BETA, MUON_RMS = 0.2, 0.95, 0.2


def _fail(key: str, value: Any, why: str) -> None:
    raise ValueError(f"optimizer.{key}={value!r} {why}")


def make_schedule(opt_cfg, *, d_model: int, total_steps: int) -> optax.Schedule:
    """The schedule named by ``opt_cfg.schedule`` (one of SCHEDULES).

    ``opt_cfg`` is the config's ``optimizer`` section (a ConfigDict or dict) with ``schedule``,
    ``learning_rate`` (the peak; ignored by "paper_rsqrt", whose peak follows from ``d_model``),
    ``warmup_steps`` and, for "cosine", "linear" and "wsd", the optional ``end_fraction``
    (default 0). "wsd" also reads ``decay_fraction``, the share of the updates it decays over.
    """
    name = opt_cfg.get("schedule", "paper_rsqrt")
    warmup_steps = int(opt_cfg.get("warmup_steps", 0))
    peak = float(opt_cfg.get("learning_rate", 0.0))
    if name not in SCHEDULES:
        _fail("schedule", name, f"is not one of {', '.join(SCHEDULES)}")
    if warmup_steps < (1 if name in ("paper_rsqrt", "rsqrt") else 0):
        _fail("warmup_steps", warmup_steps, f"must be >= 1 for schedule {name!r}")
    if name != "paper_rsqrt" and peak <= 0:
        _fail("learning_rate", peak, f"must be > 0 for schedule {name!r}")
    if name == "paper_rsqrt":
        return rsqrt_schedule(d_model, warmup_steps)
    if name == "rsqrt":
        return warmup_rsqrt_schedule(peak, warmup_steps)
    if name in ("cosine", "linear", "wsd"):
        if total_steps <= warmup_steps:
            _fail("warmup_steps", warmup_steps, f"must be < num_train_steps={total_steps}")
        end_fraction = float(opt_cfg.get("end_fraction", 0.0))
        if name == "cosine":
            return warmup_cosine_schedule(peak, warmup_steps, total_steps, end_fraction)
        if name == "linear":
            return warmup_linear_schedule(peak, warmup_steps, total_steps, end_fraction)
        decay_fraction = float(opt_cfg.get("decay_fraction", DECAY_FRACTION))
        if not 0.0 < decay_fraction <= 1.0:
            _fail("decay_fraction", decay_fraction, "must be in (0, 1] for schedule 'wsd'")
        return warmup_stable_decay_schedule(peak, warmup_steps, total_steps, decay_fraction,
                                            end_fraction)
    return warmup_constant_schedule(peak, warmup_steps)


def decay_mask(params) -> Any:
    """True for the leaves weight decay applies to: matrices (kernels, embeddings).

    Excluded: 1-D leaves (biases, norm scales) and leaves named ``bias`` or ``scale`` of any rank,
    so stacked layers (``scan_layers``, leading ``L`` axis) keep their biases undecayed too.
    """

    def decays(path, leaf):
        name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
        return jnp.ndim(leaf) > 1 and name not in ("bias", "scale")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
    opt_cfg, *, d_model: int, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer of ``opt_cfg.name`` (one of OPTIMIZERS) and its learning-rate schedule.

    "adam": the paper's Adam (``b1``, ``b2``, ``eps`` from the config; paper 0.9, 0.98, 1e-9).
    "adamw": Adam with decoupled ``weight_decay`` on matrices only (see ``decay_mask``).
    Both store their moments in ``moments_dtype`` ("float32", default, or "bfloat16": 4 bytes
    of state per parameter instead of 8; see ``moments.scale_by_adam``).
    "adafactor": see ``moments.adafactor`` (``decay_rate``, ``min_dim_size_to_factor``,
    ``weight_decay``; ``b1``, ``b2`` and ``eps`` unused).
    "muon": Muon on the blocks' projection kernels (``moments.muon``), "adam" on the rest,
    one schedule for both. ``muon_beta`` is its momentum (0.95) and ``muon_rms`` the RMS of
    its update over sqrt(max(fan_in, fan_out)) (0.2: Adam-sized, Liu et al. 2025).
    ``clip_norm`` > 0 clips gradients to that global norm before the optimizer sees them.
    The schedule is returned so the trainer can log ``schedule(step - 1)`` for update ``step``.
    """
    name = opt_cfg.get("name", "adam")
    if name not in OPTIMIZERS:
        _fail("name", name, f"is not one of {', '.join(OPTIMIZERS)}")
    moments_dtype = opt_cfg.get("moments_dtype", "float32")
    if moments_dtype not in MOMENTS_DTYPES:
        _fail("moments_dtype", moments_dtype, f"is not one of {', '.join(MOMENTS_DTYPES)}")
    if name in ("adafactor", "muon") and moments_dtype != "float32":
        _fail("moments_dtype", moments_dtype, f"is for adam and adamw, not {name}: "
              "leave it float32")
    schedule = make_schedule(opt_cfg, d_model=d_model, total_steps=total_steps)
    weight_decay = float(opt_cfg.get("weight_decay", 0.0))
    if name == "adafactor":
        min_dim = opt_cfg.get("min_dim_size_to_factor", 128)
        if not isinstance(min_dim, int) or isinstance(min_dim, bool) or min_dim < 1:
            _fail("min_dim_size_to_factor", min_dim, "must be an int >= 1 (default 128)")
        tx = moments.adafactor(schedule, decay_rate=float(opt_cfg.get("decay_rate", 0.8)),
                               min_dim_size_to_factor=min_dim, weight_decay=weight_decay,
                               decay_mask=decay_mask)
    else:
        # optax.adam and optax.adamw, with the moments' dtype (the same state tree).
        adam = moments.scale_by_adam(float(opt_cfg.get("b1", 0.9)), float(opt_cfg.get("b2", 0.98)),
                             float(opt_cfg.get("eps", 1e-9)), moments_dtype)
        decay = ([optax.add_decayed_weights(weight_decay, decay_mask)] if name == "adamw"
                 else [])
        tx = optax.chain(adam, *decay, optax.scale_by_learning_rate(schedule))
        tx = _muon(opt_cfg, schedule, tx) if name == "muon" else tx
    clip_norm = float(opt_cfg.get("clip_norm", 0.0) or 0.0)
    if clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return tx, schedule


def _muon(opt_cfg, schedule: optax.Schedule,
          adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """``moments.muon`` with the config's keys (see ``make_optimizer``)."""
    beta, rms = opt_cfg.get("muon_beta", MUON_BETA), opt_cfg.get("muon_rms", MUON_RMS)
    if not _is_number(beta) or not 0.0 <= beta < 1.0:
        _fail("muon_beta", beta, f"must be a number in [0, 1) (default {MUON_BETA})")
    if not _is_number(rms) or rms <= 0:
        _fail("muon_rms", rms, f"must be a number > 0 (default {MUON_RMS})")
    return moments.muon(schedule, adam, beta=float(beta), rms=float(rms),
                        eps=float(opt_cfg.get("eps", 1e-9)))


def _is_number(value) -> bool:
    """An int or a float, not a bool (a config value written as 1, 1.0 or 1e-2)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- dynamic loss scaling (float16) -------------------------------------------------------------

MIN_LOSS_SCALE = 1.0


class LossScaleConfig(NamedTuple):
    """``optimizer.loss_scale_initial`` and ``optimizer.loss_scale_period`` (float16 runs)."""

    initial: float  # the scale of the first step: a power of two >= 1
    period: int  # consecutive finite steps after which the scale doubles


def loss_scale_config(opt_cfg) -> LossScaleConfig:
    """The checked loss-scaling settings of the ``optimizer`` section (defaults 2**15 and 2000).

    The scale must be a power of two, so that multiplying the loss by it and dividing the
    gradients by it are exact in floating point.
    """
    initial = opt_cfg.get("loss_scale_initial", 2.0**15)
    period = opt_cfg.get("loss_scale_period", 2000)
    if (not _is_number(initial) or not 1 <= initial < math.inf
            or not math.log2(initial).is_integer()):
        _fail("loss_scale_initial", initial, "must be a power of two >= 1 (default 2**15)")
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        _fail("loss_scale_period", period, "must be an int >= 1 (default 2000)")
    return LossScaleConfig(float(initial), period)


class LossScaleState(NamedTuple):
    """The dynamic loss scale, part of a float16 run's checkpointed train state."""

    scale: jax.Array  # float32 []: what the loss is multiplied by before differentiation
    finite_steps: jax.Array  # int32 []: consecutive finite steps since the scale last changed
    overflow_steps: jax.Array  # int32 []: updates skipped so far for non-finite gradients


def init_loss_scale(config: LossScaleConfig) -> LossScaleState:
    return LossScaleState(scale=jnp.asarray(config.initial, jnp.float32),
                          finite_steps=jnp.zeros((), jnp.int32),
                          overflow_steps=jnp.zeros((), jnp.int32))


def update_loss_scale(state: LossScaleState, grads_finite: jax.Array,
                      period: int) -> LossScaleState:
    """The scale after a step: finite gradients count towards ``period`` and, at the
    ``period``-th in a row, double the scale (the count restarts). An overflow halves it (never
    below MIN_LOSS_SCALE), restarts the count and is counted in ``overflow_steps``."""
    grown = state.finite_steps + 1 >= period
    finite_scale = jnp.where(grown, state.scale * 2.0, state.scale)
    return LossScaleState(
        scale=jnp.where(grads_finite, finite_scale,
                        jnp.maximum(state.scale * 0.5, MIN_LOSS_SCALE)),
        finite_steps=jnp.where(grads_finite & ~grown, state.finite_steps + 1, 0),
        overflow_steps=state.overflow_steps + jnp.where(grads_finite, 0, 1).astype(jnp.int32))


class LossSums(NamedTuple):
    """Sums over weighted target tokens. Divide by the global ``weight_sum`` for means."""

    loss_sum: jax.Array  # cross-entropy (smoothed when eps > 0) plus z-loss
    weight_sum: jax.Array  # sum of the weights: the count of non-pad target tokens
    z_loss_sum: jax.Array  # the z-loss part of loss_sum (0 when z_loss is 0)


def cross_entropy_loss(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> LossSums:
    """Label-smoothed cross-entropy summed over weighted tokens, in float32.

    logits [B,T,V] (any float dtype), targets [B,T] int, weights [B,T] (0 = padding) or None.
    With eps = ``label_smoothing`` the target distribution is q = (1-eps)*onehot + eps/V
    (``optax.smooth_labels``), and the per-token loss -sum_v q_v log p_v is computed without a
    one-hot of V as (1-eps)*nll + eps*mean_v(-log p_v), with log p = logits - logsumexp(logits).
    eps = 0 gives the negative log likelihood. ``z_loss`` adds z_loss * logsumexp(logits)**2.
    Returns sums, not means, so the caller divides by the token count over all devices and
    accumulation steps.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B,T]
    # logits[b, t, targets[b, t]] as a compare-and-reduce: XLA fuses it into one pass over V
    # (no materialised one-hot under jit) and it partitions cleanly when V is sharded.
    vocab_ids = jnp.arange(logits.shape[-1], dtype=targets.dtype)
    target_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    loss = lse - target_logit  # nll [B,T]
    if label_smoothing:
        smooth = lse - jnp.mean(logits, axis=-1)  # mean_v(-log p_v) [B,T]
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    weights = weights.astype(jnp.float32)
    z_loss_sum = jnp.sum(z_loss * jnp.square(lse) * weights) if z_loss else jnp.zeros(())
    return LossSums(
        loss_sum=jnp.sum(loss * weights) + z_loss_sum,
        weight_sum=jnp.sum(weights),
        z_loss_sum=z_loss_sum,
    )


def nll_sum(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Unsmoothed negative log likelihood sum and weight sum (eval loss; perplexity = exp of the
    ratio): ``cross_entropy_loss`` with label_smoothing 0 and no z-loss."""
    sums = cross_entropy_loss(logits, targets, weights)
    return sums.loss_sum, sums.weight_sum


def projected_cross_entropy_loss(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    *,
    vocab_axis: int = 0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_length: int | None = None,
    grad_scale: jax.Array | float = 1.0,
) -> LossSums:
    """``cross_entropy_loss(hidden @ kernel, ...)`` a chunk of positions at a time, so the
    logits [B,T,V] are never held whole.

    hidden [B,T,D] (the final hidden states, compute dtype). Kernel the output projection,
    [V,D] (``vocab_axis=0``: a tied embedding) or [D,V] (``vocab_axis=1``). Targets, weights,
    label_smoothing and z_loss as in ``cross_entropy_loss``, whose formula each chunk applies.
    At most ``chunk_length`` positions of every row go at once (None: all T), in chunks of
    equal length (T zero-padded up to a multiple). Under differentiation the forward pass also
    computes the gradient of each chunk (softmax minus smoothed targets, times the weights)
    and at once its products with the kernel and the hidden states. The kernel's gradient
    accumulates over chunks in float32. The backward pass only scales them. Memory holds one
    chunk's logits. On a CPU the chunk stays in cache. Gradients flow through ``loss_sum``;
    ``z_loss_sum`` is a figure, not differentiable (it is part of ``loss_sum``).
    ``grad_scale`` (a float32 scalar, not differentiated) should be the factor the caller
    multiplies ``loss_sum`` by before differentiating (e.g. a float16 loss scale over the
    token count): the chunk's float32 gradient of the logits is multiplied by it before it is
    rounded to the compute dtype, as an unfused backward pass would round it, so float16 keeps
    the small probabilities of a large vocabulary. It changes no result, only the rounding.
    """
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    weights = weights.astype(jnp.float32)
    length = targets.shape[1]
    # As many chunks as chunk_length asks for, of equal length (the least padding).
    num_chunks = 1 if chunk_length is None else -(-length // max(1, int(chunk_length)))
    chunk = -(-length // num_chunks)
    loss_sum, z_loss_sum = _projected_loss(hidden, kernel, targets, weights,
                                           jnp.asarray(grad_scale, jnp.float32), vocab_axis,
                                           float(label_smoothing), float(z_loss), chunk)
    return LossSums(loss_sum=loss_sum, weight_sum=jnp.sum(weights),
                    z_loss_sum=jax.lax.stop_gradient(z_loss_sum))


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [T/C, B, C, ...] (C = chunk; T zero-padded up to a multiple of C)."""
    pad = -x.shape[1] % chunk
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], x.shape[1] // chunk, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _chunk_loss(hidden, kernel, targets, weights, grad_scale, vocab_axis, label_smoothing,
                z_loss, with_grad):
    """One chunk: (loss_sum, z_loss_sum) and, with_grad, (d hidden, d kernel as [D, V]), both
    times grad_scale."""
    spec = "BCD,VD->BCV" if vocab_axis == 0 else "BCD,DV->BCV"

    def sums(logits):
        out = cross_entropy_loss(logits, targets, weights, label_smoothing=label_smoothing,
                                 z_loss=z_loss)
        return out.loss_sum, out.z_loss_sum

    logits = jnp.einsum(spec, hidden, kernel, preferred_element_type=jnp.float32)
    if not with_grad:
        return sums(logits), None
    (loss_sum, z_loss_sum), grad_fn = jax.vjp(sums, logits)
    (d_logits,) = grad_fn((jnp.ones_like(loss_sum), jnp.zeros_like(z_loss_sum)))
    d_logits = (d_logits * grad_scale).astype(hidden.dtype)
    d_hidden = jnp.einsum("BCV,VD->BCD" if vocab_axis == 0 else "BCV,DV->BCD", d_logits, kernel)
    d_kernel = jnp.einsum("BCD,BCV->DV", hidden, d_logits, preferred_element_type=jnp.float32)
    return (loss_sum, z_loss_sum), (d_hidden, d_kernel)


def _scan_chunks(hidden, kernel, targets, weights, grad_scale, vocab_axis, label_smoothing,
                 z_loss, chunk, with_grad):
    """Sums over all chunks and, with_grad, d hidden [B,T,D] and d kernel (kernel's layout),
    both times grad_scale."""
    batch, length = targets.shape
    vocab = kernel.shape[vocab_axis]

    def body(carry, xs):
        loss_sum, z_loss_sum, d_kernel = carry
        hidden_chunk, targets_chunk, weights_chunk = xs
        (loss, z), grads = _chunk_loss(hidden_chunk, kernel, targets_chunk, weights_chunk,
                                       grad_scale, vocab_axis, label_smoothing, z_loss,
                                       with_grad)
        if grads is None:
            return (loss_sum + loss, z_loss_sum + z, d_kernel), None
        return (loss_sum + loss, z_loss_sum + z, d_kernel + grads[1]), grads[0]

    zero = jnp.zeros((), jnp.float32)
    d_kernel = jnp.zeros((hidden.shape[-1], vocab) if with_grad else (), jnp.float32)
    (loss_sum, z_loss_sum, d_kernel), d_hidden = jax.lax.scan(
        body, (zero, zero, d_kernel),
        (_chunks(hidden, chunk), _chunks(targets, chunk), _chunks(weights, chunk)))
    if not with_grad:
        return (loss_sum, z_loss_sum), None
    d_hidden = jnp.moveaxis(d_hidden, 0, 1).reshape(batch, -1, hidden.shape[-1])[:, :length]
    d_kernel = (d_kernel.T if vocab_axis == 0 else d_kernel).astype(kernel.dtype)
    return (loss_sum, z_loss_sum), (d_hidden, d_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _projected_loss(hidden, kernel, targets, weights, grad_scale, vocab_axis, label_smoothing,
                    z_loss, chunk):
    return _scan_chunks(hidden, kernel, targets, weights, grad_scale, vocab_axis,
                        label_smoothing, z_loss, chunk, with_grad=False)[0]


def _projected_loss_fwd(hidden, kernel, targets, weights, grad_scale, vocab_axis,
                        label_smoothing, z_loss, chunk):
    sums, grads = _scan_chunks(hidden, kernel, targets, weights, grad_scale, vocab_axis,
                               label_smoothing, z_loss, chunk, with_grad=True)
    return sums, (grads, targets, weights, grad_scale)


def _projected_loss_bwd(vocab_axis, label_smoothing, z_loss, chunk, residuals, cotangents):
    (d_hidden, d_kernel), targets, weights, grad_scale = residuals
    # The loss_sum's cotangent (z_loss_sum is stopped, see the public function) over the
    # grad_scale the forward pass already applied: 1 when the caller passed the cotangent.
    scale = cotangents[0] / grad_scale
    return ((d_hidden * scale).astype(d_hidden.dtype), (d_kernel * scale).astype(d_kernel.dtype),
            np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(weights),
            jnp.zeros_like(grad_scale))


_projected_loss.defvjp(_projected_loss_fwd, _projected_loss_bwd)
