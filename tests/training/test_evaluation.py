"""BLEU both ways against sacreBLEU's own API on the same files, against the formula of
Papineni et al. (2002) counted out here, on a case worked by hand, and perplexity."""

import collections
import math
import re

import numpy as np
import pytest
import sacrebleu

from transformer.training import scores, train_state

# Detokenized German: hyphenated compounds, quotes, abbreviations, numbers, casing.
REFERENCES = [
    "Die EU-Kommission hat am Dienstag einen neuen Vorschlag vorgelegt.",
    "„Wir müssen jetzt handeln“, sagte Bundeskanzlerin Merkel in Berlin.",
    "Der Rhein-Main-Flughafen ist einer der größten Flughäfen Europas.",
    "Die Zahl der Arbeitslosen sank im Oktober auf 2,8 Millionen.",
    "Nach Angaben der Polizei wurden drei Menschen leicht verletzt.",
    "Das 20-jährige Talent wechselt für 15 Mio. Euro zum FC Bayern.",
    "Die E-Mail-Adresse des Vereins lautet info@example.de.",
    "Dr. Müller erklärte, die Ergebnisse seien noch nicht endgültig.",
    "Viele Bürger-Initiativen fordern mehr Mitsprache bei Bau-Projekten.",
    "Im Nord-Süd-Vergleich liegen die Löhne im Süden deutlich höher.",
    "Der Zug kam mit 40 Minuten Verspätung in Köln an.",
    "Sie hat das Buch gelesen, aber es hat ihr nicht gefallen.",
]
HYPOTHESES = [
    "Die EU-Kommission legte am Dienstag einen neuen Vorschlag vor.",
    "„Wir müssen jetzt handeln“, sagte Kanzlerin Merkel in Berlin.",
    "Der Rhein-Main-Flughafen ist einer der größten Flughäfen in Europa.",
    "Die Zahl der Arbeitslosen fiel im Oktober auf 2,8 Millionen.",
    "Laut Polizei wurden drei Personen leicht verletzt.",
    "Das 20-jährige Talent wechselt für 15 Millionen Euro zu Bayern.",
    "Die E-Mail-Adresse des Clubs ist info@example.de.",
    "Dr. Müller sagte, die Ergebnisse seien noch nicht endgültig.",
    "Viele Bürgerinitiativen verlangen mehr Mitsprache bei Bau-Projekten.",
    "Im Nord-Süd-Vergleich sind die Löhne im Süden deutlich höher.",
    "Der Zug kam mit 40 Minuten Verspätung in Köln an.",
    "sie hat das Buch gelesen, aber es gefiel ihr nicht.",
]


