"""Language models: the objectives' batches (BERT masking statistics, prefix draws), packing
without attention across documents, the prefix-LM mask and cache, sampling, and training and
generation end to end on the offline corpus fixture."""

import json
import pathlib
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env

from transformer.data.objectives import apply_objective, cut_pieces
from transformer.inference import decoding
from transformer.model.transformer import (
    Transformer,
    TransformerConfig,
    init_cache,
    prefix_inputs,
    shift_right,
)
from transformer.ops import masks
from transformer.training import train_state

ROOT = pathlib.Path(__file__).resolve().parents[2]
V = 64
MASK_ID = 4
LM = dict(vocab_size=V, d_model=32, d_ff=64, num_heads=4, num_kv_heads=2, num_encoder_layers=0,
          num_decoder_layers=2, max_len=64, dropout_rate=0.0, positional="rope", norm="rms_norm",
          norm_position="pre", activation="swiglu", use_bias=False, tie_output_embedding=False,
          architecture="decoder")
DECODER = TransformerConfig(**LM)
ENCODER = TransformerConfig(**{**LM, "architecture": "encoder", "num_encoder_layers": 2,
                               "num_decoder_layers": 0, "tie_output_embedding": True})


def packed_rows(lengths_per_row, length, seed=0):
    """Packed `targets`, `targets_segmentation`, `targets_positions` [R, length] holding random
    documents of the given lengths, row by row."""
    rng = np.random.default_rng(seed)
    shape = (len(lengths_per_row), length)
    packed = {k: np.zeros(shape, np.int32)
              for k in ("targets", "targets_segmentation", "targets_positions")}
    for r, lengths in enumerate(lengths_per_row):
        offset = 0
        for segment, n in enumerate(lengths, 1):
            packed["targets"][r, offset:offset + n] = rng.integers(MASK_ID + 1, V, n)
            packed["targets_segmentation"][r, offset:offset + n] = segment
            packed["targets_positions"][r, offset:offset + n] = np.arange(n)
            offset += n
    return packed


def row_rngs(rows, seed=0):
    return [np.random.default_rng([seed, r]) for r in range(rows)]


# --------------------------------------------------------------------------- objectives


def test_masking_follows_bert_15_80_10_10():
    packed = packed_rows([[60, 60, 60, 60]] * 64, 256)
    batch = apply_objective(packed, "masked", row_rngs(64), mask_id=MASK_ID, vocab_size=V,
                            mask_rate=0.15)
    tokens = packed["targets"]
    real = packed["targets_segmentation"] > 0
    selected = batch["targets"] != 0
    assert not (selected & ~real).any()  # padding is never selected
    np.testing.assert_array_equal(batch["targets"][selected], tokens[selected])
    np.testing.assert_array_equal(batch["inputs"][~selected], tokens[~selected])
    rate = selected.sum() / real.sum()  # 15,360 real tokens: sd 0.003
    assert abs(rate - 0.15) < 0.012, rate
    inputs = batch["inputs"][selected]
    masked = (inputs == MASK_ID).mean()
    kept = (inputs == tokens[selected]).mean()
    random = 1.0 - masked - kept  # a random piece equal to the original counts as kept
    chance = 1.0 / (V - MASK_ID - 1)
    assert abs(masked - 0.8) < 0.03, masked  # ~2,300 selected: sd 0.008
    assert abs(kept - (0.1 + 0.1 * chance)) < 0.025, kept
    assert abs(random - 0.1 * (1 - chance)) < 0.025, random
    assert inputs[inputs != MASK_ID].min() > MASK_ID  # random pieces are never special
    for key in ("segmentation", "positions"):
        np.testing.assert_array_equal(batch[f"inputs_{key}"], packed[f"targets_{key}"])


