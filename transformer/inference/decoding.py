"""Greedy search, beam search and sampling over an explicit KV cache, as pure functions
(jit-compatible).

`decode_fn(tokens [R, 1], cache) -> (logits [R, 1, V], cache)` runs one decoder step for R rows
(R = B for greedy, B * W for beam search, rows of one sentence adjacent). The first call receives
the BOS tokens and the freshly initialised cache (it may add entries, e.g. the projected encoder
output). Later calls run inside `lax.while_loop`.

Beam search follows the paper (section 6.1): beam size W, length penalty
lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016) applied to finished hypotheses, the maximum
output length input length + 50 per sentence, and early termination: a sentence stops when no
alive hypothesis can still beat its best finished one. Each step expands the W alive hypotheses
into their 2W best continuations. Those among the best W that end in EOS finish (as in fairseq),
the best W that do not stay alive. Every search also ends a hypothesis at any id of `stop_ids`
(the further ends an imported checkpoint's generation config lists, as `transformers`'
`generate` with a list `eos_token_id`). The end forced at the length limit is `eos_id` (as
Marian's `forced_eos_token_id`).

Sampling (language models) draws each token from softmax(logits / temperature), restricted to
the `top_k` most likely tokens and to the smallest set whose probability reaches `top_p`
(nucleus sampling, Holtzman et al., 2019). Temperature 0 is greedy. Each row has its own key,
so a row's tokens do not depend on the other rows of its batch.

Staged searches: the caller may start with a short self-attention cache and give the lengths
it grows through (`stage_lengths`) and a `grow_cache(cache, length)` (`transformer.grow_cache`). The
search then runs one `lax.while_loop` per length, so that each step attends over, and beam
search reorders, only the current stage's cache positions, not all T. The tokens are the same as
with the whole cache from the start. A caller may also run a beam search in parts itself
(`beam_search_start`, then `beam_search_steps` up to a step, growing the cache when
`stage_end` says) and between them go on with only some of the sentences (`beam_search_open`
says which are undecided, `select_sentences` keeps them): `Translator` drops the decided
ones, as fairseq shrinks its batch.

The model's side of the cache, a step's keys and values written at their positions, is
`transformer.ops.kv_cache`. Shapes are written in the package's
legend (`transformer/__init__.py`); T is the maximum output length.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data.tokenizer import PAD_ID  # never a target, so never decoded

NEG_INF = -1.0e9  # finite, so that NEG_INF - NEG_INF stays 0
DecodeFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]
GrowFn = Callable[[Any, int], Any]


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
    """GNMT's ((5 + |Y|) / 6)^alpha."""
    return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


def _next_logprobs(logits: jax.Array, step: jax.Array, max_lengths: jax.Array, eos_id: int):
    """log P(next token) [B, V] from logits [B*r, 1, V] (r rows per sentence): padding is never
    chosen, and at a row's last allowed position only EOS may follow (not renormalised)."""
    logprobs = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32))
    logprobs = logprobs.reshape(max_lengths.shape[0], -1, logprobs.shape[-1])
    ids = jnp.arange(logprobs.shape[-1])
    last = (step + 1 >= max_lengths)[:, None, None]
    banned = (ids == PAD_ID) | (last & (ids != eos_id))
    return jnp.where(banned, NEG_INF, logprobs)


def stage_lengths(max_length: int, stage: int) -> tuple[int, ...]:
    """The cache lengths of a staged search: stage, 2 * stage, ..., then max_length."""
    if stage <= 0:
        raise ValueError(f"stage={stage}: give a positive number of positions per stage")
    return tuple(range(stage, max_length, stage)) + (max_length,)


def _in_stages(cond: Callable[[dict], jax.Array], body: Callable[[dict], dict], state: dict, *,
               max_length: int, cache_lengths: Sequence[int], grow_cache: GrowFn | None) -> dict:
    """`lax.while_loop(cond, body, state)`, run as one loop per cache length when
    `cache_lengths` are given, each up to its `stage_end`. The last length is T, whose loop
    runs to the end."""
    if not cache_lengths:
        return jax.lax.while_loop(cond, body, state)
    if cache_lengths[-1] != max_length or grow_cache is None:
        raise ValueError(f"cache_lengths {tuple(cache_lengths)} must end at max_length="
                         f"{max_length} and come with grow_cache")
    for length in cache_lengths:
        state = {**state, "cache": grow_cache(state["cache"], length)}
        state = _until(cond, body, state, stage_end(length, max_length))
    return state


def stage_end(cache_length: int, max_length: int) -> int:
    """The step a staged search stops at before its cache must grow past `cache_length`: the
    step that would write at position n (step n - 1) needs a cache longer than n. A cache of
    T positions takes the search to its end (the last step's write is clamped, and its logits
    unused)."""
    return cache_length - 1 if cache_length < max_length else max_length


