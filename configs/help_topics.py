"""Fine-tuning the masked-LM encoder of `configs/mlm_default.py` to classify LibreOffice help
paragraphs by module (8 classes), on a 2-core CPU.

    python train.py --config=configs/mlm_default.py --workdir=runs/mlm_default
    python train.py --config=configs/help_topics.py --workdir=runs/help_topics \\
        --config.init_from=runs/mlm_default
    python train.py --config=configs/help_topics.py --workdir=runs/help_topics_scratch

Data: the TFDS dataset `offline_help_topics` (built on first use from the LibreOffice help
packages, as `offline_de_en`): 27,302 training, 3,426 validation and 3,602 test paragraphs,
English and German, labelled Writer, Calc, Impress, Draw, Base, Math, Chart or Basic
(`transformer/data/offline/help_paragraphs.py`). One paragraph a row: its pieces and EOS, cut to 64
tokens (`transformer/data/text_classification.py`). With `init_from` the vocabulary is the
pretrained run's (8,000 pieces). From scratch one of the same size is trained on these texts.

Model: `mlm_default`'s fields unchanged (4 pre-RMSNorm layers of width 256, RoPE, SwiGLU, 4
heads sharing 2 key/value heads), architecture "classifier": the encoder, the mean of its final
states over the non-padding tokens (pooling "gap": the masked LM has no class token), and a
zero-initialised head [256, 8]: `init_from` loads every parameter but `head/kernel` and
`head/bias` (listed in the log). AdamW 1e-3 (the head and encoder alike), 50 warmup steps,
cosine to 10% at update 600, batch 32: 19,200 examples, 0.7 epoch.

Hardware, time and expected result: a 2-core CPU VM, about 10 minutes for 600 updates.
Docs/results/2026-12-01-help-topics.md (with the baselines of
`benchmarks/help_topics_baselines.py` on the same splits).
"""

from ml_collections import config_dict

from configs import common, mlm_default


def get_config():
    cfg = mlm_default.get_config()
    cfg.model.architecture = "classifier"
    cfg.model.num_classes = 8
    cfg.model.pooling = "gap"
    cfg.data = config_dict.ConfigDict(dict(
        dataset="offline_help_topics", objective="classification",
        text_feature="text", label_feature="label",
        vocab_size=cfg.data.vocab_size,  # the pretrained run's (init_from checks it)
        max_length=64,  # tokens per row (the paragraphs are ~30 pieces; longer ones are cut)
        batch_size=32, eval_batch_size=256,
        data_dir=config_dict.placeholder(str),  # TFDS data_dir; None: TFDS's default
        manual_dir=config_dict.placeholder(str),  # an unpacked LibreOffice help tree
        vocab_sample_documents=200_000,  # from scratch: SentencePiece's training texts
        workers=0,  # Grain processes producing this process's batches; 0: the loop itself
        **common.classification_files()))
    cfg.model.vocab_size = cfg.data.get_ref("vocab_size")
    cfg.init_from = ""  # --config.init_from=runs/mlm_default to fine-tune the masked LM
    cfg.num_train_steps = 600
    cfg.log_every_steps = 25
    cfg.eval_every_steps = 200
    cfg.checkpoint_every_steps = 200
    cfg.checkpoint_every_minutes = 10
    cfg.optimizer.learning_rate = 1e-3
    cfg.optimizer.warmup_steps = 50
    return cfg