def test_prefix_draws_a_proper_prefix_per_segment_and_the_loss_skips_it():
    packed = packed_rows([[7, 1, 12, 30], [50, 9]], 64)
    batch = apply_objective(packed, "prefix", row_rngs(2), mask_id=MASK_ID, vocab_size=V,
                            mask_rate=0.15)
    seen = set()
    for r in range(2):
        segments = packed["targets_segmentation"][r]
        prefix = batch["targets_prefix"][r]
        for segment in range(1, segments.max() + 1):
            marks = prefix[segments == segment]
            n = len(marks)
            k = int(marks.sum())
            np.testing.assert_array_equal(marks, [1] * k + [0] * (n - k))  # at the start
            assert (1 <= k <= n - 1) if n > 1 else k == 0
            seen.add(k)
        assert not prefix[segments == 0].any()
    assert len(seen) > 2  # drawn, not fixed
    weights = np.asarray(train_state.loss_weights(jax.tree.map(jnp.asarray, batch)))
    np.testing.assert_array_equal(weights, (packed["targets"] != 0) & (batch["targets_prefix"]
                                                                        == 0))


def test_cut_pieces_appends_eos_and_cuts_at_max_length():
    pieces = cut_pieces([[5, 6, 7, 8, 9], [10]], 4)
    assert [p.tolist() for p in pieces] == [[5, 6, 7, 8], [9, 3], [10, 3]]


# --------------------------------------------------------------------------- masks and model


def test_prefix_lm_mask_and_prefix_inputs_by_hand():
    mask = np.asarray(masks.make_prefix_lm_mask(jnp.array([[1, 1, 0, 0]])))[0, 0]
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0],
                                         [1, 1, 1, 1]])
    # Targets p p c c | p c c: decoder inputs BOS p p c | BOS p c; the prefix's inputs are
    # each segment's BOS and the inputs that are prefix targets.
    inputs = prefix_inputs(jnp.array([[1, 1, 0, 0, 1, 0, 0]]),
                           jnp.array([[1, 1, 1, 1, 2, 2, 2]]))
    np.testing.assert_array_equal(np.asarray(inputs), [[1, 1, 1, 0, 1, 1, 0]])


def model_logits(cfg, batch):
    params = Transformer(cfg).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32),
                                   jnp.ones((1, 4), jnp.int32))["params"]
    batch = jax.tree.map(jnp.asarray, batch)
    return np.asarray(Transformer(cfg).apply(
        {"params": params}, batch.get("inputs"), batch["targets"],
        **{k: batch[k] for k in train_state.BATCH_KEYS[2:] if k in batch}))


@pytest.mark.parametrize("objective", ["causal", "prefix", "masked"])
def test_changing_one_document_leaves_the_others_logits_unchanged(objective):
    cfg = ENCODER if objective == "masked" else DECODER
    packed = packed_rows([[9, 11, 8]], 32)
    changed = {k: v.copy() for k, v in packed.items()}
    second = packed["targets_segmentation"] == 2
    changed["targets"][second] = (packed["targets"][second] + 7 - MASK_ID) % (V - MASK_ID - 1) \
        + MASK_ID + 1
    batches = [apply_objective(p, objective, row_rngs(1), mask_id=MASK_ID, vocab_size=V,
                               mask_rate=0.5) for p in (packed, changed)]
    before, after = (model_logits(cfg, b) for b in batches)
    others = (packed["targets_segmentation"] != 2) & (packed["targets_segmentation"] > 0)
    np.testing.assert_allclose(before[others], after[others], atol=1e-5)
    assert np.abs(before[second] - after[second]).max() > 1e-2


def test_prefix_positions_see_later_prefix_tokens_and_nothing_after():
    packed = packed_rows([[12]], 16)
    batch = apply_objective(packed, "causal", [], mask_id=MASK_ID, vocab_size=V,
                            mask_rate=0.15)
    batch["targets_prefix"] = (np.arange(16) < 6).astype(np.int32)[None]  # 6 prefix targets
    later_prefix, after_prefix = ({k: v.copy() for k, v in batch.items()} for _ in range(2))
    later_prefix["targets"][0, 4] = MASK_ID + 1 + (batch["targets"][0, 4] - MASK_ID) % 50
    after_prefix["targets"][0, 9] = MASK_ID + 1 + (batch["targets"][0, 9] - MASK_ID) % 50
    base, changed_prefix, changed_after = (model_logits(DECODER, b)
                                           for b in (batch, later_prefix, after_prefix))
    # Decoder input 5 is target 4: the prefix's inputs 0..6 all see it, bidirectionally.
    assert np.abs(base[0, :5] - changed_prefix[0, :5]).max() > 1e-3
    # Decoder input 10 is target 9, after the prefix: positions up to 9 do not see it.
    np.testing.assert_allclose(base[0, :10], changed_after[0, :10], atol=1e-5)
    assert np.abs(base[0, 10:12] - changed_after[0, 10:12]).max() > 1e-3


