"""Mixture of experts, as pure functions of arrays (no Flax): the router, its auxiliary losses,
and two ways of sending tokens to their experts and back. Shapes in the package's legend
(`transformer/__init__.py`), plus N tokens, E experts, K experts per token, C slots per expert.

`route` scores each token's experts in float32 (softmax or sigmoid of x W_router), keeps the
top K, renormalises their weights to sum to 1 (Mixtral) where asked, and returns the Switch/GShard
load-balancing loss, the router z-loss (ST-MoE) and each expert's share of the assignments.

`dropless` sorts the N*K (token, expert) assignments by expert and runs each expert on its
contiguous rows with `jax.lax.ragged_dot` (grouped matrix products): no token is dropped and the
shapes stay static (N*K rows). For N*K <= E (decoding) it gathers each assignment's weights.
`capacity` gives every expert C = ceil(factor * T * K / E) slots per row of the batch (GShard's
groups), fills them in priority order (every token's first choice, then its second, ...) and
drops what does not fit. A dropped assignment adds nothing (the residual connection carries the
token), and the count of dropped ones is returned. Its steps are `dispatch` (tokens into
[B, E, C, D] buffers), `expert_ffn` and `combine`. Over an `expert` mesh axis
`ops/expert_parallel.py` runs these per device with an all-to-all between, and `grouped` (the
products of `dropless`) on the tokens all-gathered from the device's expert group.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from transformer.ops import layers

ROUTER_SCORES = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """A router's decision for N tokens and its statistics (float32)."""

    weights: jax.Array  # [N, K] the combine weights of the chosen experts
    experts: jax.Array  # [N, K] int32, the chosen experts, best first
    aux_loss: jax.Array  # scalar: E * sum_e f_e * P_e (1 for K=1 when balanced; K for K)
    z_loss: jax.Array  # scalar: mean over tokens of logsumexp(logits)^2
    load: jax.Array  # [E] fraction of the N*K assignments each expert receives (sums to 1)


