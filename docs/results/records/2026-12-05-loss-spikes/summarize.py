"""Each run's figures from its metrics.jsonl (the folders beside this file), as JSON on stdout:
the validation losses, the updates skipped, and the train loss and gradient norm at and around
the spiked updates."""

import json
import pathlib
import sys

SPIKES = (100, 150, 200, 250, 300)


def figures(path: pathlib.Path) -> dict:
    train, validation = {}, {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        (train if record["split"] == "train" else validation)[record["step"]] = record
    skipped = [s for s, r in sorted(train.items()) if r.get("spike_skipped")]
    return {
        "validation_loss": {s: round(r["loss"], 4) for s, r in sorted(validation.items())},
        "skipped_steps": skipped,
        "spiked": {s: {"loss": round(train[s]["loss"], 2),
                       "grad_norm": round(train[s]["grad_norm"], 2),
                       "loss_before": round(train[s - 1]["loss"], 4),
                       "loss_after": round(train[s + 1]["loss"], 4)} for s in SPIKES},
        "mean_train_loss_last_50": round(sum(train[s]["loss"] for s in range(351, 401)) / 50, 4),
    }


def main(folder: str) -> None:
    root = pathlib.Path(folder)
    runs = {p.parent.name: figures(p) for p in sorted(root.glob("*/metrics.jsonl"))}
    json.dump(runs, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