def test_prefix_lm_prompt_in_the_cache_equals_the_full_forward_pass():
    model = Transformer(DECODER)
    params = model.init(jax.random.key(1), jnp.ones((1, 4), jnp.int32),
                        jnp.ones((1, 4), jnp.int32))["params"]
    rng = np.random.default_rng(3)
    targets = jnp.asarray(rng.integers(MASK_ID + 1, V, (2, 10)), jnp.int32)
    prefix = jnp.asarray(np.arange(10) < 4, jnp.int32)[None].repeat(2, 0)
    full = model.apply({"params": params}, None, targets, targets_prefix=prefix)
    cache = init_cache(DECODER, 2, 12)
    decoder_inputs = shift_right(targets)
    logits, cache = model.apply({"params": params}, None, None, decoder_inputs[:, :5],
                                targets_prefix=jnp.ones((2, 5), jnp.int32), cache=cache,
                                method="decode")
    stepped = [logits]
    for t in range(5, 10):
        logits, cache = model.apply({"params": params}, None, None, decoder_inputs[:, t:t + 1],
                                    cache=cache, method="decode")
        stepped.append(logits)
    np.testing.assert_allclose(np.concatenate(stepped, axis=1), full, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- sampling


def test_filter_logits_top_k_top_p_and_temperature_by_hand():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: np.asarray(decoding.filter_logits(logits, **kw)) > decoding.NEG_INF / 2  # noqa: E731
    np.testing.assert_array_equal(kept(temperature=1.0, top_k=2), [1, 1, 0, 0])
    np.testing.assert_array_equal(kept(temperature=1.0, top_p=0.5), [1, 0, 0, 0])
    np.testing.assert_array_equal(kept(temperature=1.0, top_p=0.8), [1, 1, 0, 0])
    np.testing.assert_array_equal(kept(temperature=1.0, top_p=0.81), [1, 1, 1, 0])
    np.testing.assert_array_equal(kept(temperature=1.0, top_k=3, top_p=0.6), [1, 1, 0, 0])
    np.testing.assert_allclose(decoding.filter_logits(logits, temperature=2.0), logits / 2)


TABLE = jnp.asarray(np.random.default_rng(5).normal(size=(V, V)) * 2.0, jnp.float32)


def markov_decode_fn(tokens, cache):
    """A toy decoder: the next token's logits depend on the last token only."""
    return TABLE[tokens], cache


def run_sample(rows, seed=0, **options):
    first = jnp.asarray(np.random.default_rng(9).integers(5, V, rows), jnp.int32)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed),
                                                           jnp.arange(rows))
    return np.asarray(decoding.sample(markov_decode_fn, {}, TABLE[first][:, None], keys=keys,
                                      max_length=12, eos_id=3, **options)), np.asarray(first)


def test_top_k_1_sampling_equals_greedy_and_greedy_follows_the_argmax():
    greedy, first = run_sample(8, temperature=0.0)
    top1, _ = run_sample(8, temperature=1.3, top_k=1)
    np.testing.assert_array_equal(top1, greedy)
    table = np.asarray(TABLE).copy()
    table[:, 0] = -np.inf  # padding is never chosen
    for row, token in zip(greedy, first, strict=True):
        for produced in row:
            if token == 3:  # EOS: zeros after
                assert produced == 0
                continue
            assert produced == table[token].argmax()
            token = produced