@pytest.fixture
def files(tmp_path):
    """The sentences written to and read back from files, one a line, as evaluate writes them."""
    paths = {}
    for name, lines in (("hyp.de", HYPOTHESES), ("ref.de", REFERENCES)):
        paths[name] = tmp_path / name
        paths[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    read = {name: path.read_text(encoding="utf-8").splitlines() for name, path in paths.items()}
    return read["hyp.de"], read["ref.de"]


def moses_split(line):
    """The get_ende_bleu.sh preprocessing, spelled out with sacremoses and the Perl regex."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    text = MosesPunctNormalizer(lang="de").replace_unicode_punct(line)
    text = MosesTokenizer(lang="de").tokenize(text, return_str=True, escape=False)
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", text)


def test_both_bleus_match_sacrebleu_on_the_same_files(files):
    hyps, refs = files
    result = scores.bleu(hyps, refs)
    assert set(result) == {"bleu", "bleu_signature", "bleu_tok_compound", "bleu_num_sentences"}
    assert result["bleu_num_sentences"] == 12

    expected = sacrebleu.corpus_bleu(hyps, [refs])
    assert result["bleu"] == pytest.approx(expected.score, abs=1e-9)
    metric = sacrebleu.BLEU()
    assert metric.corpus_score(hyps, [refs]).score == pytest.approx(expected.score, abs=1e-9)
    signature = str(metric.get_signature())
    assert result["bleu_signature"] == signature
    assert signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")

    tok_hyps = [moses_split(h) for h in hyps]
    tok_refs = [moses_split(r) for r in refs]
    paper = sacrebleu.corpus_bleu(tok_hyps, [tok_refs], tokenize="none", smooth_method="none")
    assert result["bleu_tok_compound"] == pytest.approx(paper.score, abs=1e-9)
    # With 4-gram matches in the corpus, multi-bleu.perl's unsmoothed formula equals the default.
    default = sacrebleu.corpus_bleu(tok_hyps, [tok_refs], tokenize="none")
    assert result["bleu_tok_compound"] == pytest.approx(default.score, abs=1e-9)
    # Sanity: a realistic range, and the two flavours differ on this text.
    assert 20 < result["bleu"] < 80 and 20 < result["bleu_tok_compound"] < 80
    assert result["bleu"] != pytest.approx(result["bleu_tok_compound"], abs=0.01)


def test_a_case_worked_by_hand():
    """Reference "the cat sat on the mat", hypothesis "the cat sat on a mat": clipped n-gram
    precisions 5/6, 3/5, 2/4, 1/3, equal lengths (no brevity penalty): BLEU = (1/12)^(1/4)."""
    result = scores.bleu(["the cat sat on a mat"], ["the cat sat on the mat"])
    assert result["bleu"] == pytest.approx(100 * (1 / 12) ** 0.25, abs=1e-9)  # 53.728
    assert result["bleu_tok_compound"] == pytest.approx(100 * (1 / 12) ** 0.25, abs=1e-9)


def _corpus_bleu_by_the_formula(hypotheses, references):
    """BLEU of whitespace-tokenized sentences as the paper defines it: corpus-level clipped
    n-gram precisions p_1..p_4, their geometric mean, times exp(1 - r / c) where c < r."""
    matches = np.zeros(4)
    totals = np.zeros(4)
    for hyp, ref in zip(hypotheses, references, strict=True):
        h = hyp.split()
        r = ref.split()
        for n in range(1, 5):
            hyp_grams = collections.Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            ref_grams = collections.Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(k, ref_grams[g]) for g, k in hyp_grams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    c = sum(len(h.split()) for h in hypotheses)
    r = sum(len(x.split()) for x in references)
    brevity = 1.0 if c >= r else math.exp(1 - r / c)
    return 100 * brevity * math.exp(np.mean(np.log(matches / totals)))


def test_tokenized_bleu_equals_the_formula_counted_out(files):
    hyps, refs = files
    split = [scores.tokenize_compound_split(x) for x in hyps]
    ref_split = [scores.tokenize_compound_split(x) for x in refs]
    want = _corpus_bleu_by_the_formula(split, ref_split)
    assert scores.bleu(hyps, refs)["bleu_tok_compound"] == pytest.approx(want, abs=1e-9)
    shorter = [" ".join(h.split()[:-2]) for h in hyps]  # brevity penalty in play
    want = _corpus_bleu_by_the_formula([scores.tokenize_compound_split(x) for x in shorter],
                                       ref_split)
    assert scores.bleu(shorter, refs)["bleu_tok_compound"] == pytest.approx(want, abs=1e-9)


def test_preprocessing_spelled_out():
    line = "„Das ist gut“, sagte Dr. Müller über die EU-Kommission (Rhein-Main-Gebiet)."
    assert scores.tokenize_compound_split(line) == (
        '„ Das ist gut " , sagte Dr. Müller über die EU ##AT##-##AT## Kommission '
        "( Rhein ##AT##-##AT## Main ##AT##-##AT## Gebiet ) .")
    # Perl's s{(\S)-(\S)}{...}g does not overlap matches: single letters keep their second hyphen.
    assert scores.split_compounds("a-b-c x - y") == "a ##AT##-##AT## b-c x - y"


def test_compound_splitting_on_both_sides():
    hyps = ["Die EU-Behörde hat den Rhein-Main-Flughafen am Montag besucht."]
    refs = ["Die EU-Kommission hat den Rhein-Main-Flughafen am Montag besucht."]
    split_hyp = ("Die EU ##AT##-##AT## Behörde hat den Rhein ##AT##-##AT## Main ##AT##-##AT## "
                 "Flughafen am Montag besucht .")
    split_ref = ("Die EU ##AT##-##AT## Kommission hat den Rhein ##AT##-##AT## Main "
                 "##AT##-##AT## Flughafen am Montag besucht .")
    result = scores.bleu(hyps, refs)
    expected = sacrebleu.corpus_bleu([split_hyp], [[split_ref]], tokenize="none")
    assert result["bleu_tok_compound"] == pytest.approx(expected.score, abs=1e-9)
    # The split changes the score: unsplit, "EU-Behörde" and "EU-Kommission" share nothing.
    unsplit = sacrebleu.corpus_bleu(
        ["Die EU-Behörde hat den Rhein-Main-Flughafen am Montag besucht ."],
        [["Die EU-Kommission hat den Rhein-Main-Flughafen am Montag besucht ."]],
        tokenize="none")
    assert result["bleu_tok_compound"] > unsplit.score + 1


def test_identical_hypotheses_score_100(files):
    _, refs = files
    result = scores.bleu(refs, refs)
    assert result["bleu"] == pytest.approx(100.0)
    assert result["bleu_tok_compound"] == pytest.approx(100.0)


def test_no_four_gram_match_is_zero_like_multi_bleu():
    result = scores.bleu(["Das Haus ist sehr groß."], ["Das Haus ist nicht groß."])
    assert result["bleu_tok_compound"] == 0.0  # multi-bleu.perl: no smoothing
    assert result["bleu"] > 0.0  # sacreBLEU's exp smoothing


def test_target_lang_is_passed_to_moses():
    # French Moses rules split the elision "l'" from the word; German ones split the apostrophe.
    assert scores.tokenize_compound_split("l'homme", "fr") == "l' homme"
    assert scores.tokenize_compound_split("l'homme", "de") == "l ' homme"


@pytest.mark.parametrize("hyps, refs, message", [
    (["a", "b", "c"], ["a", "b"], "got 3 hypotheses and 2 references"),
    ([], [], "no sentences"),
])
def test_bad_input(hyps, refs, message):
    with pytest.raises(ValueError, match=message):
        scores.bleu(hyps, refs)


def test_perplexity():
    assert scores.perplexity(0.0) == 1.0
    assert scores.perplexity(math.log(4.92)) == pytest.approx(4.92)
    assert math.isfinite(scores.perplexity(1e6))
    for loss in (0.5, 1.59, 1e6):
        assert scores.perplexity(loss) == train_state.eval_metrics(
            {"nll_sum": loss, "tokens": 1.0})["perplexity"]