def _until(cond: Callable[[dict], jax.Array], body: Callable[[dict], dict], state: dict,
           until: jax.Array | int) -> dict:
    """`lax.while_loop` while `cond` holds and the step is below `until` (traced or not)."""
    return jax.lax.while_loop(lambda s: cond(s) & (s["step"] < until), body, state)


def greedy_search(decode_fn: DecodeFn, cache: Any, *, bos: jax.Array, max_lengths: jax.Array,
                  max_length: int, eos_id: int, stop_ids: Sequence[int] = (),
                  cache_lengths: Sequence[int] = (),
                  grow_cache: GrowFn | None = None) -> jax.Array:
    """Tokens [B, T] (T = max_length), each row ending at its first EOS or id of `stop_ids`,
    zeros after.

    `bos` [B] holds the start tokens, `max_lengths` [B] each row's output limit (<= T).
    `cache_lengths` and `grow_cache`: a staged search (module docstring).
    """
    logits, cache = decode_fn(bos[:, None], cache)

    def choose(logits, step):
        logprobs = _next_logprobs(logits, step, max_lengths, eos_id)[:, 0]
        return jnp.argmax(logprobs, axis=-1).astype(jnp.int32)

    return _token_by_token(decode_fn, cache, logits, choose, max_length=max_length,
                           eos_ids=(eos_id, *stop_ids), cache_lengths=cache_lengths,
                           grow_cache=grow_cache)


def _token_by_token(decode_fn: DecodeFn, cache: Any, logits: jax.Array,
                    choose: Callable[[jax.Array, jax.Array], jax.Array], *, max_length: int,
                    eos_ids: Sequence[int], cache_lengths: Sequence[int] = (),
                    grow_cache: GrowFn | None = None) -> jax.Array:
    """Tokens [B, T]: `choose(logits [B, 1, V], step) -> [B]` picks each row's next token from
    the last logits, `decode_fn` feeds it back. A row stops at its first id of `eos_ids` (zeros
    after), the loop when every row has or at T tokens."""
    batch = logits.shape[0]
    ends = jnp.asarray(tuple(eos_ids), jnp.int32)  # a few static ids

    def body(state):
        step = state["step"]
        finished = state["finished"]
        token = jnp.where(finished, 0, choose(state["logits"], step))
        logits, cache = decode_fn(token[:, None], state["cache"])
        return {"step": step + 1, "tokens": state["tokens"].at[:, step].set(token),
                "finished": finished | jnp.isin(token, ends), "logits": logits, "cache": cache}

    def cond(state):
        return (state["step"] < max_length) & ~state["finished"].all()

    init = {"step": jnp.zeros((), jnp.int32), "tokens": jnp.zeros((batch, max_length), jnp.int32),
            "finished": jnp.zeros((batch,), bool), "logits": logits, "cache": cache}
    return _in_stages(cond, body, init, max_length=max_length, cache_lengths=cache_lengths,
                      grow_cache=grow_cache)["tokens"]


def before_end(row: np.ndarray, eos_ids: Sequence[int]) -> list[int]:
    """The tokens of a finished `row` before its first id of `eos_ids` (all of them without
    one)."""
    ends = np.flatnonzero(np.isin(row, eos_ids))
    return row[:ends[0] if ends.size else len(row)].tolist()


def _gather_beams(tree: Any, indices: jax.Array, batch: int, beam: int, batch_axis: int):
    """Reorders the rows of every cache leaf [.., B*W, ..] (batch axis `batch_axis`) so that row
    (b, w) takes row (b, indices[b, w]). With W > 1, leaves with one row per sentence (the
    cross-attention keys and values the beams share) are left as they are."""
    flat = (indices + beam * jnp.arange(batch)[:, None]).reshape(-1)

    def gather(leaf):
        if leaf.ndim <= batch_axis or leaf.shape[batch_axis] != batch * beam:
            return leaf
        return jnp.take(leaf, flat, axis=batch_axis)

    return jax.tree.map(gather, tree)


