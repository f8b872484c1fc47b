"""transformer.ops.relative_position: T5's buckets against T5's formula written in numpy (float64
and float32), hand-worked cases, and transformers' own `_relative_position_bucket`; the bias
against a table looked up by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from transformer.ops.relative_position import relative_position_bias, relative_position_bucket

pytestmark = pytest.mark.usefixtures("strict_dtype_promotion")
CASES = [(32, 128), (16, 20), (8, 10), (32, 33)]  # (num_buckets, max_distance)
RELATIVE = np.arange(-300, 301)


def numpy_bucket(relative, bidirectional, num_buckets, max_distance, dtype):
    """T5's formula (Raffel et al.; mesh-tensorflow's transformer_layers.py) in numpy."""
    out = np.zeros_like(relative)
    n = relative.copy()
    if bidirectional:
        num_buckets //= 2
        out += (n > 0) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(-n, 0)
    max_exact = num_buckets // 2
    far = np.maximum(n, max_exact).astype(dtype)  # the small distances are not read
    large = max_exact + (np.log(far / dtype(max_exact)) / dtype(math.log(max_distance / max_exact))
                         * dtype(num_buckets - max_exact)).astype(np.int64)
    return out + np.where(n < max_exact, n, np.minimum(large, num_buckets - 1))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", CASES)
def test_buckets_are_t5s_formula(bidirectional, num_buckets, max_distance):
    ours = np.asarray(relative_position_bucket(
        RELATIVE, bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance))
    for dtype in (np.float64, np.float32):
        np.testing.assert_array_equal(ours, numpy_bucket(RELATIVE, bidirectional, num_buckets,
                                                         max_distance, dtype))
    assert ours.min() == 0 and ours.max() == num_buckets - 1


def test_buckets_by_hand():
    """32 buckets, max distance 128: bidirectional gives 16 a side, 8 exact; unidirectional 32,
    16 exact, then 16 + floor(ln(d/16) / ln(8) * 16): 20 -> 17, 100 -> 30, 127 -> 31."""
    def bucket(rel, bidirectional):
        return relative_position_bucket(jnp.array(rel), bidirectional=bidirectional,
                                        num_buckets=32, max_distance=128).tolist()

    assert bucket([0, -1, 1, -7, 7, -500, 500], True) == [0, 1, 17, 7, 23, 15, 31]
    assert bucket([3, 0, -5, -15, -16, -20, -100, -127, -128, -10**6], False) == [
        0, 0, 5, 15, 16, 17, 30, 31, 31, 31]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", CASES)
def test_buckets_are_transformers(bidirectional, num_buckets, max_distance):
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    theirs = t5.T5Attention._relative_position_bucket(
        torch.tensor(RELATIVE), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance).numpy()
    np.testing.assert_array_equal(np.asarray(relative_position_bucket(
        RELATIVE, bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance)), theirs)


def test_bias_reads_the_table_at_each_pairs_bucket():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(16, 3)).astype(np.float32)
    q_positions = np.array([[0, 1, 2, 3], [5, 6, 0, 1]])
    k_positions = np.array([[0, 1, 2, 3, 4, 9]])
    bias = np.asarray(relative_position_bias(jnp.asarray(table), jnp.asarray(q_positions),
                                             jnp.asarray(k_positions), bidirectional=False,
                                             max_distance=20))
    assert bias.shape == (2, 3, 4, 6) and bias.dtype == np.float32
    for b in range(2):
        for t in range(4):
            for s in range(6):
                rel = np.array([k_positions[0, s] - q_positions[b, t]])
                expected = table[numpy_bucket(rel, False, 16, 20, np.float64)[0]]
                np.testing.assert_array_equal(bias[b, :, t, s], expected)
