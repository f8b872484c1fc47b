"""Baselines for the text classification task `offline_help_topics` (or any TFDS dataset with a
text and a label feature), on the same splits the fine-tuned Transformer is scored on:

    pip install -e '.[baselines]'   # scikit-learn
    python benchmarks/help_topics_baselines.py [--dataset=offline_help_topics] [--data_dir=...]

- majority class: always the training split's most frequent label;
- stratified: labels drawn at random by the training split's label frequencies (seeded);
- bag of words: logistic regression (multinomial, L2) on TF-IDF-weighted word unigrams and
  bigrams, its regularisation C chosen on the validation split from `C_GRID`.

Prints the validation and test accuracy of each, one line a baseline, and the split sizes. The
dataset is built (offline_help_topics) or read as the training source does
(`transformer.data.text_classification`). Nothing is downloaded.
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.data import text_classification  # noqa: E402

C_GRID = (1.0, 10.0, 100.0)


def load_splits(dataset: str, data_dir: str | None, text_feature: str,
                label_feature: str) -> dict[str, tuple[list[str], np.ndarray]]:
    """{"train", "validation", "test"} (those the dataset has): (texts, labels)."""
    builder = text_classification.open_builder(dataset, data_dir, None)
    return {split: text_classification.read_split(builder, split, text_feature, label_feature)
            for split in ("train", "validation", "test") if split in builder.info.splits}


def baselines(splits, seed: int = 0) -> dict[str, dict[str, float]]:
    """{baseline: {split: accuracy}} for the non-train splits (module docstring)."""
    from sklearn.dummy import DummyClassifier
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    texts, labels = splits["train"]
    scored = [s for s in ("validation", "test") if s in splits]
    results = {}
    for name, strategy in (("majority class", "most_frequent"), ("stratified", "stratified")):
        dummy = DummyClassifier(strategy=strategy, random_state=seed).fit(texts, labels)
        results[name] = {s: float(dummy.score(*splits[s])) for s in scored}
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    features = vectorizer.fit_transform(texts)
    chosen = None
    best = -1.0
    select = "validation" if "validation" in splits else scored[0]
    for c in C_GRID:
        model = LogisticRegression(C=c, max_iter=2000).fit(features, labels)
        accuracy = model.score(vectorizer.transform(splits[select][0]), splits[select][1])
        if accuracy > best:
            chosen = model
            best = accuracy
    results[f"bag of words (C={chosen.C:g})"] = {
        s: float(chosen.score(vectorizer.transform(splits[s][0]), splits[s][1]))
        for s in scored}
    return results


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_string("dataset", "offline_help_topics", "The TFDS text classification "
                        "dataset.")
    flags.DEFINE_string("data_dir", None, "TFDS data_dir (default: TFDS's).")
    flags.DEFINE_string("text_feature", "text", "The feature holding the text.")
    flags.DEFINE_string("label_feature", "label", "The feature holding the label.")
    flags.DEFINE_integer("seed", 0, "Seed of the baselines' randomness.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    try:
        import sklearn  # noqa: F401
    except ImportError:
        sys.exit("scikit-learn is missing: pip install -e '.[baselines]'")
    started = time.perf_counter()
    splits = load_splits(args.dataset, args.data_dir, args.text_feature, args.label_feature)
    print(f"{args.dataset}: " + ", ".join(f"{s} {len(labels)}"
                                          for s, (_, labels) in splits.items()))
    for name, accuracy in baselines(splits, args.seed).items():
        print(f"{name:28s} " + "  ".join(f"{s} accuracy {a:.4f}" for s, a in accuracy.items()))
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