def beam_search(decode_fn: DecodeFn, cache: Any, *, bos: jax.Array, max_lengths: jax.Array,
                max_length: int, beam_size: int, alpha: float, eos_id: int,
                stop_ids: Sequence[int] = (), cache_batch_axis: int = 0,
                cache_lengths: Sequence[int] = (),
                grow_cache: GrowFn | None = None,
                ) -> tuple[jax.Array, jax.Array]:
    """Finished hypotheses [B, W, T] and their scores [B, W] (log-probability over the length
    penalty), best first. Rows end at EOS (forced at `max_lengths` [B]) or an id of `stop_ids`,
    zeros after.

    `decode_fn` works on B * W rows (sentence b's beams are rows b*W .. b*W+W-1); `bos` [B]
    holds the start tokens. The cache leaves with B * W rows along `cache_batch_axis` (1 when
    layers are scanned) follow their beams at every step. With W > 1 those with B rows (the
    encoder keys and values that a sentence's beams share: `Transformer.decode` with one encoder row
    per sentence) stay in place.
    `cache_lengths` and `grow_cache`: a staged search (module docstring). A caller that runs
    the stages itself, between them dropping the sentences already decided, composes
    `beam_search_start`, `beam_search_steps`, `beam_search_open` and `select_sentences`.
    """
    state = beam_search_start(decode_fn, cache, bos=bos, beam_size=beam_size,
                              max_length=max_length)
    rules = _BeamRules(max_lengths, max_length, beam_size, alpha, eos_id, tuple(stop_ids),
                       cache_batch_axis)
    state = _in_stages(rules.undecided, functools.partial(rules.expand, decode_fn), state,
                       max_length=max_length, cache_lengths=cache_lengths,
                       grow_cache=grow_cache)
    return state["finished_seqs"], state["finished_scores"]


def beam_search_start(decode_fn: DecodeFn, cache: Any, *, bos: jax.Array, beam_size: int,
                      max_length: int) -> dict:
    """A beam search's state before its first step: the logits after BOS (`decode_fn`'s first
    call, on B * W rows), the cache, no hypotheses yet."""
    batch = bos.shape[0]
    logits, cache = decode_fn(jnp.repeat(bos, beam_size)[:, None], cache)
    return {
        "step": jnp.zeros((), jnp.int32),
        "alive_seqs": jnp.zeros((batch, beam_size, max_length), jnp.int32),
        # All beams start identical: only beam 0 may expand at the first step.
        "alive_logprobs": jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam_size - 1)), (batch, 1)),
        "finished_seqs": jnp.zeros((batch, beam_size, max_length), jnp.int32),
        "finished_scores": jnp.full((batch, beam_size), NEG_INF),
        "logits": logits,
        "cache": cache,
    }


def beam_search_steps(decode_fn: DecodeFn, state: dict, *, until: jax.Array | int,
                      max_lengths: jax.Array, max_length: int, beam_size: int, alpha: float,
                      eos_id: int, stop_ids: Sequence[int] = (),
                      cache_batch_axis: int = 0) -> dict:
    """Steps of a beam search that its caller runs in parts (`beam_search`'s arguments): from
    `state` while some sentence is open, up to step `until` (exclusive; a traced value does
    not recompile). The cache must be long enough (`stage_end`; the caller grows it). Run
    to step T, the result is `beam_search`'s."""
    rules = _BeamRules(max_lengths, max_length, beam_size, alpha, eos_id, tuple(stop_ids),
                       cache_batch_axis)
    return _until(rules.undecided, functools.partial(rules.expand, decode_fn), state, until)


def beam_search_open(state: dict, *, max_lengths: jax.Array, alpha: float) -> jax.Array:
    """[B] whether each sentence is still undecided: below its step limit, and its best alive
    hypothesis could still beat its best finished one (its log-probability can only fall, and
    the penalty is largest at the maximum length, for alpha >= 0). A decided sentence's best
    hypothesis no longer changes (up to float rounding: a search that drops rows computes the
    others' logits in batches of another shape)."""
    best_possible = state["alive_logprobs"][:, 0] / length_penalty(max_lengths, alpha)
    return (best_possible > state["finished_scores"][:, 0]) & (state["step"] < max_lengths)


def select_sentences(state: dict, sentences: jax.Array, *, beam_size: int,
                     cache_batch_axis: int = 0) -> dict:
    """The state of a beam search over the sentences `sentences` [B'] (indices, repeats
    allowed) of `state`'s B: their hypotheses, logits and cache rows (B * W rows, or B shared
    by a sentence's beams, along `cache_batch_axis`). The search goes on from there as if only
    they had been searched."""
    batch = state["alive_logprobs"].shape[0]
    rows = (beam_size * sentences[:, None] + jnp.arange(beam_size)).reshape(-1)

    def take(leaf, axis):
        if leaf.ndim <= axis or leaf.shape[axis] not in (batch, batch * beam_size):
            return leaf
        return jnp.take(leaf, sentences if leaf.shape[axis] == batch else rows, axis=axis)

    selected = {name: take(value, 0) for name, value in state.items()
                if name not in ("step", "cache")}
    return {**selected, "step": state["step"],
            "cache": jax.tree.map(lambda leaf: take(leaf, cache_batch_axis), state["cache"])}


