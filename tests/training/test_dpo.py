"""DPO (transformer/training/dpo.py): the loss and trl's figures equal trl's `DPOTrainer` on
tiny random Llamas imported here; the reference stays frozen to the bit while the
chosen/rejected margin grows; LoRA's reference is the base; a 2x4 mesh gives the
single device's figures."""

import math

import jax
import numpy as np
import pytest

from transformer.config import resolve
from transformer.data import batching, preference
from transformer.parallel import sharding
from transformer.training import dpo, train_state

VOCAB = 64
LENGTH = 32


def _pairs(rng, count: int, vocab: int = VOCAB, first: int = 4):
    """`count` random pairs: (chosen [2, n], rejected [2, m]) (ids, response mask), a shared
    prompt of 2-5 tokens and responses of 2-6."""
    pairs = []
    for _ in range(count):
        prompt = rng.integers(first, vocab, rng.integers(2, 6)).tolist()
        sides = []
        for _ in range(2):
            response = rng.integers(first, vocab, rng.integers(2, 7)).tolist()
            sides.append(np.array([prompt + response,
                                   [0] * len(prompt) + [1] * len(response)], np.int32))
        pairs.append(tuple(sides))
    return pairs


def _batch(pairs, rows: int, length: int = LENGTH) -> dict[str, np.ndarray]:
    """One microbatch [1, rows, length] of `pairs`, packed first-fit."""
    n = np.array([c.shape[1] + r.shape[1] for c, r in pairs])
    placement = batching.first_fit(np.zeros_like(n), n, rows, length)
    batch = preference.pack_pairs(pairs, placement, (0, rows), length)
    return {k: v[None] for k, v in batch.items()}


def _config(load_config, **overrides):
    return load_config("lm_default.py", **{
        "data.objective": "dpo", "data.vocab_size": VOCAB, "data.max_length": LENGTH,
        "data.batch_size": 8, "model.d_model": 32, "model.d_ff": 64, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.num_decoder_layers": 2, "model.max_len": LENGTH,
        "model.dropout_rate": 0.0, "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_steps": 1, "num_train_steps": 10, "log_every_steps": 1} | overrides)


def _trainer(cfg, devices=None):
    run = resolve(cfg, len(devices or jax.devices()))
    return train_state.build_trainer(run, sharding.make_mesh(run.config.mesh, devices)), run


def test_the_reference_stays_frozen_while_the_margin_grows(load_config):
    """Full fine-tuning: the first step's reference is its own params (rewards 0, loss
    log 2 exactly); after it the stored copy equals the starting params to the bit while the
    params move, and the chosen/rejected margin and reward accuracy grow."""
    trainer, run = _trainer(_config(load_config))
    state = train_state.init_state(trainer, 0)
    start = jax.device_get(state.params)
    step = train_state.make_train_step(trainer, run.config)
    batch = train_state.global_batch(trainer.mesh, _batch(_pairs(np.random.default_rng(0), 8),
                                                          rows=8))
    history = []
    for _ in range(6):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    # the same forward pass twice, perhaps fused apart: float32 sums of ~100 log-probs of ~5
    # differ by ~100 x 5 x 2^-24 ~ 3e-5 at most, x beta 0.1
    for key in ("rewards/margins", "rewards/chosen", "rewards/rejected"):
        assert abs(history[0][key]) < 1e-5, key
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert history[0]["target_tokens"] == float(np.sum(batch["targets_loss_mask"]))
    stored = jax.device_get(state.opt_state.reference)
    jax.tree.map(np.testing.assert_array_equal, stored, start)  # bit-identical
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), jax.device_get(state.params), start)
    assert max(jax.tree.leaves(moved)) > 1e-3
    margins = [float(m["rewards/margins"]) for m in history]
    assert margins[-1] > margins[3] > margins[0] and margins[-1] > 0.05  # seen 0 -> ~0.5
    assert history[-1]["rewards/accuracies"] > 0.8 and history[-1]["loss"] < math.log(2)


def test_lora_reference_is_the_base_with_adapters_off(load_config):
    """LoRA: no stored copy; the reference is the params with lora_b zero, so at the start
    (B = 0) rewards are 0, and after training the eval's rewards are the adapters' alone."""
    cfg = _config(load_config, **{"optimizer.learning_rate": 1e-2})
    cfg.finetune = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                        lora_targets="query,value,ff_out", dpo_beta=0.5)
    trainer, run = _trainer(cfg)
    assert trainer.dpo_beta == 0.5
    state = train_state.init_state(trainer, 0)
    assert not isinstance(state.opt_state, dpo.ReferenceState)
    step = train_state.make_train_step(trainer, run.config)
    evaluate = train_state.make_eval_step(trainer)
    batch = train_state.global_batch(trainer.mesh, _batch(_pairs(np.random.default_rng(1), 8),
                                                          rows=8))
    for _ in range(4):
        state, metrics = step(state, batch)
    sums = jax.device_get(evaluate(dpo.eval_params(trainer, state), batch))
    figures = train_state.eval_metrics(sums)
    assert set(figures) == {"loss", "perplexity", *dpo.METRICS}
    assert figures["rewards/margins"] > 0.05 and figures["loss"] < math.log(2)


