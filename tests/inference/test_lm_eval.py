"""The lm-eval model class `transformer` (transformer/inference/harness.py) against lm-eval's
own Hugging Face model (`HFLM`) on the same tiny random Llama, imported here: local task files
(a yaml and a jsonl in tmp_path, nothing downloaded) score the same and generate the same
greedy text (a random model's: its stop string "a" is one that text holds), and bad input is
refused in one line."""

import json

import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES, byte_level_bpe

from transformer.huggingface import convert
from transformer.inference.generator import load_generator

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # HFLM's

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from transformer.inference import harness  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
MAX_LENGTH = 16  # windows this short: the long text is scored in several, each row padded
TASKS = ["tiny_choice", "tiny_text", "tiny_gen"]
# Ours (XLA) against transformers (torch), float32 on a CPU: a logit of these 2-layer models
# (D 64) sums ~1,350 products, each rounding at 2^-24 of its size; in the usual random-walk
# growth that is ~sqrt(1350) x 6e-8 = 2e-6 of a logit of size ~1, twice that in a log-softmax,
# and a score sums at most MAX_LENGTH of them per window (~10 windows for the long text):
# sqrt(100) x 4e-6 = 4e-5, under 1e-4 by 2.5x. (Seen: 8e-6.)
ATOL = 1e-4


def _llama_with_bos_template(hf_dir):
    """A tiny random Llama whose byte-level BPE tokenizer.json puts BOS before a text (as
    Llama 3's), saved as transformers saves it, with a tokenizer_config.json naming BOS and EOS."""
    from tokenizers import processors

    hf_dir.mkdir()
    tokenizer = byte_level_bpe(TRANSLATION_SENTENCES, vocab_size=320, special_tokens=[BOS, EOS])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                             special_tokens=[(BOS, 0)])
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=BOS, eos_token=EOS)))
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=0,
        eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(hf_dir)
    return model, transformers.AutoTokenizer.from_pretrained(str(hf_dir))


