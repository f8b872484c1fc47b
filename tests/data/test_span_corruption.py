"""T5 span corruption (`transformer/data/span_corruption.py`) against hand-worked cases."""

import collections
import itertools

import numpy as np
import pytest

from transformer.data import span_corruption
from transformer.data.tokenizer import EOS_ID

SENTINELS = np.array([5, 6, 7, 8], np.int32)


def test_the_docstrings_example():
    tokens = np.arange(10, 20, dtype=np.int32)  # A..J
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 0], bool)  # spans "C D" and "H"
    inputs, targets = span_corruption.corrupt(tokens, mask, SENTINELS)
    np.testing.assert_array_equal(inputs, [10, 11, 5, 14, 15, 16, 6, 18, 19, EOS_ID])
    np.testing.assert_array_equal(targets, [5, 12, 13, 6, 17, EOS_ID])


def test_noise_at_the_end_and_a_span_of_one():
    tokens = np.array([21, 22, 23, 24, 25], np.int32)
    mask = np.array([0, 1, 0, 1, 1], bool)
    inputs, targets = span_corruption.corrupt(tokens, mask, SENTINELS)
    np.testing.assert_array_equal(inputs, [21, 5, 23, 6, EOS_ID])
    np.testing.assert_array_equal(targets, [5, 22, 6, 24, 25, EOS_ID])


def test_inputs_and_targets_rebuild_the_tokens():
    rng = np.random.default_rng(3)
    tokens = rng.integers(100, 200, size=97).astype(np.int32)
    mask = span_corruption.noise_mask(97, rng)
    inputs, targets = span_corruption.corrupt(tokens, mask, np.arange(5, 105))
    spans = {}
    for sentinel_slot in np.flatnonzero(targets[:-1] < 100):
        end = np.flatnonzero(targets[sentinel_slot + 1:] < 100)[0] + sentinel_slot + 1
        spans[targets[sentinel_slot]] = targets[sentinel_slot + 1:end].tolist()
    rebuilt = [t for i in inputs[:-1].tolist() for t in (spans[i] if i < 100 else [i])]
    assert rebuilt == tokens.tolist()


@pytest.mark.parametrize("length", [2, 10, 20, 97, 568])
def test_the_mask_has_the_t5_counts(length):
    rng = np.random.default_rng(length)
    noise, spans = span_corruption.span_counts(length, 0.15, 3.0)
    assert noise == min(max(round(length * 0.15), 1), length - 1)
    for _ in range(20):
        mask = span_corruption.noise_mask(length, rng)
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        assert mask.sum() == noise and starts.sum() == spans


@pytest.mark.parametrize("length, density, span", [(20, 0.15, 3.0), (9, 0.45, 2.0)])
def test_every_mask_with_the_counts_is_equally_likely(length, density, span):
    """All masks of `length` with the noise and span counts, enumerated, each drawn about
    equally often: spans at the start and the end too (T5's kept-first order never has noise
    first; with one span it always cuts the last tokens)."""
    noise, spans = span_corruption.span_counts(length, density, span)
    masks = [m for m in itertools.product([False, True], repeat=length)
             if sum(m) == noise and sum(m[i] and (i == 0 or not m[i - 1])
                                       for i in range(length)) == spans]
    rng = np.random.default_rng(0)
    draws = 200 * len(masks)
    seen = collections.Counter(tuple(span_corruption.noise_mask(
        length, rng, noise_density=density, mean_span_length=span).tolist())
        for _ in range(draws))
    assert set(seen) == set(masks)  # (20: 18 places for one span; 9: 20 masks of 2 spans)
    chi2 = sum((count - 200) ** 2 / 200 for count in seen.values())
    assert chi2 < len(masks) + 5 * (2 * len(masks)) ** 0.5  # mean dof, sd sqrt(2 dof)


def test_span_lengths_average_three_and_vary():
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(300):
        mask = span_corruption.noise_mask(200, rng)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        lengths += (edges[1::2] - edges[::2]).tolist()
    assert np.mean(lengths) == pytest.approx(30 / 10, abs=1e-9)  # 30 noise tokens in 10 spans
    assert min(lengths) == 1 and max(lengths) > 8


def test_raw_length_is_t5s_568_for_512_inputs():
    assert span_corruption.raw_length(512) == 568  # T5's inputs 512 / targets 114 pairing
    for max_length in (16, 64, 128):
        n = span_corruption.raw_length(max_length)
        noise, spans = span_corruption.span_counts(n, 0.15, 3.0)
        assert n - noise + spans + 1 <= max_length
        noise, spans = span_corruption.span_counts(n + 1, 0.15, 3.0)
        assert n + 1 - noise + spans + 1 > max_length


def test_too_few_sentinels_is_one_line():
    mask = np.array([0, 1, 0, 1, 0, 1], bool)
    with pytest.raises(ValueError, match="3 noise spans need 3 sentinels but the vocabulary "
                                         "has 2: raise data.num_sentinels"):
        span_corruption.corrupt(np.arange(6), mask, SENTINELS[:2])


def test_a_vocabulary_reserves_sentinels_after_mask():
    from transformer.data import tokenizer as tokenizer_lib

    sentences = [f"the {w} sat on the mat number {i}" for i in range(200)
                 for w in ("cat", "dog", "bird")]
    tok = tokenizer_lib.train(sentences, 120, seed=0, num_sentinels=3)
    assert tok.mask_id == tokenizer_lib.MASK_ID
    assert tok.sentinel_ids == [5, 6, 7]
    assert [tok.id_to_piece(i) for i in tok.sentinel_ids] == [
        "<extra_id_0>", "<extra_id_1>", "<extra_id_2>"]
    assert tokenizer_lib.train(sentences, 120, seed=0).sentinel_ids == []