def test_sharded_2x4_and_accumulated_equal_one_device(load_config):
    """Three steps on a data=2 x fsdp=4 mesh, and on one device in two accumulated
    microbatches of 4 rows (pairs split unevenly between them), give the single device's
    figures and params: float32 sums in another order, each ~n 2^-24 relative for n ~100
    terms (~6e-6), 2e-5 with a margin; the params after 3 Adam updates 1e-4."""
    pairs = _pairs(np.random.default_rng(2), 10)
    results = []
    for mesh, devices, accum in (({"data": 2, "fsdp": 4}, None, 1),
                                 ({"data": 1, "fsdp": 1}, jax.devices()[:1], 2),
                                 ({"data": 1, "fsdp": 1}, jax.devices()[:1], 1)):
        cfg = _config(load_config, grad_accum_steps=accum,
                      **{f"mesh.{k}": v for k, v in mesh.items()})
        trainer, run = _trainer(cfg, devices)
        state = train_state.init_state(trainer, 0)
        step = train_state.make_train_step(trainer, run.config)
        whole = _batch(pairs, rows=8)
        split = {k: v.reshape(accum, 8 // accum, -1) for k, v in whole.items()}
        assert accum == 1 or len({int(dpo.pair_count(m)) for m in (
            {k: v[a] for k, v in split.items()} for a in range(accum))}) > 1  # uneven
        for _ in range(3):
            state, metrics = step(state, train_state.global_batch(trainer.mesh, split))
        evaluate = train_state.make_eval_step(trainer)
        results.append((jax.device_get(metrics), jax.device_get(state.params), jax.device_get(
            evaluate(dpo.eval_params(trainer, state),
                     train_state.global_batch(trainer.mesh, whole)))))
    *others, (single, params1, evaluated1) = results
    for metrics, params, evaluated in others:
        for key in ("loss", "grad_norm", *dpo.METRICS):
            np.testing.assert_allclose(metrics[key], single[key], rtol=2e-5, atol=2e-6,
                                       err_msg=key)
        for key in evaluated1:
            np.testing.assert_allclose(evaluated[key], evaluated1[key], rtol=2e-5, atol=2e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     params, params1)


# Ours (XLA) against torch in float32: test_huggingface's analysis bounds the imported
# logits within ATOL = 1e-4 of transformers'; a log-softmax moves by at most twice its logits'
# largest error, so a side's summed log-prob of n response tokens is within 2 n ATOL, a
# reward (beta x a difference of two) within 4 n ATOL beta, a margin and the loss's argument
# (two rewards) within 8 n ATOL beta, and -log sigmoid (slope below 1) by no more.
ATOL = 1e-4


def test_loss_and_figures_equal_trls_dpo_trainer(tmp_path, load_config):
    """trl's `DPOTrainer` (loss_type sigmoid, beta 0.1) on a tiny random Llama policy and
    another as its reference, both imported here: the pairs tokenize to trl's ids, and our
    loss and figures equal trl's within the bounds above; the reward accuracies are equal."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from conftest import TRANSLATION_SENTENCES, byte_level_bpe
    from tokenizers import processors

    from transformer.checkpoint import averaging, layout
    from transformer.data import tokenizer as tokenizer_lib
    from transformer.huggingface import convert
    from transformer.model.transformer import Transformer

    tokenizer = byte_level_bpe(TRANSLATION_SENTENCES, vocab_size=300,
                               special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(  # BOS first, as Llama's
        single="<s> $A", special_tokens=[("<s>", 2)])
    imported = []
    for seed in (0, 1):  # the policy, the reference
        path = tmp_path / f"llama{seed}"
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, initializer_range=0.2, pad_token_id=0, bos_token_id=2,
            eos_token_id=3)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
        model.save_pretrained(path)
        convert.import_checkpoint(str(path), str(tmp_path / f"run{seed}"),
                                  overrides={"model.dtype": "float32"})
        imported.append((model, averaging.load_params(str(tmp_path / f"run{seed}"))))
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    ours = tokenizer_lib.HuggingFaceTokenizer(tokenizer.to_str().encode(), bos_id=2, eos_id=3,
                                              pad_id=0)
    sentences = sorted(set(TRANSLATION_SENTENCES))
    k = len(sentences)
    rows = [{"prompt": sentences[i % k][:24] + " ", "chosen": sentences[(i + 1) % k][:8 + 2 * i],
             "rejected": sentences[(i + 2) % k][:20 - 2 * i]} for i in range(6)]

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, report_to="none",
                         use_cpu=True, bf16=False, per_device_train_batch_size=len(rows),
                         max_length=None)  # float32 throughout (bf16 autocasts the reference)
    trainer = trl.DPOTrainer(model=imported[0][0], ref_model=imported[1][0], args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=hf_tokenizer)
    prepared = list(trainer.train_dataset)
    pairs = [preference.encode_pair(row, ours, None, 64) for row in rows]
    for example, (chosen, rejected) in zip(prepared, pairs, strict=True):
        start = len(example["prompt_ids"]) - 1  # ours: no BOS (the model's shift puts it)
        for side, ids in ((chosen, example["chosen_ids"]), (rejected, example["rejected_ids"])):
            assert [2, *side[0].tolist()] == example["prompt_ids"] + ids
            assert side[1].tolist() == [0] * start + [1] * len(ids)
    inputs = trainer.data_collator(prepared)
    with torch.no_grad():
        loss = float(trainer.compute_loss(imported[0][0], inputs))
    theirs = {k: v[-1] for k, v in trainer._metrics["eval"].items()}

    run = resolve(layout.load_config(str(tmp_path / "run0")))
    mesh = sharding.make_mesh(load_config("lm_default.py").mesh, jax.devices()[:1])
    ours_trainer = type("T", (), dict(model=Transformer(run.model), mesh=mesh, dpo_beta=0.1))
    batch = {k: v[0] for k, v in _batch(pairs, rows=len(pairs), length=64).items()}
    sums = jax.device_get(jax.jit(lambda p, r, b: dpo.figure_sums(
        ours_trainer, p, (r, np.True_), b, None))(imported[0][1], imported[1][1], batch))
    figures = dpo.eval_figures(sums)
    assert sums["pairs"] == len(rows)
    n = max(int(side[1].sum()) for pair in pairs for side in pair)
    bounds = {"logps/chosen": 2 * n * ATOL, "logps/rejected": 2 * n * ATOL,
              "rewards/chosen": 4 * n * ATOL * 0.1, "rewards/rejected": 4 * n * ATOL * 0.1,
              "rewards/margins": 8 * n * ATOL * 0.1, "loss": 8 * n * ATOL * 0.1}
    theirs["loss"] = loss
    for key, bound in bounds.items():
        assert abs(figures[key] - theirs[key]) <= bound, (key, figures[key], theirs[key])
    # the same pairs ranked right: the same count of the 6 (trl's mean is float32)
    assert round(figures["rewards/accuracies"] * 6) == round(theirs["rewards/accuracies"] * 6)
    assert 0 < figures["rewards/accuracies"] < 1 and abs(figures["loss"] - math.log(2)) > 0.01


@pytest.mark.parametrize("change, message", [
    (dict(dpo_beta=0.0), r"^finetune.dpo_beta=0.0 must be a number > 0 \(trl's default: 0.1\)"),
    (dict(architecture="encoder"), r"^data.objective='dpo' trains a dense decoder, not "
                                   r"model.architecture='encoder'"),
    (dict(num_experts=4), r"^data.objective='dpo' trains a dense decoder, .* num_experts=4"),
])
def test_bad_settings_are_one_line(load_config, change, message):
    from ml_collections import ConfigDict

    cfg = _config(load_config)
    cfg.finetune = ConfigDict(dict(lora_rank=0, lora_alpha=16.0, lora_dropout=0.0,
                                   lora_targets="query", dpo_beta=change.pop("dpo_beta", 0.1)))
    for key, value in change.items():
        cfg.model[key] = value
    with pytest.raises(ValueError, match=message) as error:
        resolve(cfg)
    assert "\n" not in str(error.value)


def test_a_step_counts_four_forward_passes(load_config, monkeypatch):
    """A DPO step's FLOPs are 4/3 (`dpo.flops_factor`) of
    training's 3-forward count: a LoRA DPO step traces the policy's forward (differentiated:
    forward + backward, 3 forwards' worth) and the reference's, no dropout, in the two branches
    of a `lax.cond` (the stored copy or the params) of which one runs (1); a causal run's
    count is training's."""
    cfg = _config(load_config)
    cfg.finetune = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                        lora_targets="query,value", dpo_beta=0.1)
    trainer, run = _trainer(cfg)
    calls = []
    token_logps = dpo.token_logps
    monkeypatch.setattr(dpo, "token_logps", lambda *a: calls.append(a[3]) or token_logps(*a))
    state = train_state.init_state(trainer, 0)
    batch = train_state.global_batch(trainer.mesh, _batch(_pairs(np.random.default_rng(1), 8),
                                                          rows=8))
    train_state.make_train_step(trainer, run.config).lower(state, batch)
    assert len(calls) == 3 and calls[0] is not None and calls[1:] == [None, None]
    assert dpo.flops_factor(cfg) == pytest.approx((3 + 1) / 3, rel=1e-15)
    assert dpo.flops_factor(_config(load_config, **{"data.objective": "causal"})) == 1.0
