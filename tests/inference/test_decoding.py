"""Greedy and beam search on a tiny random model: against step-by-step full forward passes,
exhaustive search under the length penalty, and the GNMT formula."""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.inference import decoding
from transformer.model.transformer import (
    BOS_ID,
    Transformer,
    TransformerConfig,
    grow_cache,
    init_cache,
)
from transformer.ops import kv_cache

EOS = 3
CFG = TransformerConfig(vocab_size=6, num_encoder_layers=1, num_decoder_layers=2, d_model=16,
                        d_ff=32, num_heads=2, max_len=16, dropout_rate=0.0)


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG)
    inputs = jnp.array([[4, 5, 1, 4, 2], [5, 5, 4, 0, 0]], jnp.int32)
    params = nn.unbox(model.init(jax.random.key(0), inputs, inputs))["params"]
    # Sharpen the output distribution so that searches differ from sampling noise.
    params = jax.tree.map(lambda p: p * 1.5, params)
    encoded = model.apply({"params": params}, inputs, method="encode")
    return model, params, inputs, encoded


def decode_fn_for(model, params, encoded, inputs, repeat=1):
    encoded, inputs = jnp.repeat(encoded, repeat, 0), jnp.repeat(inputs, repeat, 0)

    def decode_fn(tokens, cache):
        return model.apply({"params": params}, encoded, inputs, tokens, cache=cache,
                           method="decode")

    return decode_fn


def sequence_logprob(model, params, encoded, inputs, row, seq):
    """log P(seq | inputs[row]) by one teacher-forced forward pass, with EOS forced at the
    last allowed position as the searches do (other tokens are not renormalised away)."""
    targets = jnp.array([seq], jnp.int32)
    logits, _ = model.apply({"params": params}, encoded[row:row + 1], inputs[row:row + 1],
                            targets, method="decode")
    logprobs = jax.nn.log_softmax(logits[0].astype(jnp.float32))
    return float(sum(logprobs[t, token] for t, token in enumerate(seq)))


def test_write_cache_writes_at_the_index_in_the_caches_dtype():
    rng = np.random.default_rng(0)
    cache = {"key": jnp.zeros((2, 3, 5, 4), jnp.bfloat16),  # [B, K, S, H]
             "value": jnp.ones((2, 3, 5, 6), jnp.bfloat16)}
    key = rng.normal(size=(2, 2, 3, 4))  # [B, T, K, H]
    value = rng.normal(size=(2, 2, 3, 6))
    out = jax.jit(kv_cache.write_cache)(cache, jnp.asarray(key, jnp.float32),
                                        jnp.asarray(value, jnp.float32), jnp.asarray(2))
    expected_key = np.zeros((2, 3, 5, 4))
    expected_value = np.ones((2, 3, 5, 6))
    expected_key[:, :, 2:4] = key.transpose(0, 2, 1, 3)
    expected_value[:, :, 2:4] = value.transpose(0, 2, 1, 3)
    assert out["key"].dtype == out["value"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out["key"], np.float32), expected_key, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(out["value"], np.float32), expected_value, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(out["key"][:, :, [0, 1, 4]], np.float32), 0.0)


def test_write_ring_keeps_the_newest_position_of_each_slot():
    """A ring of C = 3 slots, heads first: position p goes to slot p % 3, the newer of two new
    positions for one slot wins, a position of -1 (not to remember) leaves its slot alone."""
    ring = {"key": jnp.full((1, 2, 3, 1), -1.0), "value": jnp.full((1, 2, 3, 1), -1.0),
            "position": jnp.full((1, 3), -1, jnp.int32)}
    positions = jnp.array([[0, 1, 2, 3, -1]], jnp.int32)
    key = jnp.arange(10.0).reshape(1, 5, 2, 1)  # token t, head k: 2t + k
    out = jax.jit(kv_cache.write_ring)(ring, key, -key, positions)
    np.testing.assert_array_equal(out["position"], [[3, 1, 2]])
    np.testing.assert_array_equal(out["key"][0, :, :, 0], [[6, 2, 4], [7, 3, 5]])
    np.testing.assert_array_equal(out["value"][0, :, :, 0], -out["key"][0, :, :, 0])


