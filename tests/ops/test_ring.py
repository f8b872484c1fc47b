"""Context parallelism's attention (`transformer.ops.ring`) on 8 fake CPU devices against
`dot_product_attention` on the whole rows: outputs and gradients in float32, for both
strategies, causal (load balanced or not), bidirectional, packed, windowed (with global
tokens) and prefix-LM masks, grouped-query heads, and meshes mixing context with data, fsdp
and tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.model.config import CONTEXT_STRATEGIES
from transformer.ops import attention, masks, ring
from transformer.parallel import sharding

B = 2
T = 32
N = 4
K = 2
H = 8


def test_load_balanced_order_gives_each_chip_an_early_and_a_late_block():
    np.testing.assert_array_equal(ring.load_balanced_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    x = np.arange(2 * 24).reshape(2, 24)
    np.testing.assert_array_equal(ring.from_load_balanced(ring.to_load_balanced(x, 3), 3), x)
    with pytest.raises(ValueError, match="not a multiple of 2 x mesh.context=4"):
        ring.load_balanced_order(12, 4)


def test_strategies_are_the_configs():
    assert ring.STRATEGIES == CONTEXT_STRATEGIES


def _inputs(num_kv_heads=K):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, num_kv_heads, H)).astype(np.float32) for _ in range(2))
    segments = np.ones((B, T), np.int32)
    segments[0, 10:] = 2
    segments[0, 26:] = 0  # padding: its rows attend to nothing (zeros)
    prefix = np.zeros((B, T), np.int32)
    prefix[:, :7] = 1
    return q, k, v, segments, prefix


def _reference(q, k, v, segments, prefix, *, causal, window, global_tokens):
    mask = masks.make_segment_mask(segments, segments)
    if causal:
        mask = masks.combine_masks(mask, masks.make_causal_mask(T) if prefix is None
                                   else masks.make_prefix_lm_mask(prefix))
    return attention.dot_product_attention(q, k, v, mask=mask, local_window_size=window,
                                           global_tokens=global_tokens)


def _split(mesh, q, k, v, segments, prefix, *, causal, window, global_tokens, strategy):
    """The op on `mesh`, its rows in load-balanced order where causal, put back after."""
    shards = mesh.shape["context"]
    balanced = causal

    def run(q, k, v, segments, prefix):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            order = ((lambda x: ring.to_load_balanced(x, shards)) if balanced
                     else (lambda x: x))
            q, k, v, segments = map(order, (q, k, v, segments))
            out = ring.self_attention(
                q, k, v, causal=causal, strategy=strategy, local_window_size=window,
                global_tokens=global_tokens, segment_ids=segments,
                in_prefix=None if prefix is None else order(prefix), load_balanced=balanced)
            return ring.from_load_balanced(out, shards) if balanced else out

    return run(q, k, v, segments, prefix)


CASES = {  # causal, window, global tokens, prefix
    "causal": (True, None, 0, False),
    "bidirectional": (False, None, 0, False),
    "causal-window": (True, (5, 0), 0, False),
    "window-global": (False, (3, 3), 2, False),
    "prefix": (True, None, 0, True),
}
MESHES = {
    "data-context": {"data": 2, "fsdp": 1, "context": 4, "tensor": 1},
    "fsdp-context-tensor": {"data": 1, "fsdp": 2, "context": 2, "tensor": 2},
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", ring.STRATEGIES)
def test_outputs_and_gradients_equal_unsplit(strategy, case, mesh_name):
    _check(strategy, case, mesh_name)


@pytest.mark.parametrize("case", ["causal-window", "prefix"])
def test_tiles_within_a_block_equal_unsplit(case, monkeypatch):
    """A chip's 8 queries and 8 keys a block in tiles of 2 queries and 4 keys."""
    monkeypatch.setattr(ring, "QUERY_TILE", 2)
    monkeypatch.setattr(ring, "KEY_TILE", 4)
    _check("ring", case, "data-context")


def _check(strategy, case, mesh_name):
    causal, window, global_tokens, with_prefix = CASES[case]
    mesh = sharding.make_mesh(MESHES[mesh_name])
    # multi-query on the tensor mesh: one kv head, repeated for tensor 2
    q, k, v, segments, prefix = _inputs(1 if mesh_name == "fsdp-context-tensor" else K)
    prefix = prefix if with_prefix else None
    kwargs = dict(causal=causal, window=window, global_tokens=global_tokens)
    cotangent = np.random.default_rng(1).normal(size=(B, T, N, H)).astype(np.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, segments, prefix, **kwargs) * cotangent)

    split = jax.jit(jax.value_and_grad(loss(lambda *a, **kw: _split(mesh, *a, **kw,
                                                                    strategy=strategy)),
                                       argnums=(0, 1, 2)),
                    in_shardings=NamedSharding(mesh, P()))
    expected = jax.value_and_grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)
    value, grads = split(q, k, v)
    np.testing.assert_allclose(value, expected[0], rtol=1e-5)
    for got, want in zip(grads, expected[1], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)
    out = jax.jit(lambda *a: _split(mesh, *a, **kwargs, strategy=strategy),
                  in_shardings=NamedSharding(mesh, P()))(q, k, v, segments, prefix)
    np.testing.assert_allclose(out, _reference(q, k, v, segments, prefix, **kwargs), atol=1e-5)
    np.testing.assert_array_equal(out[0, 26:], 0.0)  # padding rows


def test_shapes_the_mesh_does_not_divide_are_one_line():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "context": 4, "tensor": 1})
    q = jnp.zeros((B, 10, N, H))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
            pytest.raises(ValueError, match=r"\[2, 10, 4\] over mesh data x fsdp = 2, context"):
        ring.self_attention(q, q[:, :, :K], q[:, :, :K], causal=False)
