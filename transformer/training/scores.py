"""Translation metrics: BLEU two ways (metric names: docs/architecture.md) and perplexity.

- `bleu`: sacreBLEU's corpus BLEU on detokenized, cased text (default `13a` tokenizer and
  `exp` smoothing), reported with its signature: the primary figure.
- `bleu_tok_compound`: the paper's flavour, as tensor2tensor's `get_ende_bleu.sh` computes it:
  Moses `replace-unicode-punctuation.perl` and `tokenizer.perl -l <lang>` (sacremoses ports),
  hyphenated compounds split as `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`, then `multi-bleu.perl`
  (cased, tokenized). The preprocessing runs on hypotheses and references alike. The score is
  sacreBLEU with `tokenize='none'` and `smooth_method='none'`, which is multi-bleu.perl's formula
  (0 when some n-gram order has no match). The Moses XML escaping of `tokenizer.perl` is left
  out: it maps tokens one to one, so it cannot change the score.

sacrebleu and sacremoses belong to the `data` extra and are imported when a score is computed.
"""

from __future__ import annotations

import functools
import math
import re

_COMPOUND = re.compile(r"(\S)-(\S)")


def bleu(hypotheses: list[str], references: list[str], *, target_lang: str = "de") -> dict:
    """Both BLEUs of `hypotheses` against one reference each (detokenized, cased text).

    Returns `{"bleu", "bleu_signature", "bleu_tok_compound", "bleu_num_sentences"}`.
    """
    from sacrebleu.metrics import BLEU

    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(f"BLEU needs one reference per hypothesis: got {len(hypotheses)} "
                         f"hypotheses and {len(references)} references")
    if not hypotheses:
        raise ValueError("BLEU of no sentences: give at least one hypothesis and reference")
    detok = BLEU()
    score = detok.corpus_score(hypotheses, [references]).score
    paper = BLEU(tokenize="none", smooth_method="none", force=True)  # tokenized on purpose
    tok_hyps = [tokenize_compound_split(h, target_lang) for h in hypotheses]
    tok_refs = [tokenize_compound_split(r, target_lang) for r in references]
    return {"bleu": float(score), "bleu_signature": str(detok.get_signature()),
            "bleu_tok_compound": float(paper.corpus_score(tok_hyps, [tok_refs]).score),
            "bleu_num_sentences": len(hypotheses)}


def tokenize_compound_split(text: str, lang: str = "de") -> str:
    """One line as `get_ende_bleu.sh` feeds it to multi-bleu.perl: Moses-normalized unicode
    punctuation, Moses-tokenized (`-l lang`, no aggressive dash splits), compounds split."""
    normalizer, tokenizer = _moses(lang)
    tokens = tokenizer.tokenize(normalizer.replace_unicode_punct(text), return_str=True,
                                escape=False)
    return split_compounds(tokens)


def split_compounds(tokenized: str) -> str:
    """`rich-text` -> `rich ##AT##-##AT## text`, with Perl's `s{(\\S)-(\\S)}{...}g` semantics
    (non-overlapping, left to right)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


@functools.cache
def _moses(lang: str):
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def perplexity(nll_per_token: float) -> float:
    """exp(NLL per target token), capped at exp(700) so that it stays a finite float."""
    return float(math.exp(min(float(nll_per_token), 700.0)))
