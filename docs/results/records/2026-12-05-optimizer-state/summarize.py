"""Each run's figures from its metrics.jsonl (the folders beside this file), as JSON on stdout:
the validation loss at each evaluation, the mean train loss over the last 50 updates, and the
median tokens/s."""

import json
import pathlib
import statistics
import sys


def figures(path: pathlib.Path) -> dict:
    train, validation = {}, {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        (train if record["split"] == "train" else validation)[record["step"]] = record
    last = max(train)
    tail = [r["loss"] for s, r in train.items() if s > last - 50]
    return {
        "validation_loss": {s: round(r["loss"], 4) for s, r in sorted(validation.items())},
        "mean_train_loss_last_50": round(sum(tail) / len(tail), 4),
        "median_tokens_per_sec": round(statistics.median(
            r["tokens_per_sec"] for r in train.values() if "tokens_per_sec" in r)),
    }


def main(folder: str) -> None:
    root = pathlib.Path(folder)
    runs = {p.parent.name: figures(p) for p in sorted(root.glob("*/metrics.jsonl"))}
    json.dump(runs, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
