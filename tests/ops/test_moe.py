"""Tests of transformer.ops.moe: routing, losses and both dispatches against a numpy reference
written out token by token, and one expert with top-1 routing against the dense feed-forward."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.ops import expert_parallel, layers, moe
from transformer.parallel import sharding

B = 2
T = 6
D = 8
F = 12
E = 4


def np_ffn(x, w_in, w_out, w_gate=None, b_in=None, b_out=None, activation="swiglu"):
    """One expert's FFN of one token, in float64 numpy."""
    h = x @ w_in + (0 if b_in is None else b_in)
    if activation == "swiglu":
        g = x @ w_gate
        h = g / (1 + np.exp(-g)) * h
    else:
        h = np.maximum(h, 0)
    return h @ w_out + (0 if b_out is None else b_out)


def np_route(logits, k, scores, renormalize):
    """(weights [N, K], experts [N, K]) token by token: scores, the k best, renormalised."""
    weights = []
    experts = []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if scores == "softmax" \
            else 1 / (1 + np.exp(-row))
        best = sorted(range(len(row)), key=lambda e: -p[e])[:k]
        w = p[best] / (p[best].sum() if renormalize else 1.0)
        weights.append(w)
        experts.append(best)
    return np.array(weights), np.array(experts)


def params(seed, activation="swiglu", bias=False):
    rng = np.random.default_rng(seed)
    w = {"ff_in": rng.normal(size=(E, D, F)) / 3, "ff_out": rng.normal(size=(E, F, D)) / 3}
    if activation == "swiglu":
        w["ff_gate"] = rng.normal(size=(E, D, F)) / 3
    if bias:
        w["bias_in"], w["bias_out"] = rng.normal(size=(E, F)), rng.normal(size=(E, D))
    return w


def experts_of(w):
    return moe.Experts(**{name: jnp.asarray(a, jnp.float32) for name, a in w.items()})


@pytest.mark.parametrize("k,scores,renormalize", [(2, "softmax", True), (1, "softmax", False),
                                                  (3, "sigmoid", True), (2, "sigmoid", False)])
def test_route_matches_numpy(k, scores, renormalize):
    logits = np.random.default_rng(0).normal(size=(B * T, E)).astype(np.float32)
    routing = moe.route(jnp.asarray(logits), k, scores=scores, renormalize=renormalize)
    weights, experts = np_route(logits, k, scores, renormalize)
    np.testing.assert_array_equal(routing.experts, experts)
    np.testing.assert_allclose(routing.weights, weights, rtol=1e-6)


def test_aux_losses_match_their_formulas():
    n = 10
    k = 2
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(n, E)).astype(np.float32)
    valid = np.array([True] * 7 + [False] * 3)
    routing = moe.route(jnp.asarray(logits), k, valid=jnp.asarray(valid))
    kept = logits[valid].astype(np.float64)
    probs = np.exp(kept) / np.exp(kept).sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :k]
    counts = np.array([(top == e).sum() for e in range(E)])
    f = counts / len(kept)  # tokens per expert, summed over the choices
    expected = E * np.sum(f * probs.mean(0))
    np.testing.assert_allclose(routing.aux_loss, expected, rtol=1e-6)
    lse = np.log(np.exp(kept).sum(-1))
    np.testing.assert_allclose(routing.z_loss, np.mean(lse ** 2), rtol=1e-6)
    np.testing.assert_allclose(routing.load, counts / (k * len(kept)), rtol=1e-6)


def test_balanced_top1_aux_loss_is_one():
    logits = jnp.asarray(np.eye(E, dtype=np.float32) * 5)  # token e prefers expert e
    np.testing.assert_allclose(moe.route(logits, 1).aux_loss, 1.0, rtol=1e-6)


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("relu", True)])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_matches_numpy(activation, bias, k):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B * T, D))
    logits = rng.normal(size=(B * T, E)).astype(np.float32)
    w = params(3, activation, bias)
    routing = moe.route(jnp.asarray(logits), k)
    y = moe.dropless(jnp.asarray(x, jnp.float32), routing, experts_of(w), activation=activation)
    weights, experts = np_route(logits, k, "softmax", True)
    expected = np.stack([
        sum(wt * np_ffn(x[i], *(w.get(n, [None] * E)[e] for n in (
            "ff_in", "ff_out", "ff_gate", "bias_in", "bias_out")), activation=activation)
            for wt, e in zip(weights[i], experts[i], strict=True))
        for i in range(B * T)])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("relu", True)])
