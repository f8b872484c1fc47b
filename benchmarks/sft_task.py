"""Supervised fine-tuning and LoRA on an instruction set built offline (issue 60's measured items).

The task: which LibreOffice module's help holds a paragraph (Writer, Calc, Impress, Draw, Base,
Math, Chart or Basic), asked as a conversation. `build` writes it from the offline help
paragraphs (`transformer.data.offline.help_paragraphs`, the splits of TFDS
`offline_help_topics`: a stable hash of the English text, a paragraph and its German translation
in the same split), one conversation per example, English and German:

    {"messages": [{"role": "user", "content": "<INSTRUCTION> <paragraph>"},
                  {"role": "assistant", "content": "Calc"}]}

The held-out files are written in a seeded order (a run evaluates the first
`data.eval_documents`). `build` also writes the chat template (`TEMPLATE`, plain text: the
SentencePiece vocabulary has no turn markers, and it reads newlines as spaces) into the
pretrained run's `vocab/tokenizer_config.json`, two lm-eval multiple-choice tasks over a seeded
sample of the validation and test splits (the prompt rendered with the template and its
generation prompt, the 8 answers as the template renders them: the text the fine-tuning learns;
metric `acc`), and preference pairs (chosen: the module; rejected: another, seeded) for DPO.

    python benchmarks/sft_task.py build --pretrained=runs/sft_task/pretrain \
        --out=runs/sft_task/data
    python benchmarks/sft_task.py sweep --pretrained=runs/sft_task/pretrain \
        --data=runs/sft_task/data --runs=runs/sft_task \
        --record=docs/results/records/2026-12-05-sft-lora
    python benchmarks/sft_task.py dpo --pretrained=runs/sft_task/pretrain \
        --data=runs/sft_task/data --runs=runs/sft_task \
        --record=docs/results/records/2026-12-05-sft-lora --lr=1e-4

`sweep` fine-tunes from the pretrained run (`configs/finetune.py`) with `data.objective=sft`,
the whole model and LoRA (rank 8 on query, key, value, out) at each learning rate
(`--full_lrs`, `--lora_lrs`), one run at a time under `/usr/bin/time` (peak RSS); scores every
run and the pretrained model on the validation task, picks each method's rate there, and
scores the test task once for the pretrained model and the two picks. Runs and scores already
done are kept (rerunning resumes). It writes `results.json` (scores, step times, peak RSS, the
parameters trained and the optimizer state's bytes), each run's metrics.jsonl and config.json,
and a plot of validation loss to `--record`. `dpo` trains DPO from the pretrained run (its
frozen reference) and writes `dpo.json`: the run's eval lines on validation pairs and trl's
margin on a seeded sample of test pairs, scored once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

INSTRUCTION = "Which LibreOffice module is this help text from?"
TEMPLATE = ("{% for message in messages %}"
            "{% if message['role'] == 'user' %}User: {{ message['content'] }}\n"
            "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}.\n"
            "{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")
SEED = 0
LORA = dict(lora_rank=8, lora_alpha=16.0, lora_targets="query,key,value,out")


def conversation(text: str, label: str) -> list[dict]:
    return [{"role": "user", "content": f"{INSTRUCTION} {text}"},
            {"role": "assistant", "content": label}]


def _write_jsonl(path: pathlib.Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _task_yaml(name: str, docs: pathlib.Path) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {docs}\ntest_split: test\noutput_type: multiple_choice\n"
            f"target_delimiter: ''\ndoc_to_text: '{{{{prompt}}}}'\ndoc_to_choice: choices\n"
            f"doc_to_target: label\nmetric_list:\n  - metric: acc\n")


def build(args) -> None:
    from transformer.data import chat
    from transformer.data.offline import help_paragraphs

    root = os.path.expanduser(args.root)
    if not os.path.isdir(os.path.join(root, "usr")):
        sys.exit(f"error: --root={args.root} holds no unpacked help packages (usr/); build "
                 f"offline_de_en first (python train.py --config=configs/lm_default.py ...)")
    out = pathlib.Path(args.out)
    labels = help_paragraphs.LABELS
    splits = help_paragraphs.split_examples(help_paragraphs.labelled_pairs(root))

    def shuffled(split: str, preference: bool = False) -> list[dict]:
        """A split in a seeded order: the held-out files are read from their start
        (`data.eval_documents`), and the splits come grouped by module. (The training loader
        shuffles train itself; its chat file keeps the splits' order.)"""
        examples = splits[split]
        if split == "train" and not preference:
            return examples
        return [examples[i] for i in np.random.default_rng(SEED).permutation(len(examples))]
    template = {"chat_template": TEMPLATE}
    rng = np.random.default_rng(SEED)
    for split in splits:
        _write_jsonl(out / f"{split}.jsonl", (
            {"messages": conversation(e["text"], labels[e["label"]])} for e in shuffled(split)))
        pairs = []
        for e in shuffled(split, preference=True):
            wrong = [k for k in range(len(labels)) if k != e["label"]][rng.integers(7)]
            pairs.append({"prompt": conversation(e["text"], "")[:1],
                          "chosen": [{"role": "assistant", "content": labels[e["label"]]}],
                          "rejected": [{"role": "assistant", "content": labels[wrong]}]})
        _write_jsonl(out / "preference" / f"{split}.jsonl", pairs)
    sizes = {"validation": args.validation_docs, "test": args.test_docs}
    for split, size in sizes.items():
        examples = splits[split]
        order = np.random.default_rng(SEED).permutation(len(examples))[:size]
        docs = []
        for i in sorted(order):
            e = examples[i]
            prompt = chat.render(template, conversation(e["text"], "")[:1],
                                 add_generation_prompt=True)
            choices = [chat.render(template, conversation(e["text"], name))[len(prompt):]
                       for name in labels]
            docs.append({"prompt": prompt, "choices": choices, "label": e["label"],
                         "language": e["language"]})
        path = (out / "tasks" / f"help_topics_{split}.jsonl").resolve()
        _write_jsonl(path, docs)
        (out / "tasks" / f"help_topics_{split}.yaml").write_text(
            _task_yaml(f"help_topics_{split}", path))
    (out / "tokenizer_config.json").write_text(json.dumps(template, indent=1))
    info = {"examples": {k: len(v) for k, v in splits.items()}, "task_docs": sizes,
            "labels": list(labels), "instruction": INSTRUCTION, "template": TEMPLATE,
            "seed": SEED}
    (out / "info.json").write_text(json.dumps(info, indent=1))
    if args.pretrained:
        vocab = pathlib.Path(args.pretrained) / "vocab"
        if not vocab.is_dir():
            sys.exit(f"error: --pretrained={args.pretrained} has no vocab/: give a trained run")
        (vocab / "tokenizer_config.json").write_text(json.dumps(template, indent=1))
    print(json.dumps(info["examples"]), "->", out)


# ------------------------------------------------------------------ sweep

def _overrides(args, method: str, lr: float) -> list[str]:
    data = pathlib.Path(args.data).resolve()
    flags = [f"--config=configs/finetune.py:{args.pretrained}",
             "--config.data.objective=sft",
             f"--config.data.dataset=chat:{data / 'train.jsonl'}",
             f"--config.data.eval_dataset=chat:{data / 'validation.jsonl'}",
             f"--config.data.eval_documents={args.eval_documents}",
             f"--config.data.batch_size={args.batch_size}",
             f"--config.num_train_steps={args.steps}",
             f"--config.optimizer.warmup_steps={max(1, args.steps // 10)}",
             f"--config.optimizer.learning_rate={lr}",
             f"--config.eval_every_steps={args.eval_every}",
             f"--config.checkpoint_every_steps={args.steps}",
             "--config.log_every_steps=10"]
    if method == "lora":
        flags += [f"--config.finetune.{k}={v}" for k, v in LORA.items()]
    return flags


def _metrics(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finished(workdir: pathlib.Path, steps: int) -> bool:
    return any(m.get("step") == steps and m.get("split") == "train" for m in _metrics(workdir))


def _train(args, name: str, method: str, lr: float) -> dict:
    runs = pathlib.Path(args.runs)
    workdir = runs / name
    timing = runs / f"{name}.time"
    if not _finished(workdir, args.steps):
        command = ["/usr/bin/time", "-f", "max_rss_kb %M\nwall_s %e", "-o", str(timing),
                   sys.executable, "train.py", f"--workdir={workdir}",
                   *_overrides(args, method, lr)]
        print(" ".join(command), flush=True)
        with open(runs / f"{name}.log", "w") as log:
            subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    measured = dict(line.split() for line in timing.read_text().splitlines()
                    if line.startswith(("max_rss_kb", "wall_s")))
    train = [m for m in _metrics(workdir) if m.get("split") == "train"]
    rates = [m["steps_per_sec"] for m in train[10:]]  # past the first window (compiling)
    evals = [m for m in _metrics(workdir) if m.get("split") == "validation"]
    return {"method": method, "learning_rate": lr, "workdir": str(workdir),
            "peak_rss_gb": int(measured["max_rss_kb"]) / 1e6,
            "wall_s": float(measured["wall_s"]),
            "step_time_s": 1 / statistics.median(rates) if rates else None,
            "validation_loss": [(m["step"], m["loss"]) for m in evals],
            "command": "python train.py --workdir=" + str(workdir) + " "
                       + " ".join(_overrides(args, method, lr))}


def _score(args, workdir: str, split: str) -> dict:
    from transformer.inference import harness

    lm = harness.TransformerLM(workdir=workdir, batch_size=64)
    task = f"help_topics_{split}"
    acc = harness.evaluate_tasks(lm, str(pathlib.Path(args.data) / "tasks"), [task])[
        f"lm_eval/{task}/acc"]
    n = len((pathlib.Path(args.data) / "tasks" / f"{task}.jsonl").read_text().splitlines())
    return {"acc": acc, "stderr": math.sqrt(acc * (1 - acc) / n), "docs": n}


def _memory(args, method: str) -> dict:
    """Parameters trained and the optimizer state's bytes (Adam's moments of what trains)."""
    import jax

    from configs import finetune
    from transformer.config import resolve
    from transformer.sizing import flops
    from transformer.training import lora, optim
    cfg = finetune.get_config(args.pretrained)
    if method == "lora":
        cfg.finetune.update(LORA)
    run = resolve(cfg)
    params = flops.abstract_params(run.model)
    tx, _ = optim.make_optimizer(run.config.optimizer, d_model=run.model.d_model,
                                 total_steps=args.steps)
    tx = lora.freeze_base(tx, run.model)
    state = jax.eval_shape(tx.init, params)
    labels = lora.labels(params) if method == "lora" else None
    sizes = [leaf.size for leaf in jax.tree.leaves(params)]
    trained = (sum(leaf.size for leaf, label in zip(
        jax.tree.leaves(params), jax.tree.leaves(labels), strict=True) if label == lora.TRAIN)
        if labels is not None else sum(sizes))
    return {"parameters": sum(sizes), "parameters_trained": trained,
            "optimizer_state_bytes": sum(leaf.size * leaf.dtype.itemsize
                                         for leaf in jax.tree.leaves(state))}


def _plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, run in results["runs"].items():
        steps, losses = zip(*run["validation_loss"], strict=True) if run["validation_loss"] \
            else ((), ())
        chosen = name in results["chosen"].values()
        ax.plot(steps, losses, marker="o", linestyle="-" if run["method"] == "full" else "--",
                linewidth=2.2 if chosen else 1, label=f"{name}{' (chosen)' if chosen else ''}")
    ax.set_xlabel("update")
    ax.set_ylabel("validation loss (assistant tokens, nats)")
    ax.set_title("SFT on help topics: full fine-tuning against LoRA")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sweep(args) -> None:
    record = pathlib.Path(args.record)
    record.mkdir(parents=True, exist_ok=True)
    path = record / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("runs", {})
    results.setdefault("validation", {})
    results.setdefault("test", {})

    def save():
        path.write_text(json.dumps(results, indent=1))

    results["settings"] = {"steps": args.steps, "batch_size": args.batch_size,
                           "lora": LORA, "pretrained": args.pretrained}
    if "pretrained" not in results["validation"]:
        results["validation"]["pretrained"] = _score(args, args.pretrained, "validation")
        save()
    # full and LoRA alternate, each at its rates in order (as many of each)
    plan = [(m, lr) for pair in zip(args.full_lrs, args.lora_lrs, strict=True)
            for m, lr in zip(("full", "lora"), pair, strict=True)]
    for method, lr in plan:
        name = f"{method}_lr{lr:g}"
        results["runs"][name] = _train(args, name, method, lr)
        save()
        if name not in results["validation"]:
            results["validation"][name] = _score(args, results["runs"][name]["workdir"],
                                                 "validation")
            save()
    results["chosen"] = {
        method: max((n for n in results["runs"] if results["runs"][n]["method"] == method),
                    key=lambda n: results["validation"][n]["acc"])
        for method in ("full", "lora")}
    if not args.no_test:
        for name in ("pretrained", *results["chosen"].values()):
            if name not in results["test"]:  # the test split is scored once
                workdir = args.pretrained if name == "pretrained" \
                    else results["runs"][name]["workdir"]
                results["test"][name] = _score(args, workdir, "test")
                save()
    results["memory"] = {m: _memory(args, m) for m in ("full", "lora")}
    save()
    for name, run in results["runs"].items():
        for file in ("metrics.jsonl", "config.json"):
            shutil.copy(pathlib.Path(run["workdir"]) / file, record / f"{name}.{file}")
    pre = pathlib.Path(args.pretrained)
    shutil.copy(pre / "metrics.jsonl", record / "pretrain.metrics.jsonl")
    shutil.copy(pre / "config.json", record / "pretrain.config.json")
    shutil.copy(pathlib.Path(args.data) / "info.json", record / "data_info.json")
    _plot(results, record / "validation_loss.png")
    print(json.dumps({k: results[k] for k in ("validation", "test", "chosen", "memory")},
                     indent=1))


# ------------------------------------------------------------------ DPO

def _pair_logps(workdir: str, pairs: list[dict]) -> np.ndarray:
    """[n, 2]: log p(chosen), log p(rejected) of each pair's response after its prompt,
    rendered with the template as DPO renders them (prompt with the generation prompt; the
    response is the rest of prompt + response), scored by the lm-eval model class."""
    from lm_eval.api.instance import Instance

    from transformer.data import chat
    from transformer.inference import harness

    template = {"chat_template": TEMPLATE}
    requests = []
    for pair in pairs:
        prompt = chat.render(template, pair["prompt"], add_generation_prompt=True)
        for side in ("chosen", "rejected"):
            whole = chat.render(template, pair["prompt"] + pair[side])
            requests.append(Instance("loglikelihood", {}, (prompt, whole[len(prompt):]), 0))
    lm = harness.TransformerLM(workdir=workdir, batch_size=64)
    return np.array([score for score, _ in lm.loglikelihood(requests)]).reshape(-1, 2)


def dpo(args) -> None:
    """DPO from the pretrained run (the frozen reference) on the preference pairs; trl's
    margin (beta x the policy's log-ratio gain of chosen over rejected) on held-out pairs: the
    run's eval lines on validation pairs, then once on a seeded sample of the test pairs."""
    record = pathlib.Path(args.record)
    record.mkdir(parents=True, exist_ok=True)
    path = record / "dpo.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    data = pathlib.Path(args.data).resolve()
    runs = pathlib.Path(args.runs)
    name = f"dpo_lr{args.lr:g}"
    workdir = runs / name
    flags = [f"--config=configs/finetune.py:{args.pretrained}",
             "--config.data.objective=dpo",
             f"--config.data.dataset=preference:{data / 'preference' / 'train.jsonl'}",
             f"--config.data.eval_dataset=preference:{data / 'preference' / 'validation.jsonl'}",
             f"--config.data.eval_documents={args.eval_documents}",
             f"--config.data.batch_size={args.batch_size}",
             f"--config.num_train_steps={args.steps}",
             f"--config.optimizer.warmup_steps={max(1, args.steps // 10)}",
             f"--config.optimizer.learning_rate={args.lr}",
             f"--config.finetune.dpo_beta={args.beta}",
             f"--config.eval_every_steps={args.eval_every}",
             f"--config.checkpoint_every_steps={args.steps}",
             "--config.log_every_steps=10"]
    if not _finished(workdir, args.steps):
        command = [sys.executable, "train.py", f"--workdir={workdir}", *flags]
        print(" ".join(command), flush=True)
        with open(runs / f"{name}.log", "w") as log:
            subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    results["command"] = "python train.py --workdir=" + str(workdir) + " " + " ".join(flags)
    results["validation"] = [
        {k: v for k, v in m.items() if k in ("step", "loss") or k.startswith(("rewards", "logps"))}
        for m in _metrics(workdir) if m.get("split") == "validation"]
    if "test" not in results:  # scored once
        lines = (data / "preference" / "test.jsonl").read_text().splitlines()
        order = np.random.default_rng(SEED).permutation(len(lines))[:args.test_pairs]
        pairs = [json.loads(lines[i]) for i in sorted(order)]
        policy = _pair_logps(str(workdir), pairs)
        reference = _pair_logps(args.pretrained, pairs)
        margins = args.beta * ((policy[:, 0] - reference[:, 0])
                               - (policy[:, 1] - reference[:, 1]))
        results["test"] = {
            "pairs": len(pairs), "beta": args.beta,
            "rewards/margins": float(margins.mean()),
            "rewards/margins_stderr": float(margins.std(ddof=1) / math.sqrt(len(pairs))),
            "rewards/accuracies": float((margins > 0).mean()),
            "reference_logp_gap": float((reference[:, 0] - reference[:, 1]).mean()),
            "policy_logp_gap": float((policy[:, 0] - policy[:, 1]).mean()),
            "reference_prefers_chosen": float((reference[:, 0] > reference[:, 1]).mean()),
            "policy_prefers_chosen": float((policy[:, 0] > policy[:, 1]).mean())}
    path.write_text(json.dumps(results, indent=1))
    for file in ("metrics.jsonl", "config.json"):
        shutil.copy(workdir / file, record / f"{name}.{file}")
    print(json.dumps(results["test"], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the instruction set, tasks and template")
    b.add_argument("--out", required=True)
    b.add_argument("--pretrained", default="", help="a run to give the chat template")
    b.add_argument("--root", default="~/tensorflow_datasets/downloads/offline_de_en/root",
                   help="the unpacked help packages (offline_de_en's download)")
    b.add_argument("--validation_docs", type=int, default=200)
    b.add_argument("--test_docs", type=int, default=400)
    s = sub.add_parser("sweep", help="fine-tune (full, LoRA) over rates; score; record")
    s.add_argument("--pretrained", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--runs", required=True)
    s.add_argument("--record", required=True)
    s.add_argument("--steps", type=int, default=120)
    s.add_argument("--batch_size", type=int, default=8)
    s.add_argument("--eval_every", type=int, default=40)
    s.add_argument("--eval_documents", type=int, default=200)
    lrs = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    s.add_argument("--full_lrs", type=lrs, default=[1e-3, 3e-3])
    s.add_argument("--lora_lrs", type=lrs, default=[3e-3, 1e-2])
    s.add_argument("--no_test", action="store_true", help="validation only")
    d = sub.add_parser("dpo", help="DPO from the pretrained run; held-out margins")
    for flag in ("--pretrained", "--data", "--runs", "--record"):
        d.add_argument(flag, required=True)
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--batch_size", type=int, default=8)
    d.add_argument("--eval_every", type=int, default=20)
    d.add_argument("--eval_documents", type=int, default=200)
    d.add_argument("--lr", type=float, default=1e-4)
    d.add_argument("--beta", type=float, default=0.1)
    d.add_argument("--test_pairs", type=int, default=500)
    args = parser.parse_args()
    {"build": build, "sweep": sweep, "dpo": dpo}[args.command](args)


if __name__ == "__main__":
    main()