def test_length_penalty_is_gnmt():
    lengths = jnp.arange(1, 8)
    np.testing.assert_allclose(decoding.length_penalty(lengths, 0.6),
                               ((5.0 + np.arange(1, 8)) / 6.0) ** 0.6, rtol=1e-6)
    np.testing.assert_allclose(decoding.length_penalty(lengths, 0.0), 1.0)


def test_greedy_equals_argmax_of_full_forward_passes(setup):
    model, params, inputs, encoded = setup
    max_length = 6
    run = jax.jit(lambda enc, inp: decoding.greedy_search(
        decode_fn_for(model, params, enc, inp), init_cache(CFG, 2, max_length),
        bos=jnp.full((2,), BOS_ID), max_lengths=jnp.array([6, 4]), max_length=max_length,
        eos_id=EOS))
    tokens = np.asarray(run(encoded, inputs))
    for row, limit in enumerate([6, 4]):
        seq = []
        while len(seq) < limit:
            logits, _ = model.apply({"params": params}, encoded[row:row + 1],
                                    inputs[row:row + 1], jnp.array([seq + [1]], jnp.int32),
                                    method="decode")
            logprobs = np.array(jax.nn.log_softmax(logits[0, len(seq)]))
            logprobs[0] = -np.inf  # padding is never decoded
            if len(seq) == limit - 1:
                logprobs[np.arange(CFG.vocab_size) != EOS] = -np.inf
            seq.append(int(np.argmax(logprobs)))
            if seq[-1] == EOS:
                break
        expected = seq + [0] * (max_length - len(seq))
        np.testing.assert_array_equal(tokens[row], expected)


def staged(max_length, stage):
    """The keyword arguments of a staged search (stage 0: the whole cache from the start) and
    the length of the cache to start with."""
    if not stage:
        return {}, max_length
    lengths = decoding.stage_lengths(max_length, stage)
    return {"cache_lengths": lengths, "grow_cache": functools.partial(grow_cache, CFG)}, lengths[0]


def run_beam(setup, beam_size, alpha, max_lengths, max_length, shared_encoder=False, stage=0):
    """Beam search's (hypotheses [B, W, T], scores [B, W]); `shared_encoder`: the beams read
    their sentence's one encoder row (as the translator runs it), else a copy per beam."""
    model, params, inputs, encoded = setup
    stages, first_length = staged(max_length, stage)
    run = jax.jit(lambda enc, inp: decoding.beam_search(
        decode_fn_for(model, params, enc, inp, repeat=1 if shared_encoder else beam_size),
        init_cache(CFG, 2 * beam_size, first_length), bos=jnp.full((2,), BOS_ID),
        max_lengths=jnp.array(max_lengths), max_length=max_length, beam_size=beam_size,
        alpha=alpha, eos_id=EOS, **stages))
    seqs, scores = run(encoded, inputs)
    return np.asarray(seqs), np.asarray(scores)


def test_beam_of_one_equals_greedy_without_length_penalty(setup):
    model, params, inputs, encoded = setup
    greedy = decoding.greedy_search(
        decode_fn_for(model, params, encoded, inputs), init_cache(CFG, 2, 6),
        bos=jnp.full((2,), BOS_ID), max_lengths=jnp.array([6, 5]), max_length=6, eos_id=EOS)
    seqs, _ = run_beam(setup, 1, 0.0, [6, 5], 6)
    np.testing.assert_array_equal(seqs[:, 0], np.asarray(greedy))