def test_few_tokens_gather_their_experts_and_run_under_vmap(activation, bias):
    """N*K <= E takes the gathered path: the numpy reference's outputs, token by token under
    `jax.vmap` (as the generator decodes), which the grouped path cannot run."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B * T, 1, D)).astype(np.float32)
    logits = rng.normal(size=(B * T, 1, E)).astype(np.float32)
    w = params(5, activation, bias)

    def one(x_row, logits_row):
        routing = moe.route(logits_row, 2)
        return moe.dropless(x_row, routing, experts_of(w), activation=activation)

    y = jax.vmap(one)(jnp.asarray(x), jnp.asarray(logits))[:, 0]
    weights, experts = np_route(logits[:, 0], 2, "softmax", True)
    expected = np.stack([
        sum(wt * np_ffn(x[i, 0], *(w.get(n, [None] * E)[e] for n in (
            "ff_in", "ff_out", "ff_gate", "bias_in", "bias_out")), activation=activation)
            for wt, e in zip(weights[i], experts[i], strict=True))
        for i in range(B * T)])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)

def np_capacity(x, weights, experts, w, factor):
    """Row by row: first choices of all tokens in order take the slots first, then the second."""
    b, t, _ = x.shape
    k = experts.shape[-1]
    c = max(1, math.ceil(factor * t * k / E))
    y = np.zeros_like(x)
    dropped = 0
    for row in range(b):
        used = [0] * E
        for choice in range(k):
            for tok in range(t):
                e = experts[row * t + tok, choice]
                if used[e] >= c:
                    dropped += 1
                    continue
                used[e] += 1
                y[row, tok] += weights[row * t + tok, choice] * np_ffn(
                    x[row, tok], w["ff_in"][e], w["ff_out"][e], w["ff_gate"][e])
    return y, dropped


@pytest.mark.parametrize("factor", [1.0, 1.5, 100.0])
def test_capacity_matches_numpy_and_counts_drops(factor):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, T, D))
    logits = (rng.normal(size=(B * T, E)) + np.array([2.0, 0, 0, 0])).astype(np.float32)
    w = params(5)
    routing = moe.route(jnp.asarray(logits), 2)
    y, dropped = moe.with_capacity(jnp.asarray(x, jnp.float32), routing, experts_of(w),
                                   capacity_factor=factor, activation="swiglu")
    weights, experts = np_route(logits, 2, "softmax", True)
    expected, expected_dropped = np_capacity(x, weights, experts, w, factor)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert int(dropped) == expected_dropped
    assert (expected_dropped > 0) == (factor < 100)  # the skewed router overflows expert 0


@pytest.mark.parametrize("activation", ["swiglu", "relu", "gelu"])
def test_one_expert_top1_is_the_dense_feed_forward(activation):
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w_in, w_out, w_gate = (jnp.asarray(rng.normal(size=s), jnp.float32)
                           for s in ((D, F), (F, D), (D, F)))
    gate = w_gate if activation == "swiglu" else None
    dense = layers.feed_forward(x, w_in, w_out, ff_gate=gate, activation=activation)
    routing = moe.route(jnp.asarray(rng.normal(size=(B * T, 1)), jnp.float32), 1)
    experts = moe.Experts(w_in[None], w_out[None], None if gate is None else gate[None])
    y = moe.dropless(x.reshape(B * T, D), routing, experts, activation=activation)
    np.testing.assert_array_equal(y.reshape(B, T, D), dense)
    y, dropped = moe.with_capacity(x, routing, experts, capacity_factor=1.0,
                                   activation=activation)
    # the buffers' batched matrix products [B, E, C, D] x [E, D, F] round differently
    np.testing.assert_allclose(y, dense, rtol=1e-5, atol=1e-5)
    assert int(dropped) == 0


def test_dropless_gradients_reach_every_used_expert():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(B * T, D)), jnp.float32)
    routing = moe.route(jnp.asarray(rng.normal(size=(B * T, E)), jnp.float32), 2)
    w = experts_of(params(8))

    def loss(w):
        return jnp.sum(moe.dropless(x, routing, w, activation="swiglu") ** 2)

    grads = jax.grad(loss)(w)
    used = np.isin(np.arange(E), np.asarray(routing.experts))
    assert (np.abs(np.asarray(grads.ff_in)).sum((1, 2)) > 0).tolist() == used.tolist()


CAPACITY_MESHES = {"data2-expert4": {"data": 2, "expert": 4},
                   "tensor2-expert4": {"tensor": 2, "expert": 4},
                   "context2-expert4": {"context": 2, "expert": 4}}
DROPLESS_MESHES = {**CAPACITY_MESHES, "data2-fsdp2-expert2": {"data": 2, "fsdp": 2, "expert": 2},
                   "fsdp2-tensor2-expert2": {"fsdp": 2, "tensor": 2, "expert": 2}}


@pytest.mark.parametrize("axes,factor", [
    *(pytest.param(axes, factor, id=f"{name}-{label}") for name, axes in CAPACITY_MESHES.items()
      for factor, label in ((1.0, "drops"), (2.0, "room-for-all"))),
    *(pytest.param(axes, 0.0, id=f"{name}-dropless") for name, axes in DROPLESS_MESHES.items())])
def test_expert_parallel_equals_one_device(axes, factor):
    """8 devices, the experts split 4 or 2 ways (beside data and fsdp, tensor splitting F, or
    context whose rows are gathered whole), each device routing its own rows: outputs, router
    statistics (padding left out), dropped count and the gradients of every input (biases
    too) equal one device's `route` and `with_capacity` or `dropless`. Capacity: the compiled
    program sends the tokens all-to-all; capacity is per row on both, so the same assignments
    drop (factor 1: the skewed router overflows expert 0; factor E/K = 2: C = T, none can).
    Dropless (factor 0): no all-to-all, tokens all-gathered and outputs reduce-scattered over
    "expert", none dropped."""
    b = 8
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(b, T, D)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(b, T, E)) + np.array([1.5, 0, 0, 0]), jnp.float32)
    valid = jnp.asarray(np.arange(T) < np.arange(2, 2 + b)[:, None])  # ragged rows of padding
    w = experts_of(params(10, bias=True))

    def one_device(x, logits, w):
        routing = moe.route(logits.reshape(b * T, E), 2, valid=valid.reshape(-1))
        if not factor:
            y = moe.dropless(x.reshape(b * T, D), routing, w, activation="swiglu")
            return routing, y.reshape(b, T, D), jnp.zeros((), jnp.int32)
        y, dropped = moe.with_capacity(x, routing, w, capacity_factor=factor,
                                       activation="swiglu")
        return routing, y, dropped

    def expert_parallel_(x, logits, w):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return expert_parallel.route_and_dispatch(
                x, logits, w, k=2, valid=valid, capacity_factor=factor, activation="swiglu")

    def value_and_grads(dispatch):
        def loss(x, logits, w):
            routing, y, dropped = dispatch(x, logits, w)
            return jnp.sum(y * jnp.sin(y)) + routing.aux_loss + routing.z_loss, (
                routing, y, dropped)
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, logits, w)

    (want_loss, (want_routing, want, want_dropped)), want_grads = jax.jit(
        lambda: value_and_grads(one_device))()
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, **axes})
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda: value_and_grads(expert_parallel_)).lower().compile()
        (got_loss, (got_routing, got, got_dropped)), got_grads = compiled()
    hlo = compiled.as_text()
    if factor:
        assert hlo.count("all-to-all(") >= 4  # there and back, forward and backward
    else:
        assert "all-to-all(" not in hlo and "all-gather(" in hlo and "reduce-scatter(" in hlo
    assert int(got_dropped) == int(want_dropped)
    assert (int(want_dropped) > 0) == (factor == 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_routing.experts, want_routing.experts)
    for name in ("weights", "aux_loss", "z_loss", "load"):
        np.testing.assert_allclose(getattr(got_routing, name), getattr(want_routing, name),
                                   rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w_ in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-5)