def _write_tasks(folder, greedy_choice):
    """Three tasks over one jsonl: multiple choice (loglikelihood), a text's perplexity
    (rolling loglikelihood) and a continuation (generate_until)."""
    folder.mkdir()
    docs = [dict(question="Opens a", choices=[greedy_choice, " dialog", " window"], answer=1,
                 text="Opens a dialog to choose the file. Closes the window when done, and "
                      "saves the settings of the program before it quits."),
            dict(question="Saves the", choices=[" file", " settings"], answer=0,
                 text="Prints the page.")]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {folder / 'docs.jsonl'}\ntest_split: test\n")
    (folder / "choice.yaml").write_text(
        "task: tiny_choice\n" + common + "output_type: multiple_choice\n"
        "target_delimiter: ''\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "text.yaml").write_text(
        "task: tiny_text\n" + common + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n")
    (folder / "gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['a']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def _responses(model, tasks, task_manager, **kwargs):
    """Each task's responses per document, and its metrics as `evaluate_tasks` names them."""
    results = simple_evaluate(model=model, tasks=tasks, task_manager=task_manager,
                              log_samples=True, bootstrap_iters=0, **kwargs)
    metrics = {f"lm_eval/{task}/{name.split(',')[0]}": value
               for task, values in results["results"].items()
               for name, value in values.items()
               if "_stderr" not in name and isinstance(value, float)}
    return {name: [sample["resps"] for sample in samples]
            for name, samples in results["samples"].items()}, metrics


def test_scores_and_greedy_text_equal_lm_evals_hugging_face_model(tmp_path):
    from lm_eval.models.huggingface import HFLM

    hf_model, hf_tokenizer = _llama_with_bos_template(tmp_path / "llama")
    with torch.no_grad():
        logits = hf_model(torch.tensor([hf_tokenizer.encode("Opens a")])).logits
    greedy_choice = hf_tokenizer.decode([int(logits[0, -1].argmax())])
    _write_tasks(tmp_path / "tasks", greedy_choice)
    workdir = str(tmp_path / "run")
    convert.import_checkpoint(str(tmp_path / "llama"), workdir,
                              overrides={"model.dtype": "float32"})
    tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    ours, metrics = _responses(harness.NAME, TASKS, tasks,
                               model_args=f"workdir={workdir},max_length={MAX_LENGTH}",
                               batch_size=4)
    peer = dict(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=4,
                max_length=MAX_LENGTH)
    theirs = _responses(HFLM(**peer), ["tiny_choice", "tiny_gen"], tasks)[0]
    # A rolling text read once behind BOS: HFLM without its tokenizer's BOS (harness.py).
    theirs |= _responses(HFLM(**peer, add_bos_token=False), ["tiny_text"], tasks)[0]

    for name in ("tiny_choice", "tiny_text"):
        ours_flat = [r[0] for doc in ours[name] for r in doc]
        theirs_flat = [r[0] for doc in theirs[name] for r in doc]
        if name == "tiny_choice":
            assert [g for _, g in ours_flat] == [g for _, g in theirs_flat]
            assert ours_flat[0][1] is True  # the greedy choice is seen as greedy
            ours_flat = [s for s, _ in ours_flat]
            theirs_flat = [s for s, _ in theirs_flat]
        np.testing.assert_allclose(ours_flat, theirs_flat, atol=ATOL, rtol=0, err_msg=name)
    assert ours["tiny_gen"] == theirs["tiny_gen"]
    texts = [doc[0][0] for doc in ours["tiny_gen"]]
    assert all(texts) and not any("a" in text for text in texts)  # cut before "a"

    # A training loop's model as it is (a generator, no workdir read): the same metrics.
    lm = harness.TransformerLM(generator=load_generator(workdir), batch_size=4,
                               max_length=MAX_LENGTH)
    scored = harness.evaluate_tasks(lm, str(tmp_path / "tasks"), ["tiny_choice", "tiny_text"])
    assert scored == {k: v for k, v in metrics.items() if "tiny_gen" not in k}
    assert set(scored) == {"lm_eval/tiny_choice/acc", "lm_eval/tiny_text/word_perplexity"}


def test_a_task_file_that_does_not_parse_is_named_before_the_run_is_opened(tmp_path):
    (tmp_path / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    with pytest.raises(ValueError, match=r"^lm-eval task file .*broken.yaml does not parse"):
        harness.main(["--model_args", f"workdir={tmp_path / 'no_run'}", "--tasks", "broken",
                      "--include_path", str(tmp_path)])


def test_a_run_that_is_not_a_language_model_is_refused(untrained_translation_workdir):
    with pytest.raises(ValueError, match="lm-eval scores decoder-only language models"):
        harness.TransformerLM(workdir=str(untrained_translation_workdir))


def test_the_training_loop_scores_local_tasks_every_n_steps(offline_fixture_data_dir,
                                                            load_config, tmp_path):
    """`lm_eval_every_steps`: the validation lines of steps 2 and 4 carry the task's score,
    and step 4's equals the finished run's own through the model class."""
    from transformer.training.loop import train_and_evaluate

    _write_tasks(tmp_path / "tasks", " dialog")
    cfg = load_config("lm_default.py")
    cfg.data.update(dict(data_dir=str(offline_fixture_data_dir), vocab_size=200, max_length=32,
                         batch_size=8))
    cfg.model.update(dict(d_model=32, d_ff=64, num_heads=2, num_kv_heads=1,
                          num_decoder_layers=2, max_len=32))
    cfg.update(dict(num_train_steps=4, eval_every_steps=4, checkpoint_every_steps=4,
                    log_every_steps=2, lm_eval_every_steps=2, lm_eval_tasks="tiny_text",
                    lm_eval_path=str(tmp_path / "tasks"), lm_eval_limit=1))
    cfg.optimizer.warmup_steps = 1
    workdir = tmp_path / "run"
    train_and_evaluate(cfg, str(workdir))
    key = "lm_eval/tiny_text/word_perplexity"
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    scored = {line["step"]: line[key] for line in lines if key in line}
    assert sorted(scored) == [2, 4] and scored[2] != scored[4]
    lm = harness.TransformerLM(workdir=str(workdir))
    again = harness.evaluate_tasks(lm, str(tmp_path / "tasks"), ["tiny_text"], limit=1)[key]
    # The same float32 computation, the loop's on its mesh: log-likelihoods within 1e-4 (see
    # ATOL), a perplexity exp(-ll / words) then within 1e-4 relative.
    np.testing.assert_allclose(again, scored[4], rtol=1e-4)