@pytest.mark.parametrize("alpha", [0.6, 2.0])
def test_wide_beam_finds_the_exhaustive_optimum_under_the_length_penalty(setup, alpha):
    model, params, inputs, encoded = setup
    max_length = 3
    non_eos = [t for t in range(1, CFG.vocab_size) if t != EOS]  # padding is never decoded
    candidates = [list(prefix) + [EOS] for n in range(max_length)
                  for prefix in itertools.product(non_eos, repeat=n)]
    beam_size = len(candidates)  # every candidate fits in the beam at every step
    seqs, scores = run_beam(setup, beam_size, alpha, [max_length, max_length], max_length)
    for row in range(2):
        scored = sorted(((sequence_logprob(model, params, encoded, inputs, row, c)
                          / ((5 + len(c)) / 6) ** alpha, c) for c in candidates), reverse=True)
        best_score, best = scored[0]
        np.testing.assert_array_equal(seqs[row, 0], best + [0] * (max_length - len(best)))
        np.testing.assert_allclose(scores[row, 0], best_score, rtol=1e-5)
        # The W best finished hypotheses are the W best of all candidates, in order.
        np.testing.assert_allclose(scores[row, :5], [s for s, _ in scored[:5]], rtol=1e-5)


def test_beam_respects_each_sentences_maximum_length(setup):
    seqs, scores = run_beam(setup, 4, 0.6, [5, 2], 5)
    assert np.isfinite(scores).all()
    for row, limit in enumerate([5, 2]):
        for hyp in seqs[row]:
            length = int(np.argmax(hyp == EOS)) + 1
            assert hyp[length - 1] == EOS and length <= limit
            assert (hyp[length:] == 0).all()
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first


def test_beams_follow_their_origin_and_rows_per_sentence_stay():
    beams = jnp.arange(4.0)[:, None]  # 2 sentences x 2 beams
    sentences = jnp.arange(2.0)[:, None]  # the encoder keys of 2 sentences, shared by beams
    cache = {"layers_0": {"self_attention": {"key": beams},
                          "cross_attention": {"key": sentences}}}
    origin = jnp.array([[1, 1], [0, 0]])  # both beams continue beam 1, resp. beam 0
    out = decoding._gather_beams(cache, origin, 2, 2, 0)
    np.testing.assert_array_equal(out["layers_0"]["self_attention"]["key"][:, 0], [1, 1, 2, 2])
    np.testing.assert_array_equal(out["layers_0"]["cross_attention"]["key"][:, 0], [0, 1])


def test_beams_sharing_their_sentences_encoder_rows_change_no_hypothesis(setup):
    copied = run_beam(setup, 3, 0.6, [6, 4], 6)
    shared = run_beam(setup, 3, 0.6, [6, 4], 6, shared_encoder=True)
    np.testing.assert_array_equal(shared[0], copied[0])
    np.testing.assert_allclose(shared[1], copied[1], rtol=1e-6)


def test_stage_lengths_end_at_the_maximum():
    assert decoding.stage_lengths(40, 16) == (16, 32, 40)
    assert decoding.stage_lengths(32, 16) == (16, 32)
    assert decoding.stage_lengths(5, 16) == (5,)
    with pytest.raises(ValueError, match="stage=0"):
        decoding.stage_lengths(8, 0)


