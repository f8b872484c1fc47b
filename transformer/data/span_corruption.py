"""T5's span corruption (Raffel et al. 2020, section 3.1.4): the encoder-decoder's denoising
objective, on numpy ids.

A piece of n tokens gets round(n · noise_density) noise tokens in round(noise / mean_span_length)
spans, drawn uniformly among all masks with those counts: the noise is cut into that many
non-empty runs at random places, the kept tokens into one run more, as many, or one fewer
(the piece starts and ends with kept tokens, starts or ends with noise, or both), each
arrangement weighted by how many masks it holds. T5's and seqio's `random_spans_noise_mask`
always start with kept tokens and end with noise: on pieces of hundreds of tokens that changes
little, but a short piece (one sentence, one span) then always loses its last tokens, and the
task degenerates to guessing how a sentence ends (seqio added `random_roll` for this;
docs/results/2026-12-04-span-corruption-transfer.md measures what it did to fine-tuning here).
The inputs keep the kept tokens and replace span k by sentinel k. The targets list sentinel k
then span k's tokens, for every span. Both end in EOS.

    tokens  [A B C D E F G H I J], noise [. . x x . . . x . .] (spans "C D" and "H"; n = 10)
    inputs  [A B <s0> E F G <s1> I J EOS]      targets [<s0> C D <s1> H EOS]

Sentinels are user-defined SentencePiece symbols right after [MASK] (docs/architecture.md,
special tokens): `tokenizer.train(..., num_sentinels=k)` reserves them and
`Tokenizer.sentinel_ids` lists them. An imported T5's are its `<extra_id_k>`
(`HuggingFaceTokenizer.sentinel_ids`), and both sides then end in its EOS.
"""

from __future__ import annotations

import math

import numpy as np

from transformer.data.tokenizer import EOS_ID

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) for a piece of `length` tokens (length >= 2)."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = max(int(round(noise / mean_span_length)), 1)
    return noise, min(spans, noise, length - noise)


def _random_runs(rng: np.random.Generator, items: int, runs: int) -> np.ndarray:
    """`items` cut into `runs` non-empty runs at uniformly random places: the run lengths."""
    cuts = np.sort(rng.choice(items - 1, size=runs - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [items]]))


def noise_mask(length: int, rng: np.random.Generator, *, noise_density: float = NOISE_DENSITY,
               mean_span_length: float = MEAN_SPAN_LENGTH) -> np.ndarray:
    """[length] bool, True = noise: `span_counts` noise tokens in that many runs, every such
    mask equally likely."""
    noise, spans = span_counts(length, noise_density, mean_span_length)
    kept = length - noise
    # (kept runs, noise first): kept at both ends, kept first, noise first, noise at both ends
    shapes = [(runs, first) for runs, first in ((spans + 1, False), (spans, False),
                                                (spans, True), (spans - 1, True))
              if 1 <= runs <= kept]
    counts = [math.comb(kept - 1, runs - 1) for runs, _ in shapes]  # masks of each shape
    runs, noise_first = shapes[rng.choice(len(shapes), p=[c / sum(counts) for c in counts])]
    first, second = ((_random_runs(rng, noise, spans), _random_runs(rng, kept, runs))
                     if noise_first else (_random_runs(rng, kept, runs),
                                          _random_runs(rng, noise, spans)))
    lengths = [run[i] for i in range(len(first)) for run in (first, second) if i < len(run)]
    return np.repeat([(k % 2 == 0) == noise_first for k in range(len(lengths))], lengths)


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinel_ids: np.ndarray,
            eos_id: int = EOS_ID) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of `tokens` [n] with noise `mask` [n]. Span k becomes sentinel_ids[k].
    Both end in `eos_id` (the vocabulary's: an imported T5's is 1)."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each span
    spans = int(starts.sum())
    if spans > len(sentinel_ids):
        raise ValueError(f"{spans} noise spans need {spans} sentinels but the vocabulary has "
                         f"{len(sentinel_ids)}: raise data.num_sentinels")
    sentinel_ids = np.asarray(sentinel_ids, np.int32)
    span_of = np.maximum(np.cumsum(starts) - 1, 0)  # span index at each position (where noise)
    inputs = np.where(starts, sentinel_ids[span_of], tokens)[~mask | starts]
    noise = np.flatnonzero(mask)
    targets = np.empty(len(noise) + spans, np.int32)
    targets[np.arange(len(noise)) + span_of[noise] + 1] = tokens[noise]  # after spans + 1 sentinels
    targets[np.flatnonzero(starts[noise]) + np.arange(spans)] = sentinel_ids[:spans]
    eos = np.array([eos_id], np.int32)
    return np.concatenate([inputs.astype(np.int32), eos]), np.concatenate([targets, eos])


def corrupted_lengths(length: int, noise_density: float = NOISE_DENSITY,
                      mean_span_length: float = MEAN_SPAN_LENGTH) -> tuple[int, int]:
    """(inputs, targets) tokens of a piece of `length` tokens once corrupted, EOS included:
    the kept tokens and a sentinel a span, then a sentinel a span and the noise."""
    noise, spans = span_counts(length, noise_density, mean_span_length)
    return length - noise + spans + 1, noise + spans + 1


def check_sentinels(tokenizer, length: int, num_sentinels: int) -> None:
    """The vocabulary has a sentinel for each noise span of a piece of `length` tokens, else
    one line."""
    spans = span_counts(length, NOISE_DENSITY, MEAN_SPAN_LENGTH)[1]
    if len(tokenizer.sentinel_ids) < spans:
        raise ValueError(f"data.num_sentinels={num_sentinels}: pieces of {length} tokens have "
                         f"up to {spans} noise spans; set data.num_sentinels >= {spans}")


def raw_length(max_length: int, noise_density: float = NOISE_DENSITY,
               mean_span_length: float = MEAN_SPAN_LENGTH) -> int:
    """The longest piece whose inputs and targets (EOS included) fit in `max_length` tokens."""
    best = 2
    for n in range(2, 8 * max_length):
        noise, spans = span_counts(n, noise_density, mean_span_length)
        if n - noise + spans + 1 <= max_length and noise + spans + 1 <= max_length:
            best = n
        elif n - noise > max_length:
            break
    return best