def test_sampling_matches_the_filtered_distribution_and_is_seeded():
    rows = 4000
    tokens, first = run_sample(rows, temperature=0.7, top_p=0.9)
    again, _ = run_sample(rows, temperature=0.7, top_p=0.9)
    np.testing.assert_array_equal(tokens, again)
    other_seed, _ = run_sample(rows, seed=1, temperature=0.7, top_p=0.9)
    assert (other_seed != tokens).any()
    # Rows whose previous token is the same draw from one distribution: compare frequencies.
    start = np.bincount(first).argmax()
    drawn = tokens[first == start, 0]
    logits = np.asarray(TABLE[start]).copy()
    logits[0] = -np.inf
    probs = np.asarray(jax.nn.softmax(decoding.filter_logits(
        jnp.asarray(logits), temperature=0.7, top_p=0.9)))
    counts = np.bincount(drawn, minlength=V) / len(drawn)
    assert counts[probs < 1e-6].sum() == 0  # nothing outside the nucleus
    assert np.abs(counts - probs).max() < 4 * np.sqrt(0.25 / len(drawn))


# --------------------------------------------------------------------------- data source


def test_mlm_default_is_lm_default_as_a_masked_lm():
    def flat(name):  # {"seed": 0, ..., "model.d_model": 256, ...}
        values = runpy.run_path(str(ROOT / "configs" / name))["get_config"]().to_dict()
        return {k: v for k, v in values.items() if not isinstance(v, dict)} | {
            f"{section}.{k}": v for section, keys in values.items() if isinstance(keys, dict)
            for k, v in keys.items()}

    lm = flat("lm_default.py")
    mlm = flat("mlm_default.py")
    assert set(lm) == set(mlm)
    assert {k: mlm[k] for k in lm if lm[k] != mlm[k]} == {
        "data.objective": "masked", "model.architecture": "encoder",
        "model.num_encoder_layers": 4, "model.num_decoder_layers": 0,
        "model.tie_output_embedding": True, "num_train_steps": 3000,
        "optimizer.learning_rate": 2e-3, "optimizer.warmup_steps": 200,
        "generate.max_new_tokens": 64}


@pytest.fixture(scope="module")
def lm_config(offline_fixture_data_dir, load_config):
    cfg = load_config("lm_default.py")
    cfg.data.update(dict(data_dir=str(offline_fixture_data_dir), vocab_size=200, max_length=32,
                         batch_size=8))
    cfg.model.update(dict(d_model=32, d_ff=64, num_heads=2, num_kv_heads=1,
                          num_decoder_layers=2, max_len=32))
    cfg.update(dict(num_train_steps=30, eval_every_steps=30, checkpoint_every_steps=30,
                    log_every_steps=10))
    cfg.optimizer.update(dict(warmup_steps=3, learning_rate=1e-2))
    return cfg


def test_batches_are_a_pure_function_of_the_index_and_split_by_rows(lm_config, tmp_path):

    from transformer.data.language_model import from_config

    for objective in ("causal", "masked"):
        cfg = lm_config.copy_and_resolve_references()
        cfg.data.objective = objective
        cfg.model.architecture = "encoder" if objective == "masked" else "decoder"
        cfg.model.num_encoder_layers = 2 if objective == "masked" else 0
        source = from_config(cfg, str(tmp_path / objective))
        again = from_config(cfg, str(tmp_path / objective))
        whole = source.train_batch(5, (0, 8))
        halves = [again.train_batch(5, rows) for rows in ((0, 4), (4, 8))]
        for key, value in whole.items():
            np.testing.assert_array_equal(value, np.concatenate([h[key] for h in halves], 1))
        side = "inputs" if objective == "masked" else "targets"
        segments = whole[f"{side}_segmentation"][0]
        positions = whole[f"{side}_positions"][0]
        assert (segments > 0).mean() > 0.7  # rows are filled
        for row, pos in zip(segments, positions, strict=True):
            for segment in range(1, row.max() + 1):  # contiguous, positions restart at 0
                where = np.flatnonzero(row == segment)
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                assert where[-1] - where[0] == len(where) - 1
        assert not np.array_equal(whole[side], source.train_batch(6, (0, 8))[side])
        pieces, placement = source.train_pieces(5)
        placed = [p for p, where in zip(pieces, placement, strict=True) if where is not None]
        assert sum(map(len, placed)) == (segments > 0).sum()
        evaluated = sum(int((b[f"{side}_segmentation"] > 0).sum())
                        for b in source.eval_batches("validation", (0, 8)))
        assert evaluated == sum(map(len, source._eval_plan[0]))  # every eval piece, once


