"""`python -m transformer.check` (`checkpoint.layout.check`): a workdir that keeps the contract
passes, and each way of breaking it is named on its own line."""

import json
import subprocess
import sys

from transformer.checkpoint import layout

TRAIN = {"step": 1, "split": "train", "loss": 9.1, "learning_rate": 1e-4, "grad_norm": 2.0,
         "tokens_per_sec": 900.0, "data_wait_fraction": 0.01}
VALIDATION = {"step": 1, "split": "validation", "loss": 8.0, "perplexity": 2981.0, "bleu": 0.4,
              "bleu_signature": "nrefs:1", "bleu_tok_compound": 0.5, "bleu_num_sentences": 2}
CONFIG = {"model": {}, "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "seed": 0,
          "num_train_steps": 1, "checkpoint_every_steps": 1, "provenance": {}}


def write_run(path, config=CONFIG, lines=(TRAIN, VALIDATION), checkpoints=("1",)):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for name in checkpoints:
        (path / "checkpoints" / name).mkdir(parents=True)
    return str(path)


def test_a_workdir_that_keeps_the_contract_passes(tmp_path):
    run = write_run(tmp_path / "run", checkpoints=("1", "2.orbax-checkpoint-tmp-5"))
    assert layout.check(run) == []
    result = subprocess.run([sys.executable, "-m", "transformer.check", run],
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, f"{run}: 0 problem(s)\n")


def test_each_breach_is_one_line(tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "seed"} | {"mesh": {"data": 1}}
    lines = [TRAIN | {"step": 0}, {k: v for k, v in TRAIN.items() if k != "grad_norm"},
             VALIDATION | {"split": "dev"}, {k: v for k, v in VALIDATION.items()
                                             if k not in ("perplexity", "bleu_signature")}]
    run = write_run(tmp_path / "run", config, lines, checkpoints=("3", "latest"))
    assert layout.check(run) == [
        "config.json lacks the keys ['seed']",
        "config.json's mesh lacks the axes ['fsdp', 'tensor']",
        "metrics.jsonl:1: step 0 is not an int >= 1",
        "metrics.jsonl:2: the train line lacks ['grad_norm']",
        "metrics.jsonl:3: split 'dev' is not one of ['train', 'validation', 'test']",
        "metrics.jsonl:4: an eval loss without perplexity",
        "metrics.jsonl:4: bleu without ['bleu_signature']",
        "checkpoints/ holds entries that are not steps: ['latest']",
    ]
    result = subprocess.run([sys.executable, "-m", "transformer.check", run],
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout.endswith(f"{run}: 8 problem(s)\n")


def test_missing_files_and_a_damaged_line(tmp_path):
    assert layout.check(str(tmp_path)) == ["config.json is missing", "metrics.jsonl is missing"]
    run = write_run(tmp_path / "run")
    with open(f"{run}/metrics.jsonl", "a") as f:
        f.write('{"step": 2, "spl')
    assert layout.check(run) == ["metrics.jsonl:3 is not a JSON object"]