def route(logits: jax.Array, k: int, *, scores: str = "softmax", renormalize: bool = True,
          valid: jax.Array | None = None, reduce=lambda sums: sums) -> Routing:
    """Top-k routing of logits [N, E] (computed in float32 by the caller's router).

    Scores are softmax(logits) or sigmoid(logits). The top-k scores are the combine weights,
    divided by their sum where `renormalize` (Mixtral's top-2). `valid` [N] (bool; None: all)
    keeps padding tokens out of the statistics. The load-balancing loss is Switch's/GShard's
    (and transformers' Mixtral `load_balancing_loss_func`): E * sum_e f_e * P_e with f_e the
    fraction of tokens sent to expert e (summed over the K choices) and P_e the mean score of
    expert e. The z-loss is ST-MoE's mean of logsumexp(logits)^2. `reduce` sums the token
    counts and sums behind the statistics over the devices (in a shard_map, where each holds
    some of the tokens), so that they are the whole batch's.
    """
    if scores not in ROUTER_SCORES:
        raise ValueError(f"router scores {scores!r}; choose one of {ROUTER_SCORES}")
    logits = logits.astype(jnp.float32)
    n, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1) if scores == "softmax" else jax.nn.sigmoid(logits)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    mask = jnp.ones((n,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    chosen = jax.nn.one_hot(experts, e, dtype=jnp.float32).sum(axis=1) * mask[:, None]  # [N, E]
    sums = reduce((mask.sum(), chosen.sum(axis=0), (probs * mask[:, None]).sum(axis=0),
                   jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * mask)))
    return Routing(weights, experts.astype(jnp.int32), *route_statistics(*sums, k))


def route_statistics(count: jax.Array, chosen_sums: jax.Array, prob_sums: jax.Array,
                     z_sum: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(load-balancing loss, z-loss, load [.., E]) from the sums `route` reduces: the token
    count, the choices and scores summed per expert [.., E], and the summed squared
    log-normalisers. Leading axes (layers) are kept."""
    count = jnp.maximum(count, 1.0)
    tokens_per_expert = chosen_sums / count[..., None]  # f_e, sums to K
    mean_probs = prob_sums / count[..., None]  # P_e
    aux_loss = chosen_sums.shape[-1] * jnp.sum(tokens_per_expert * mean_probs, axis=-1)
    return aux_loss, z_sum / count, tokens_per_expert / k


def activate(hidden: jax.Array, gate: jax.Array | None, activation: str,
             gelu_approximate: bool = True) -> jax.Array:
    """The feed-forward's nonlinearity of x W1 (`hidden`) and x W_gate (`gate`, gated ones),
    as `layers.feed_forward` applies it (biases already added)."""
    if activation == "relu":
        return jax.nn.relu(hidden)
    if activation == "gelu":
        return jax.nn.gelu(hidden, approximate=gelu_approximate)
    if activation == "silu":
        return jax.nn.silu(hidden)
    if activation == "swiglu":
        return jax.nn.silu(gate) * hidden
    return jax.nn.gelu(gate, approximate=gelu_approximate) * hidden


class Experts(NamedTuple):
    """The experts' weights: ff_in, ff_gate [E, D, F], ff_out [E, F, D], biases [E, F], [E, D]
    (ff_gate only for a gated activation; biases optional)."""

    ff_in: jax.Array
    ff_out: jax.Array
    ff_gate: jax.Array | None = None
    bias_in: jax.Array | None = None
    bias_out: jax.Array | None = None


def dropless(x: jax.Array, routing: Routing, experts: Experts, *, activation: str,
             gelu_approximate: bool = True, dropout_rate: float = 0.0,
             dropout_rng: jax.Array | None = None) -> jax.Array:
    """sum_k weight_k * FFN_{expert_k}(x) for x [N, D]: the N*K assignments sorted by expert,
    each expert's rows multiplied by its weights with `jax.lax.ragged_dot`, then put back.
    Where N*K <= E (decoding a token or a few) each assignment gathers its expert's weights
    instead: no more weight reads than one pass over the experts, and it runs under
    `jax.vmap` (the generator decodes row by row), which jax 0.12's `ragged_dot` does not."""
    n, k = routing.experts.shape
    ffn = dict(activation=activation, gelu_approximate=gelu_approximate,
               dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    if n * k <= experts.ff_in.shape[0]:
        out = _gathered(x, routing.experts, experts, **ffn)
    else:
        out = grouped(x, routing.experts, experts, **ffn)
    return jnp.einsum("NKD,NK->ND", out, routing.weights.astype(out.dtype))


def grouped(x: jax.Array, chosen: jax.Array, experts: Experts, *, activation: str,
            gelu_approximate: bool, dropout_rate: float,
            dropout_rng: jax.Array | None) -> jax.Array:
    """Each assignment's expert output [N, K, D] by grouped products (`ragged_dot`). A chosen
    expert E (past the E held: another device's, `ops/expert_parallel.py`) sorts after every
    group and gives zeros."""
    n, k = chosen.shape
    num_experts = experts.ff_in.shape[0]
    flat = chosen.reshape(-1)  # [N*K], token i's choices at rows i*K .. i*K+K-1
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rows = x[order // k]  # [N*K, D]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    hidden = jax.lax.ragged_dot(rows, experts.ff_in, group_sizes)
    if experts.bias_in is not None:
        hidden = hidden + experts.bias_in[sorted_experts]
    gate = None
    if experts.ff_gate is not None:
        gate = jax.lax.ragged_dot(rows, experts.ff_gate, group_sizes)
    hidden = layers.dropout(activate(hidden, gate, activation, gelu_approximate),
                            dropout_rate, dropout_rng)
    out = jax.lax.ragged_dot(hidden, experts.ff_out, group_sizes)
    if experts.bias_out is not None:
        out = out + experts.bias_out[sorted_experts]
    out = jnp.where((sorted_experts < num_experts)[:, None], out, 0)
    return jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)


def _gathered(x: jax.Array, chosen: jax.Array, experts: Experts, *, activation: str,
              gelu_approximate: bool, dropout_rate: float,
              dropout_rng: jax.Array | None) -> jax.Array:
    """Each assignment's expert output [N, K, D], its expert's weights gathered [N, K, ...]."""
    hidden = jnp.einsum("ND,NKDF->NKF", x, experts.ff_in[chosen])
    if experts.bias_in is not None:
        hidden = hidden + experts.bias_in[chosen]
    gate = None
    if experts.ff_gate is not None:
        gate = jnp.einsum("ND,NKDF->NKF", x, experts.ff_gate[chosen])
    hidden = layers.dropout(activate(hidden, gate, activation, gelu_approximate),
                            dropout_rate, dropout_rng)
    out = jnp.einsum("NKF,NKFD->NKD", hidden, experts.ff_out[chosen])
    if experts.bias_out is not None:
        out = out + experts.bias_out[chosen]
    return out


def capacity(length: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for a group of `length` tokens: ceil(factor * length * K / E)."""
    return max(1, math.ceil(factor * length * k / num_experts))


def slots(experts: jax.Array, num_experts: int, capacity_: int) -> tuple[jax.Array, jax.Array]:
    """(slot [T, K] int32, kept [T, K] bool) of one group's assignments experts [T, K]: an
    expert's slots go to the first choices of all tokens in order, then the second choices, ....
    An assignment past the expert's `capacity_` is not kept."""
    t, k = experts.shape
    priority = experts.T.reshape(-1)  # choice-major: [K*T]
    one_hot = jax.nn.one_hot(priority, num_experts, dtype=jnp.int32)
    position = (jnp.cumsum(one_hot, axis=0) - 1)[jnp.arange(k * t), priority]
    slot = position.reshape(k, t).T
    return slot, slot < capacity_


class Slots(NamedTuple):
    """Where `dispatch` put each assignment [B, T, K]: the buffer's row, expert and slot, and
    whether it was kept (slot < C)."""

    rows: jax.Array
    experts: jax.Array
    slot: jax.Array
    kept: jax.Array


def dispatch(x: jax.Array, chosen: jax.Array, num_experts: int,
             capacity_: int) -> tuple[jax.Array, Slots]:
    """(buffer [B, E, C, D], where each assignment went) of x [B, T, D] and its rows' chosen
    experts [B, T, K]: each row (a group) fills its own C slots of every expert (`slots`).
    An assignment past them is left out."""
    b, t, d = x.shape
    k = chosen.shape[-1]
    slot, kept = jax.vmap(lambda e: slots(e, num_experts, capacity_))(chosen)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], chosen.shape)
    target = jnp.where(kept, slot, capacity_)  # slot C is out of range: dropped by the scatter
    tokens = jnp.broadcast_to(x[:, :, None, :], (b, t, k, d))
    buffer = jnp.zeros((b, num_experts, capacity_, d), x.dtype).at[rows, chosen, target].set(
        tokens, mode="drop")
    return buffer, Slots(rows, chosen, target, kept)


def expert_ffn(buffer: jax.Array, experts: Experts, *, activation: str,
               gelu_approximate: bool = True, dropout_rate: float = 0.0,
               dropout_rng: jax.Array | None = None,
               reduce=lambda partial: partial) -> jax.Array:
    """Each expert's FFN of its slots: buffer [B, E, C, D] -> [B, E, C, D] with experts [E, ..]
    (B rows: this device's, or all-to-all the rows of every device for its own experts).
    `reduce` sums the partial products where F is split (a shard_map's "tensor" axis) before
    the output bias."""
    hidden = jnp.einsum("BECD,EDF->BECF", buffer, experts.ff_in)
    if experts.bias_in is not None:
        hidden = hidden + experts.bias_in[:, None, :]
    gate = None
    if experts.ff_gate is not None:
        gate = jnp.einsum("BECD,EDF->BECF", buffer, experts.ff_gate)
    hidden = layers.dropout(activate(hidden, gate, activation, gelu_approximate),
                            dropout_rate, dropout_rng)
    out = reduce(jnp.einsum("BECF,EFD->BECD", hidden, experts.ff_out))
    if experts.bias_out is not None:
        out = out + experts.bias_out[:, None, :]
    return out


def combine(out: jax.Array, where: Slots, weights: jax.Array) -> jax.Array:
    """y [B, T, D]: each token's kept slots of out [B, E, C, D] summed with its router weights
    [B, T, K] (a dropped assignment adds nothing)."""
    gathered = out.at[where.rows, where.experts, where.slot].get(mode="fill", fill_value=0)
    weights = jnp.where(where.kept, weights, 0.0).astype(out.dtype)
    return jnp.einsum("BTKD,BTK->BTD", gathered, weights)


def with_capacity(x: jax.Array, routing: Routing, experts: Experts, *, capacity_factor: float,
                  activation: str, gelu_approximate: bool = True, dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None,
                  constrain=lambda buffer: buffer) -> tuple[jax.Array, jax.Array]:
    """(y [B, T, D], dropped assignments) for x [B, T, D] and routing of its B*T tokens, with
    `capacity` slots per expert in each row; `constrain` places the [B, E, C, D] buffers
    (e.g. `nn.with_logical_constraint` onto the `expert` mesh axis)."""
    b, t, _ = x.shape
    num_experts = experts.ff_in.shape[0]
    k = routing.experts.shape[-1]
    c = capacity(t, k, num_experts, capacity_factor)
    buffer, where = dispatch(x, routing.experts.reshape(b, t, k), num_experts, c)
    out = constrain(expert_ffn(
        constrain(buffer), experts, activation=activation, gelu_approximate=gelu_approximate,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng))
    return combine(out, where, routing.weights.reshape(b, t, k)), (~where.kept).sum()
