"""Fine-tune a run on the offline corpus's text: its model, vocabulary and weights (an imported
Hugging Face checkpoint, say), `lm_default.py`'s data, and a fine-tuning schedule.

    python -m transformer.convert import --from=hf/gpt2 --workdir=runs/gpt2
    python train.py --config=configs/finetune.py:runs/gpt2 --workdir=runs/gpt2_finetuned
    python -m transformer.generate --workdir=runs/gpt2_finetuned --prompt="Click the"

The argument is the pretrained workdir (`init_from`, also `workdir:step`): its `config.json`
gives `model.*` (the checkpoint's special token ids included) and `data.vocab_size`. Its
`vocab/` (a tokenizer.json or SentencePiece model) becomes the new run's. AdamW 1e-4 (b2 0.95,
weight decay 0.1, clipped at 1), 50 warmup updates, cosine to 10% at update 500. Rows of 128
tokens, 16 rows per update, float32. No dropout unless the checkpoint's config asks for it.
The whole model trains unless `finetune.lora_rank` > 0 (LoRA adapters alone: `lora_alpha`,
`lora_targets`, and `lora_dropout`, PEFT's dropout of the adapters' input in training).

Preference tuning (DPO, `transformer/training/dpo.py`) is the argument `<workdir>,dpo`: pairs
in jsonl rows of prompt, chosen and rejected, the reference the pretrained weights, beta 0.1
(`finetune.dpo_beta`), AdamW 5e-6 (no weight decay) with 10 warmup updates, 200 updates:

    python train.py --config=configs/finetune.py:runs/gpt2,dpo --workdir=runs/gpt2_dpo \
        --config.data.dataset=preference:pairs/train.jsonl \
        --config.data.eval_dataset=preference:pairs/validation.jsonl
"""

import json
import pathlib

from ml_collections import config_dict

from configs.lm_default import cpu_config


def get_config(pretrained: str = ""):
    pretrained, _, objective = pretrained.partition(",")
    if objective not in ("", "dpo"):
        raise ValueError(f"configs/finetune.py:{pretrained},{objective}: after the comma comes "
                         f"'dpo' (preference tuning) or nothing")
    if not pretrained:
        raise ValueError("configs/finetune.py needs the pretrained run: "
                         "--config=configs/finetune.py:<workdir>")
    workdir = pretrained.rpartition(":")[0] if pretrained.rpartition(":")[2].isdigit() \
        else pretrained
    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        raise ValueError(f"configs/finetune.py:{pretrained}: {path} is missing; give a run's "
                         f"workdir (python -m transformer.convert import writes one)")
    recorded = json.loads(path.read_text())
    cfg = cpu_config("causal", num_train_steps=500, learning_rate=1e-4, warmup_steps=50)
    cfg.model = config_dict.ConfigDict(recorded["model"])
    cfg.data.vocab_size = cfg.model.vocab_size
    cfg.data.max_length = min(cfg.data.max_length, cfg.model.max_len)
    cfg.init_from = pretrained
    # LoRA (model/lora.py): --config.finetune.lora_rank=8 trains adapters alone; an imported
    # PEFT adapter's run brings its own section
    cfg.finetune = config_dict.ConfigDict(recorded.get("finetune") or dict(
        lora_rank=0, lora_alpha=16.0, lora_dropout=0.0, lora_targets="query,value"))
    cfg.finetune.dpo_beta = 0.1  # read where data.objective="dpo"
    if objective == "dpo":
        cfg.data.objective = "dpo"
        cfg.data.dataset = cfg.data.eval_dataset = ""  # preference:<glob>, given by flags
        cfg.num_train_steps = 200
        cfg.optimizer.learning_rate = 5e-6
        cfg.optimizer.warmup_steps = 10
        cfg.optimizer.weight_decay = 0.0
        cfg.eval_every_steps = cfg.checkpoint_every_steps = 50
    return cfg
