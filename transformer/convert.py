"""Hugging Face checkpoints in and out of our workdirs (`transformer/huggingface/`).

    python -m transformer.convert import --from=<save_pretrained dir> --workdir=<W> \\
        [--config=configs/lm_default.py] [--adapter=<PEFT LoRA adapter dir>]
    python -m transformer.convert export --workdir=<W> --to=<dir> [--step=N] [--max_shard_gb=5]
        [--merge_lora]

`import` writes a run whose parameters `generate`, `evaluate` and `init_from` read; `--config`
gives its data, optimizer and mesh (default: configs/lm_default.py for language models,
configs/default.py for a Marian translation model, configs/vit_b16_imagenet.py for a ViT),
the checkpoint gives `model.*`. `export` writes
`config.json`, the safetensors (shards of at most `--max_shard_gb` with their index beyond
that) and the tokenizer, which `transformers`' `from_pretrained` loads. A LoRA run
(`finetune.lora_rank` > 0) exports its adapters as a PEFT adapter in `<dir>/adapter`, or with
`--merge_lora` merged into the weights; `import --adapter` reads such an adapter onto the
checkpoint.
"""

from absl import app, flags

from transformer.util import cli

COMMANDS = ("import", "export")
flags.DEFINE_string("from", None, "import: the checkpoint directory (save_pretrained's).")
flags.DEFINE_string("workdir", None, "The run's workdir (import: a new one).")
flags.DEFINE_string("to", None, "export: the directory to write.")
flags.DEFINE_string("config", None, "import: the run config file for data and optimizer.")
flags.DEFINE_integer("step", None, "export: checkpoint step (default: the latest).",
                     lower_bound=0)
flags.DEFINE_float("max_shard_gb", 5.0, "export: GB (10^9 bytes) per safetensors file; a "
                   "bigger model is written as shards with an index", lower_bound=1e-9)
flags.DEFINE_string("adapter", None, "import: a PEFT LoRA adapter directory for the "
                    "checkpoint (adapter_config.json, adapter_model.safetensors).")
flags.DEFINE_bool("merge_lora", False, "export: a LoRA run's adapters merged into the weights "
                  "(a plain checkpoint) instead of a PEFT adapter beside them.")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        cli.usage_error(f"give a command: {' or '.join(COMMANDS)}")
    cli.start(argv[1:])
    from transformer.huggingface import convert

    with cli.one_line_errors():
        if argv[1] == "import":
            if not FLAGS["from"].value:
                raise ValueError("import needs --from=<save_pretrained directory>")
            path = convert.import_checkpoint(FLAGS["from"].value, FLAGS.workdir,
                                             config_file=FLAGS.config, adapter=FLAGS.adapter)
        else:
            if not FLAGS.to:
                raise ValueError("export needs --to=<directory>")
            path = convert.export_workdir(FLAGS.workdir, FLAGS.to, step=FLAGS.step,
                                          max_shard_bytes=int(FLAGS.max_shard_gb * 1e9),
                                          merge_lora=FLAGS.merge_lora)
        print(path)


if __name__ == "__main__":
    app.run(main)
