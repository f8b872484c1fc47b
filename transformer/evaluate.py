"""Score a trained run on a split: perplexity and both BLEUs, like the paper's Table 2 (an
image classifier: loss, accuracy, top-5 accuracy and a confusion matrix, `classify`).

    python -m transformer.evaluate --workdir=runs/default --split=test [--average=5 | --step=N]

Prints the figures, appends them to `<workdir>/metrics.jsonl` (split "validation" or "test"),
and writes the sources, references and translations it scored to `<workdir>/eval/`.
"""

import logging
import os

from absl import app, flags

from transformer.util import cli

cli.define_run_flags(average=True)
flags.DEFINE_enum("split", "test", ["validation", "test"], "The split to score.")
flags.DEFINE_integer("num_sentences", None, "Score only the first N sentences (default: all).",
                     lower_bound=1)
flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's; 1: greedy).",
                     lower_bound=1)
FLAGS = flags.FLAGS
log = logging.getLogger("transformer")


def evaluate(workdir: str, split: str, *, step=None, average=None, num_sentences=None,
             beam_size=None) -> dict:
    """Perplexity over the whole split and BLEU over its first `num_sentences` pairs."""
    import jax

    from transformer.checkpoint import workdir as workdir_lib

    if workdir_lib.load_config(workdir).model.get("architecture") == "vision":
        from transformer import classify

        return classify.evaluate_workdir(workdir, split, step=step, average=average)

    from transformer.checkpoint.averaging import params_step
    from transformer.config import Resolved
    from transformer.data import make_source
    from transformer.inference.translator import load
    from transformer.training import loop, scores, sharding
    from transformer.training import step as step_lib
    from transformer.training.metrics import MetricWriter

    translator = load(workdir, step=step, average=average)
    cfg = translator.config
    source = make_source(cfg, workdir)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = step_lib.build_trainer(Resolved(cfg, translator.model_config, dict(mesh.shape)),
                                      mesh)
    params = jax.device_put(translator.params, trainer.state_shardings.params)
    figures = loop.evaluate(trainer, step_lib.make_eval_step(trainer), params, source,
                            (0, source.eval_rows_per_batch), split)

    pairs = source.raw_pairs(split, num_sentences)
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    log.info("translating %d %s sentences", len(sources), split)
    hypotheses = translator.translate(sources, beam_size=beam_size)
    figures |= scores.bleu(hypotheses, references, target_lang=cfg.data.target_lang)
    figures["bleu_num_truncated"] = translator.num_too_long(sources)

    label = f"average{average}" if average else f"step{step}" if step else "latest"
    out_dir = workdir_lib.path(workdir, workdir_lib.EVAL)
    os.makedirs(out_dir, exist_ok=True)
    for kind, lines in (("source", sources), ("reference", references),
                        ("translation", hypotheses)):
        with open(os.path.join(out_dir, f"{split}.{label}.{kind}.txt"), "w") as f:
            f.writelines(line + "\n" for line in lines)
    at_step = params_step(workdir, step=step, average=average)  # the params scored
    figures["checkpoint"] = label
    writer = MetricWriter(workdir)
    writer.write(at_step, split, figures)
    writer.close()
    return figures


def main(argv):
    cli.start(argv, level=logging.INFO, timestamps=True)
    from transformer.training import metrics

    with cli.one_line_errors():
        figures = evaluate(FLAGS.workdir, FLAGS.split, step=FLAGS.step, average=FLAGS.average,
                           num_sentences=FLAGS.num_sentences, beam_size=FLAGS.beam_size)
    if "accuracy" in figures:
        print(f"{FLAGS.split}: loss {figures['loss']:.4f} | accuracy "
              f"{100 * figures['accuracy']:.2f}%" + (f" | top-5 accuracy "
              f"{100 * figures['top5_accuracy']:.2f}%" if "top5_accuracy" in figures else ""))
        return
    print(f"{FLAGS.split}: perplexity {figures['perplexity']:.2f} | sacreBLEU "
          f"{figures['bleu']:.2f} ({figures['bleu_signature']}) | tokenized compound-split BLEU "
          f"{figures['bleu_tok_compound']:.2f} | {metrics.sentences_scored(figures)}")


if __name__ == "__main__":
    app.run(main)
