"""Loss-spike skipping (`optimizer.skip_spikes`): a rolling window of the applied updates'
losses and gradient norms, kept in the train state (and so in its checkpoints), decides whether
an update is a spike; a spike's update is not applied, as a non-finite one is not.

A step is a spike when its loss or its gradient norm lies more than `spike_threshold` standard
deviations above the mean of the last `spike_window` applied updates' values (a one-sided rolling
z-score, MaxText's `skip_step_on_spikes`, Levanter's skip-step). Nothing is judged before the
window is full. A skipped step's values do not enter the window, so a lasting jump (not a spike)
is skipped step after step until `max_skipped_in_a_row` such steps stop the run; once that many
are in a row no further update is applied (the loop stops the run at its next train line).
The settings and their checks: `config.spike_config`.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from transformer.config import SpikeConfig

# The spread a window of nearly equal values is given, relative to its mean: without it a
# window whose values agree to float32 rounding would call the next rounding-size rise a spike.
RELATIVE_SPREAD_FLOOR = 1e-3
TINY = 1e-30  # a window of zeros: any positive value is a spike


@flax.struct.dataclass
class SpikeWindow:
    """The rolling window and the counts, all replicated."""

    losses: jax.Array  # [window] float32: applied updates' losses, the oldest overwritten
    grad_norms: jax.Array  # [window] float32: their gradient norms
    count: jax.Array  # int32: applied updates recorded; the next goes to slot count % window
    in_a_row: jax.Array  # int32: steps skipped as spikes since the last step that was not one
    skipped: jax.Array  # int32: steps skipped as spikes in the run so far


def init_window(config: SpikeConfig) -> SpikeWindow:
    zeros = jnp.zeros((config.window,), jnp.float32)
    zero = jnp.zeros((), jnp.int32)
    return SpikeWindow(losses=zeros, grad_norms=zeros, count=zero, in_a_row=zero, skipped=zero)


def _above(values: jax.Array, value: jax.Array, threshold: float) -> jax.Array:
    """`value` more than `threshold` standard deviations above the mean of `values`."""
    mean = jnp.mean(values)
    spread = jnp.maximum(jnp.std(values), RELATIVE_SPREAD_FLOOR * jnp.abs(mean) + TINY)
    return (value - mean) / spread > threshold


def judge(window: SpikeWindow, config: SpikeConfig, loss: jax.Array, grad_norm: jax.Array,
          finite: jax.Array) -> tuple[jax.Array, SpikeWindow]:
    """(spike, the window after this step): whether this step's (finite) update is a spike and
    must not be applied, and the window with it recorded if it is applied (finite, no spike).
    Once `max_in_a_row` spikes are in a row, every later step counts as one too."""
    loss = loss.astype(jnp.float32)
    grad_norm = grad_norm.astype(jnp.float32)
    full = window.count >= config.window
    spike = finite & full & (_above(window.losses, loss, config.threshold)
                             | _above(window.grad_norms, grad_norm, config.threshold))
    spike = spike | (window.in_a_row >= config.max_in_a_row)
    applied = finite & ~spike
    slot = window.count % config.window
    recorded = SpikeWindow(
        losses=jnp.where(applied, window.losses.at[slot].set(loss), window.losses),
        grad_norms=jnp.where(applied, window.grad_norms.at[slot].set(grad_norm),
                             window.grad_norms),
        count=window.count + applied.astype(jnp.int32),
        in_a_row=jnp.where(spike, window.in_a_row + 1, 0),
        skipped=window.skipped + spike.astype(jnp.int32))
    return spike, recorded