def _span_config(lm_config):
    cfg = lm_config.copy_and_resolve_references()
    cfg.data.update(dict(objective="span_corruption", num_sentinels=10))
    cfg.model.update(dict(architecture="encoder_decoder", num_encoder_layers=2,
                          num_decoder_layers=2))
    return cfg


def test_span_corruption_batches_pair_inputs_and_targets_by_segment(lm_config, tmp_path):
    from transformer.data import span_corruption
    from transformer.data.language_model import from_config

    source = from_config(_span_config(lm_config), str(tmp_path))
    sentinels = source.tokenizer.sentinel_ids
    assert sentinels == list(range(5, 15))
    n = span_corruption.raw_length(32)
    noise, spans = span_corruption.span_counts(n, 0.15, 3.0)
    assert (source.source_length, source.target_length) == (32, noise + spans + 1)
    whole = source.train_batch(3, (0, 8))
    halves = [source.train_batch(3, rows) for rows in ((0, 4), (4, 8))]
    for key, value in whole.items():
        np.testing.assert_array_equal(value, np.concatenate([h[key] for h in halves], 1))
    pieces, placement = source.train_pieces(3)
    documents = source.tokenizer.encode(source._texts("train", source.batch_documents(3)))
    stream = np.concatenate(documents)  # T5's reduce_concat_tokens: no separator, no EOS
    assert [len(p) for p in pieces[:-1]] == [n] * (len(pieces) - 1) and len(pieces[-1]) <= n
    np.testing.assert_array_equal(np.concatenate(pieces), stream[:sum(map(len, pieces))])
    assert len(stream) - sum(map(len, pieces)) <= 1  # only a last piece of one token is left
    by_slot = {place[:2]: piece for piece, place in zip(pieces, placement, strict=True)
               if place is not None}
    rebuilt = 0
    for r in range(8):
        ins = whole["inputs"][0, r]
        outs = whole["targets"][0, r]
        in_seg = whole["inputs_segmentation"][0, r]
        out_seg = whole["targets_segmentation"][0, r]
        assert set(np.unique(in_seg)) - {0} == set(np.unique(out_seg)) - {0}
        for segment in range(1, in_seg.max() + 1):
            x = ins[in_seg == segment]
            y = outs[out_seg == segment]
            assert x[-1] == y[-1] == 3 and y[0] == sentinels[0]  # EOS ends both sides
            spans_here = {}  # rebuild the piece: each sentinel in x replaced by its span in y
            cut = np.flatnonzero(np.isin(y, sentinels))
            for start, stop in zip(cut, list(cut[1:]) + [len(y) - 1], strict=True):
                spans_here[y[start]] = y[start + 1:stop].tolist()
            tokens = [t for i in x[:-1].tolist() for t in spans_here.get(i, [i])]
            offset = np.flatnonzero(in_seg == segment)[0]
            np.testing.assert_array_equal(tokens, by_slot[(r, offset)])
            rebuilt += 1
    assert rebuilt == sum(place is not None for place in placement)
    assert not np.array_equal(whole["inputs"], source.train_batch(4, (0, 8))["inputs"])


# --------------------------------------------------------------------------- end to end


def train_lm(cfg, workdir, objective):
    from transformer.training.loop import train_and_evaluate

    cfg = cfg.copy_and_resolve_references()
    cfg.data.objective = objective
    if objective == "masked":
        cfg.model.update(dict(architecture="encoder", num_encoder_layers=2, num_decoder_layers=0,
                              tie_output_embedding=True))
    if objective == "span_corruption":
        cfg = _span_config(cfg)
    train_and_evaluate(cfg, str(workdir))
    with open(workdir / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return ({line["step"]: line["loss"] for line in lines if line["split"] == "train"},
            [line for line in lines if line["split"] == "validation"])


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["causal", "prefix", "masked", "span_corruption"])
def test_loss_decreases_on_tiny_data(lm_config, tmp_path, objective):
    losses, validation = train_lm(lm_config, tmp_path, objective)
    assert sorted(losses) == list(range(1, 31))
    first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in
                                                                    (28, 29, 30)])
    assert last < first - 0.75, (first, last)
    assert validation[-1]["step"] == 30 and validation[-1]["perplexity"] < np.exp(first)