@dataclasses.dataclass(frozen=True)
class _BeamRules:
    """A beam search's step (`expand`) and its stopping test (`undecided`), section 6.1."""

    max_lengths: jax.Array  # [B]
    max_length: int
    beam_size: int
    alpha: float
    eos_id: int
    stop_ids: tuple[int, ...]  # further ends
    cache_batch_axis: int

    def expand(self, decode_fn: DecodeFn, state: dict) -> dict:
        """The W alive hypotheses expanded into their 2W best continuations: those among the
        best W that end in EOS (or an id of `stop_ids`) finish, the best W that do not stay
        alive and take a step."""
        beam_size = self.beam_size
        step = state["step"]
        batch = state["alive_logprobs"].shape[0]
        logprobs = _next_logprobs(state["logits"], step, self.max_lengths,
                                  self.eos_id)  # [B, W, V]
        vocab = logprobs.shape[-1]
        candidates = state["alive_logprobs"][..., None] + logprobs
        candidates = candidates.reshape(batch, beam_size * vocab)
        top_logprobs, top_ids = jax.lax.top_k(candidates, 2 * beam_size)  # [B, 2W]
        origin = top_ids // vocab
        token = (top_ids % vocab).astype(jnp.int32)
        seqs = jnp.take_along_axis(state["alive_seqs"], origin[..., None], axis=1)
        seqs = seqs.at[:, :, step].set(token)
        is_eos = jnp.isin(token, jnp.asarray((self.eos_id, *self.stop_ids), jnp.int32))

        # Finished: the candidates among the best W that end in EOS (as fairseq), scored with
        # the length penalty. So a beam of 1 is greedy search when alpha is 0.
        in_beam = jnp.arange(2 * beam_size) < beam_size
        scores = top_logprobs / length_penalty(step + 1, self.alpha)
        scores = jnp.where(is_eos & in_beam & (top_logprobs > NEG_INF / 2), scores, NEG_INF)
        all_scores = jnp.concatenate([state["finished_scores"], scores], axis=1)
        all_seqs = jnp.concatenate([state["finished_seqs"], seqs], axis=1)
        finished_scores, keep = jax.lax.top_k(all_scores, beam_size)
        finished_seqs = jnp.take_along_axis(all_seqs, keep[..., None], axis=1)

        # Alive: the best W candidates that do not end in EOS.
        alive_logprobs, keep = jax.lax.top_k(jnp.where(is_eos, NEG_INF, top_logprobs),
                                             beam_size)
        alive_seqs = jnp.take_along_axis(seqs, keep[..., None], axis=1)
        alive_origin = jnp.take_along_axis(origin, keep, axis=1)
        cache = _gather_beams(state["cache"], alive_origin, batch, beam_size,
                              self.cache_batch_axis)
        last = jnp.take_along_axis(token, keep, axis=1).reshape(batch * beam_size, 1)
        logits, cache = decode_fn(last, cache)
        return {"step": step + 1, "alive_seqs": alive_seqs, "alive_logprobs": alive_logprobs,
                "finished_seqs": finished_seqs, "finished_scores": finished_scores,
                "logits": logits, "cache": cache}

    def undecided(self, state: dict) -> jax.Array:
        """Whether to take another step: some sentence is open (`beam_search_open`)."""
        open_ = beam_search_open(state, max_lengths=self.max_lengths, alpha=self.alpha)
        return (state["step"] < self.max_length) & open_.any()


def filter_logits(logits: jax.Array, *, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
    """Logits [..., V] / temperature with everything outside the top-k (0: all) and outside
    the nucleus of probability `top_p` (1.0: all) set to NEG_INF. The most likely token always
    stays. Ties at the k-th value are all kept."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, NEG_INF, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        before = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) - jax.nn.softmax(
            ordered, axis=-1)  # probability of the more likely tokens
        cutoff = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, NEG_INF, logits)
    return logits


def sample(decode_fn: DecodeFn, cache: Any, logits: jax.Array, *, keys: jax.Array,
           max_length: int, eos_id: int, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, pad_id: int | None = PAD_ID,
           stop_ids: Sequence[int] = ()) -> jax.Array:
    """Tokens [B, T] (T = max_length) drawn after a prompt, each row ending at its first EOS
    or id of `stop_ids` (the further ends an imported checkpoint lists), zeros after.

    `logits` [B, 1, V] are the prompt's last (from the call that filled the cache), `keys` [B]
    one PRNG key per row. Token i of a row is drawn with `fold_in(key, i)`. Temperature 0 is
    greedy (top_k and top_p then change nothing). `pad_id` is never drawn (None: every id may
    be, for a vocabulary without a padding token).
    """
    def choose(logits, step):
        logits = logits[:, 0].astype(jnp.float32)
        if pad_id is not None:
            logits = jnp.where(jnp.arange(logits.shape[-1]) == pad_id, NEG_INF, logits)
        if temperature == 0.0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        return jax.vmap(jax.random.categorical)(step_keys, filtered).astype(jnp.int32)

    return _token_by_token(decode_fn, cache, logits, choose, max_length=max_length,
                           eos_ids=(eos_id, *stop_ids))
