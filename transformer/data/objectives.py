"""Language-model objectives on numpy ids: documents cut into pieces, and the batch keys of
each objective from packed rows. `language_model.py` packs them.

The objectives, `data.objective`:
- "causal": next-token prediction, decoder-only. Keys `targets`, `targets_segmentation`,
  `targets_positions`.
- "prefix": the same plus `targets_prefix`. The first k tokens of each segment, k uniform in
  1..n-1, form a prefix the model reads in both directions and is not scored on.
- "masked": BERT's masked LM, encoder-only. Of the real tokens, `data.mask_rate` (15%) are
  selected. Of those, 80% become [MASK], 10% a random piece and 10% stay. `inputs` hold the
  result, `targets` the original piece at the selected positions and 0 elsewhere, so the loss
  counts the selected positions alone. Keys `inputs`, `inputs_segmentation`,
  `inputs_positions`, `targets`.
- "span_corruption": T5's denoising objective, encoder-decoder (`span_corruption.py`). The
  documents of a batch are joined into one stream with no separator and cut into pieces of
  `span_corruption.raw_length(max_length)` tokens, as T5's `reduce_concat_tokens` and
  `split_tokens` do, with no EOS: each side gets its own. In each piece 15% of the tokens, in
  spans of mean length 3, are replaced by sentinels in `inputs`, and the spans are listed after
  their sentinels in `targets`. The pairs are packed as translation pairs are, with segment ids
  on both sides. The vocabulary reserves `data.num_sentinels` (default 100) sentinels after
  [MASK]. Keys those of a translation batch.
- "sft" and "dpo": conversations (`chat.py`) and preference pairs (`preference.py`), whose
  sources tokenize and pack them: the causal keys and `targets_loss_mask`, 1 on the
  assistant's tokens or on the responses' (a pair is segments 2k + 1 and 2k + 2 of its row).
"""

from __future__ import annotations

import numpy as np

from transformer.data import tokenizer as tokenizer_lib

MASK_SPLIT = (0.8, 0.1)  # of the selected tokens: [MASK], random piece; the rest stay


def cut_pieces(sequences, length: int, *,
               eos: int | None = tokenizer_lib.EOS_ID) -> list[np.ndarray]:
    """Each id sequence (with `eos` appended unless None), cut into consecutive pieces of at
    most `length`."""
    pieces = []
    for seq in sequences:
        ids = np.asarray(seq, np.int32)
        if eos is not None:
            ids = np.append(ids, np.int32(eos))
        pieces.extend(ids[i:i + length] for i in range(0, len(ids), length))
    return pieces


def apply_objective(packed: dict[str, np.ndarray], objective: str, rngs, *, mask_id: int,
                    vocab_size: int, mask_rate: float) -> dict[str, np.ndarray]:
    """The batch keys of `objective` from packed rows (`targets`, `targets_segmentation`,
    `targets_positions`, [R, L]); `rngs[r]` draws row r's mask or prefixes. BERT's random
    replacements are ids in (mask_id, vocab_size): pass the vocabulary's pieces, not the rows
    of a padded embedding."""
    tokens = packed["targets"]
    segments = packed["targets_segmentation"]
    positions = packed["targets_positions"]
    if objective == "causal":
        return {"targets": tokens, "targets_segmentation": segments,
                "targets_positions": positions}
    if objective == "prefix":
        prefix = np.zeros_like(tokens)
        for r, rng in enumerate(rngs):
            for segment in np.unique(segments[r][segments[r] > 0]).tolist():
                where = segments[r] == segment
                n = int(where.sum())
                k = int(rng.integers(1, n)) if n > 1 else 0
                prefix[r] |= (where & (positions[r] < k)).astype(prefix.dtype)
        return {"targets": tokens, "targets_segmentation": segments,
                "targets_positions": positions, "targets_prefix": prefix}
    inputs = tokens.copy()
    targets = np.zeros_like(tokens)
    first_piece = mask_id + 1
    for r, rng in enumerate(rngs):
        real = segments[r] > 0
        selected = real & (rng.random(tokens.shape[1]) < mask_rate)
        kind = rng.random(tokens.shape[1])
        random_ids = rng.integers(first_piece, vocab_size, tokens.shape[1])
        masked = selected & (kind < MASK_SPLIT[0])
        randomised = selected & (kind >= MASK_SPLIT[0]) & (kind < sum(MASK_SPLIT))
        inputs[r] = np.where(masked, mask_id, np.where(randomised, random_ids, tokens[r]))
        targets[r] = np.where(selected, tokens[r], 0)
    return {"inputs": inputs, "inputs_segmentation": segments, "inputs_positions": positions,
            "targets": targets}