@pytest.mark.slow
def test_generate_cli_is_seeded_and_batch_independent(lm_config, tmp_path):

    from transformer.inference.generator import load_generator

    train_lm(lm_config, tmp_path, "causal")
    generator = load_generator(str(tmp_path))
    prompts = ["Opens a dialog", "Specifies whether", "Opens a dialog"]
    options = dict(max_new_tokens=8, temperature=1.0, top_k=20, seed=3)
    texts = generator.generate(prompts, **options)
    assert all(t.startswith(p) for t, p in zip(texts, prompts, strict=True))
    assert generator.generate(prompts, **options) == texts  # seeded
    assert generator.generate(prompts[:1], **options)[0] == texts[0]  # batch independent
    greedy = generator.generate(prompts, max_new_tokens=8, temperature=0.0)
    assert greedy[0] == greedy[2]
    assert generator.generate(prompts, max_new_tokens=8, temperature=0.5, top_k=1) == greedy

    env = subprocess_env()
    cli = subprocess.run([sys.executable, "-m", "transformer.generate", f"--workdir={tmp_path}",
                          "--max_new_tokens=8", "--temperature=0"], input=b"Opens a dialog\n",
                         capture_output=True, cwd=ROOT, env=env, timeout=300)
    assert cli.returncode == 0, cli.stderr.decode()[-2000:]
    assert cli.stdout.decode() == greedy[0] + "\n"
    empty = subprocess.run([sys.executable, "-m", "transformer.generate",
                            f"--workdir={tmp_path}"], input=b"", capture_output=True, cwd=ROOT,
                           env=env, timeout=300)
    assert empty.returncode != 0
    assert empty.stderr.decode().strip().splitlines()[-1] == (
        "error: no prompt: pass --prompt=... or one prompt a line on stdin")
    translate = subprocess.run([sys.executable, "-m", "transformer.translate",
                                f"--workdir={tmp_path}"], input=b"Hello\n", capture_output=True,
                               cwd=ROOT, env=env, timeout=300)
    assert translate.returncode != 0
    assert translate.stderr.decode().strip().splitlines()[-1] == (
        f"error: {tmp_path} holds a language model (model.architecture='decoder'), not a "
        f"translation model: continue text with python -m transformer.generate; its perplexity "
        f"is in metrics.jsonl")


def test_generation_refuses_a_translation_run(untrained_translation_workdir):
    from transformer.inference.generator import load_generator

    with pytest.raises(ValueError, match="generation needs a decoder-only model; this run's "
                       "model.architecture is 'encoder_decoder'"):
        load_generator(str(untrained_translation_workdir))


@pytest.mark.parametrize("name, eval_split", [("lm1b", "test"), ("c4/en", "validation")])
def test_tfds_text_datasets_give_packed_rows_of_their_text(name, eval_split, tmp_path):
    import tensorflow_datasets as tfds

    from transformer.data.language_model import LanguageModelSource

    with tfds.testing.mock_data(num_examples=200, policy=tfds.testing.MockPolicy.USE_CODE):
        source = LanguageModelSource(name, objective="causal", vocab_size=120, max_length=32,
                                     batch_size=4, eval_split=eval_split, eval_documents=20,
                                     data_dir=str(tmp_path))
        assert source.keys == ["text"]  # c4's url and timestamp are not modelled
        assert source.validation_split == eval_split  # what the training loop evaluates
        assert source.num_train_documents == 200
        batch = source.train_batch(3, (0, 4))
        assert batch["targets"].shape == (1, 4, 32)
        assert (batch["targets_segmentation"] > 0).mean() > 0.7
        assert sum(1 for _ in source.eval_batches(eval_split, (0, 4))) >= 1
