"""Global tokens beside a sliding window (Longformer, BigBird): the first `global_tokens`
positions of a row attend to and from every position. The mask by hand; the chunked kernel,
which still skips the key blocks nobody needs, against numpy's dense formula with the same mask
(values and gradients); the blocks it visits; `model.attention_global_tokens` in a decoder.
(Training and decoding with a ring buffer plus the held global tokens: the "global tokens"
pattern of `test_attention_patterns.py`.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import np_causal, np_segment, qkv, reference_attention
from test_attention_patterns import LM, _scan_lengths, np_window

from transformer.model.transformer import Transformer
from transformer.ops import attention, chunked, masks

pytestmark = pytest.mark.usefixtures("strict_dtype_promotion")


def np_global(t, s, global_tokens):
    """[1, 1, T, S]: queries and keys before position `global_tokens` see / are seen by all."""
    return ((np.arange(t)[:, None] < global_tokens)
            | (np.arange(s)[None, :] < global_tokens))[None, None]


def test_make_local_mask_with_global_tokens_by_hand():
    mask = masks.make_local_mask(jnp.arange(6), jnp.arange(6), (1, 0), global_tokens=2)
    expected = [[1, 1, 1, 1, 1, 1],
                [1, 1, 1, 1, 1, 1],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 0, 1, 1, 0],
                [1, 1, 0, 0, 1, 1]]
    np.testing.assert_array_equal(mask[0, 0], np.asarray(expected, bool))


CASES = [  # window, global tokens, key chunk, extra mask
    ((3, 0), 5, 4, "causal"),
    ((2, 3), 2, 3, "segments"),
    ((1, 1), 9, 4, None),  # global rows span several query blocks
    ((4, 0), 30, 4, "causal"),  # every position global: dense causal
]


@pytest.mark.parametrize("window,global_tokens,chunk,extra", CASES)
def test_global_tokens_match_the_dense_formula_values_and_gradients(window, global_tokens,
                                                                     chunk, extra):
    t = 21
    q, k, v = qkv(4, b=2, t=t, s=t, n=4, kh=2)
    mask = None
    if extra == "causal":
        mask = np_causal(t)
    elif extra == "segments":
        segments = np.array([[1] * 12 + [2] * 7 + [0] * 2, [1] * 21], np.int32)
        mask = np_segment(segments, segments)
    dense = np_window(t, t, *window) | np_global(t, t, global_tokens)
    dense = dense if mask is None else dense & mask
    weights = jnp.asarray(np.random.default_rng(5).normal(size=(2, t, 4, 8)), jnp.float32)

    def run(implementation, pattern, local_window_size=None, tokens=0):
        def f(q, k, v):
            out = attention.dot_product_attention(
                q, k, v, mask=pattern, implementation=implementation, key_chunk_size=chunk,
                local_window_size=local_window_size, global_tokens=tokens)
            return (out * weights).sum(), out
        return jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    expected_grads, expected = run("xla", jnp.asarray(dense))  # the pattern as a dense mask
    np.testing.assert_allclose(expected, reference_attention(q, k, v, mask=dense), atol=2e-5)
    pattern = None if mask is None else jnp.asarray(mask)
    for implementation in ("chunked", "xla"):
        grads, out = run(implementation, pattern, window, global_tokens)
        np.testing.assert_allclose(out, expected, atol=2e-5, err_msg=implementation)
        for g, e in zip(grads, expected_grads, strict=True):
            np.testing.assert_allclose(g, e, atol=2e-5, err_msg=implementation)


def test_blocks_holding_global_tokens_are_visited_by_every_query_block():
    """A causal window of 256 and 64 global tokens over 8192 positions in blocks of 512: each
    query block visits key block 0 (the global keys), the previous block and its own: 3 steps
    instead of 16; the 64 global query rows visit all 16 in a pass of their own."""
    plan = chunked.BlockPlan.make(8192, 8192, 512, (256, 0), global_tokens=64)
    assert (plan.num_q_blocks, plan.visits, plan.banded) == (16, 3, True)
    assert plan.table[:3] == ((0, 0, 0), (0, 1, 1), (0, 1, 2))
    assert plan.valid[:3] == ((True, False, False), (True, True, False), (True, True, True))
    assert plan.table[15] == (0, 14, 15)
    # Global tokens in two blocks add both.
    assert chunked.BlockPlan.make(8192, 8192, 512, (256, 0), global_tokens=600).visits == 4
    x = jax.ShapeDtypeStruct((1, 8192, 2, 16), jnp.float32)

    def f(q, k, v):
        return attention.dot_product_attention(q, k, v, implementation="chunked",
                                               local_window_size=(256, 0),
                                               global_tokens=64).sum()

    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, x, x).jaxpr
    assert sorted(_scan_lengths(jaxpr)) == [3, 3, 16, 16]  # forward, backward; banded, global


def test_bad_global_tokens_are_one_line():
    q, k, v = qkv(0, t=6, s=6)
    with pytest.raises(ValueError, match="global_tokens=2 must be >= 0 and widens a local "
                                         "window: set local_window_size"):
        attention.dot_product_attention(q, k, v, global_tokens=2)
    with pytest.raises(ValueError, match="'cudnn' has no global tokens"):
        attention.dot_product_attention(q, k, v, implementation="cudnn",
                                        local_window_size=(2, 0), global_tokens=1)
    for fields in (dict(attention_global_tokens=2),
                   dict(attention_window=4, attention_pattern="local",
                        attention_global_tokens=-1)):
        with pytest.raises(ValueError, match="model.attention_global_tokens=-?[12] must be "
                                             ">= 0 and widens local windows") as error:
            dataclasses.replace(LM, **fields)
        assert "\n" not in str(error.value)


def test_a_global_token_reaches_every_later_position_of_a_local_decoder():
    """One local layer of window 2: the last position's logits depend on the first target
    (decoder input 1, after BOS) only when the first 2 positions are global, and the chunked
    and xla paths agree on them."""
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 6, 7, 8, 9]] * 2, np.int32)
    tokens[1, 0] = 16  # row 1: the first target changed
    change = {}
    for global_tokens in (0, 2):
        cfg = dataclasses.replace(LM, num_decoder_layers=1, attention_window=2,
                                  attention_pattern="local",
                                  attention_global_tokens=global_tokens)
        with jax.numpy_dtype_promotion("standard"):
            params = Transformer(cfg).init(jax.random.key(0), None, tokens[:1])["params"]
            last = Transformer(cfg).apply({"params": params}, None, tokens)[:, -1]
            if global_tokens:
                xla = Transformer(dataclasses.replace(cfg, attention_implementation="xla"))
                np.testing.assert_allclose(xla.apply({"params": params}, None, tokens)[:, -1],
                                           last, atol=1e-5)
        change[global_tokens] = float(jnp.abs(last[0] - last[1]).max())
    assert change[0] == 0.0 and change[2] > 1e-3, change