def test_grow_cache_pads_the_self_attention_positions_and_keeps_the_rest():
    cache = init_cache(CFG, 3, 4)
    cache["layers_0"]["self_attention"]["key"] = jnp.ones_like(
        cache["layers_0"]["self_attention"]["key"])
    grown = grow_cache(CFG, cache, 9)
    key = np.asarray(grown["layers_0"]["self_attention"]["key"])  # [B, K, S, H]
    assert key.shape == (3, CFG.num_kv_heads or CFG.num_heads, 9, CFG.d_model // CFG.num_heads)
    assert (key[:, :, :4] == 1).all() and (key[:, :, 4:] == 0).all()
    assert grown["layers_1"]["self_attention"]["value"].shape[2] == 9
    assert grown["layers_1"]["cross_attention"] == {} and int(grown["index"]) == 0
    with pytest.raises(ValueError, match="holds 9 positions, more than max_length=4"):
        grow_cache(CFG, grown, 4)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_staged_search_decodes_what_the_whole_cache_decodes(setup, stage):
    """Greedy and beam search whose cache starts at `stage` positions and grows give the same
    tokens and scores as with all max_length positions from the start."""
    model, params, inputs, encoded = setup
    max_length = 7
    limits = jnp.array([7, 4])
    greedy = {}
    for s in (0, stage):
        stages, first_length = staged(max_length, s)
        greedy[s] = np.asarray(jax.jit(lambda enc, inp, stages=stages, n=first_length:
                                   decoding.greedy_search(
            decode_fn_for(model, params, enc, inp), init_cache(CFG, 2, n),
            bos=jnp.full((2,), BOS_ID), max_lengths=limits, max_length=max_length,
            eos_id=EOS, **stages))(encoded, inputs))
    np.testing.assert_array_equal(greedy[stage], greedy[0])
    whole = run_beam(setup, 3, 0.6, [7, 4], max_length)
    grown = run_beam(setup, 3, 0.6, [7, 4], max_length, stage=stage)
    np.testing.assert_array_equal(grown[0], whole[0])
    np.testing.assert_allclose(grown[1], whole[1], rtol=1e-6)
    assert (whole[0] != 0).sum(axis=-1).max() > stage  # a hypothesis went past the first stage


def test_a_search_continued_on_selected_sentences_is_theirs(setup):
    """Run in parts (up to steps 2, 5, 8, then the end; the cache grown at the stage ends),
    with the state cut to sentences [1, 0, 1] after step 2 (a reorder and a repeat, as the
    translator pads its rows), the search ends with exactly the full search's hypotheses and
    scores of those sentences, and none of them open."""
    model, params, inputs, encoded = setup
    beam = 3
    alpha = 0.6
    max_lengths = jnp.array([9, 7])
    max_length = 9
    seqs, scores = run_beam(setup, beam, alpha, [9, 7], max_length, shared_encoder=True,
                            stage=3)
    assert decoding.stage_lengths(max_length, 3) == (3, 6, 9)
    assert [decoding.stage_end(n, max_length) for n in (3, 6, 9)] == [2, 5, 9]
    rules = dict(max_length=max_length, beam_size=beam, alpha=alpha, eos_id=EOS)
    state = decoding.beam_search_start(
        decode_fn_for(model, params, encoded, inputs), init_cache(CFG, 2 * beam, 3),
        bos=jnp.full((2,), BOS_ID), beam_size=beam, max_length=max_length)
    state = decoding.beam_search_steps(decode_fn_for(model, params, encoded, inputs), state,
                                       until=2, max_lengths=max_lengths, **rules)
    assert int(state["step"]) == 2
    sentences = jnp.array([1, 0, 1])
    state = decoding.select_sentences(state, sentences, beam_size=beam)
    selected = decode_fn_for(model, params, encoded[sentences], inputs[sentences])
    for length, until in ((6, 5), (9, 8), (9, 9)):
        state = {**state, "cache": grow_cache(CFG, state["cache"], length)}
        state = decoding.beam_search_steps(selected, state, until=jnp.asarray(until),
                                           max_lengths=max_lengths[sentences], **rules)
    np.testing.assert_array_equal(state["finished_seqs"], seqs[[1, 0, 1]])
    # rtol: these steps run eagerly, the full search jitted (float sums rounded differently)
    np.testing.assert_allclose(state["finished_scores"], scores[[1, 0, 1]], rtol=1e-5)
    assert not decoding.beam_search_open(state, max_lengths=max_lengths[sentences],
                                         alpha=alpha).any()


def test_select_sentences_takes_rows_along_the_scanned_layers_batch_axis():
    """With scanned layers the cache's batch axis is 1: per-beam leaves [L, B*W, ...] take the
    selected sentences' W rows, per-sentence leaves [L, B, ...] their rows, the index stays."""
    batch = 3
    beam = 2
    state = {"step": jnp.asarray(4),
             "alive_seqs": jnp.arange(batch)[:, None, None] * jnp.ones((batch, beam, 5)),
             "alive_logprobs": jnp.arange(batch * beam, dtype=jnp.float32).reshape(batch, beam),
             "finished_seqs": jnp.zeros((batch, beam, 5), jnp.int32),
             "finished_scores": jnp.zeros((batch, beam)),
             "logits": jnp.arange(batch * beam, dtype=jnp.float32).reshape(-1, 1, 1),
             "cache": {"self_attention": {"key": jnp.arange(2.0 * batch * beam).reshape(
                           2, batch * beam, 1, 1, 1)},
                       "cross_attention": {"key": jnp.arange(2.0 * batch).reshape(2, batch, 1)},
                       "index": jnp.asarray(4)}}
    out = decoding.select_sentences(state, jnp.array([2, 0, 2]), beam_size=beam,
                                    cache_batch_axis=1)
    np.testing.assert_array_equal(out["alive_seqs"][:, 0, 0], [2, 0, 2])
    np.testing.assert_array_equal(out["logits"][:, 0, 0], [4, 5, 0, 1, 4, 5])
    np.testing.assert_array_equal(out["cache"]["self_attention"]["key"][:, :, 0, 0, 0],
                                  [[4, 5, 0, 1, 4, 5], [10, 11, 6, 7, 10, 11]])
    np.testing.assert_array_equal(out["cache"]["cross_attention"]["key"][:, :, 0],
                                  [[2, 0, 2], [5, 3, 5]])
    assert int(out["cache"]["index"]) == 4 and int(out["step"]) == 4


def test_a_hypothesis_ends_at_any_listed_end():
    """A decoder whose next token depends only on the step (token 4, then 5, then 4 ...):
    with 5 a further end (`stop_ids`, as an imported generation config's second eos id) the
    greedy and beam searches stop at it, scored as it ends (log P(4) + log P(5) over the
    penalty of 2 tokens), every finished hypothesis at its first end; without it, both go on
    to the EOS forced at the limit."""
    logprobs = np.log(np.array([[.01, .01, .01, .001, .8, .169],  # step 0: 4
                                [.01, .01, .01, .001, .169, .8],  # step 1: 5
                                [.01, .01, .01, .001, .8, .169]]))  # then: 4 ...

    def decode_fn(tokens, step):
        rows = jnp.asarray(logprobs)[jnp.minimum(step, 2)]
        return jnp.broadcast_to(rows, (tokens.shape[0], 1, 6)), step + 1

    search = dict(bos=jnp.full((1,), BOS_ID), max_lengths=jnp.array([5]), max_length=5,
                  eos_id=EOS)
    beam = dict(search, beam_size=2, alpha=0.6)
    for stops, expected in (((5,), [4, 5, 0, 0, 0]), ((), [4, 5, 4, 4, EOS])):
        greedy = decoding.greedy_search(decode_fn, jnp.asarray(0), stop_ids=stops, **search)
        np.testing.assert_array_equal(greedy[0], expected)
        seqs, scores = decoding.beam_search(decode_fn, jnp.asarray(0), stop_ids=stops, **beam)
        np.testing.assert_array_equal(seqs[0, 0], expected)
    seqs, scores = decoding.beam_search(decode_fn, jnp.asarray(0), stop_ids=(5,), **beam)
    np.testing.assert_allclose(scores[0, 0], np.log(.8 * .8) / ((5 + 2) / 6) ** 0.6,
                               rtol=1e-6)
    for hyp in seqs[0]:  # every finished hypothesis stops at its first end
        ends = np.flatnonzero(np.isin(hyp, [EOS, 5]))
        assert len(ends) and (hyp[ends[0] + 1:] == 0).all(), hyp
    assert decoding.before_end(np.array([4, 5, 0]), (EOS, 5)) == [4]
