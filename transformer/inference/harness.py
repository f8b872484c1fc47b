"""lm-evaluation-harness over a trained decoder-only workdir: the model class `transformer`.

    python -m transformer.inference.harness --model_args workdir=W --tasks T --include_path D

`TransformerLM` is an `lm_eval` `TemplateLM` (lm-eval tokenizes the requests' text pairs as
for its own Hugging Face model): `loglikelihood` scores a continuation after its context,
`loglikelihood_rolling` a whole text in windows of `max_length`, `generate_until` continues
a context greedily with the run's `Generator` and cuts at the first stop string.

Text is read as a `transformers` tokenizer reads it: after the tokens the vocabulary puts
before a text (`generator.prompt_start`: BOS, or nothing where a tokenizer.json adds none); an
empty context is BOS alone. A rolling text is read once behind BOS (lm-eval's `HFLM` encodes it
with the tokenizer's BOS and puts its prefix BOS before that, scoring a BOS after BOS: its
issue 3333; `add_bos_token=False` gives it ours). Scores come from one jitted forward pass
per (rows, length) bucket: rows padded to a power of two, lengths to `translator.BUCKET`.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from transformer.inference import decoding
from transformer.inference.generator import Generator, prompt_start
from transformer.inference.runs import open_run
from transformer.inference.translator import bucket_length
from transformer.model.transformer import Transformer, init_cache

log = logging.getLogger("transformer")
NAME = "transformer"  # lm_eval --model transformer


def _require_decoder(model) -> None:
    if model.architecture != "decoder":
        raise ValueError(f"lm-eval scores decoder-only language models; this run's "
                         f"model.architecture is {model.architecture!r}: give --model_args "
                         f"workdir= a language model's run (data.objective causal or prefix)")


@register_model(NAME)
class TransformerLM(TemplateLM):
    """A run's decoder-only model as an lm-eval model: `--model_args workdir=W` and optionally
    step (a checkpoint), max_length (default model.max_len), max_gen_toks (256); lm-eval's own
    `--batch_size` (an integer; "auto" is 16) sets the rows of a forward pass."""

    def __init__(self, workdir: str | None = None, step: int | None = None,
                 batch_size: int | str = 16, max_length: int | None = None,
                 max_gen_toks: int = 256, generator: Generator | None = None, **unused):
        """The run in `workdir` (`runs.open_run`), or a `generator`'s model and parameters as
        they are (a training loop's, without a workdir read)."""
        super().__init__()
        unused = sorted(set(unused) - {"device", "max_batch_size"})  # lm-eval's CLI passes them
        if unused:
            log.warning("lm-eval model %s ignores %s", NAME, ", ".join(unused))
        if generator is None:
            if workdir is None:
                raise ValueError(f"lm-eval model {NAME} needs --model_args workdir=<a run>")
            run = open_run(str(workdir), step=None if step is None else int(step),
                           check=_require_decoder)
            generator = Generator(run.config, run.model, run.params, run.tokenizer)
        model_config = generator.model_config
        self.generator = generator
        self.tokenizer_ = generator.tokenizer
        self.params = generator.params  # on the device
        self.model = Transformer(model_config)
        self.bos_id = model_config.bos_id
        self.prefix_lm = generator.prefix_lm
        self.start = list(prompt_start(self.tokenizer_, model_config.bos_id))
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.max_length = int(max_length or model_config.max_len)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.bos_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_.fingerprint()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        """The ids of `string`, after the vocabulary's start unless `add_special_tokens` is
        False (as a `transformers` tokenizer's `encode`)."""
        ids = self.tokenizer_.encode([string])[0]
        return ids if add_special_tokens is False else self.start + ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of log p(continuation | context), whether each token is the argmax) per
        `(strings, context ids, continuation ids)`; the inputs keep their last max_length."""
        rows = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.append((whole, len(continuation)))
        out = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for first in range(0, len(order), self.batch_size):
            chunk = order[first:first + self.batch_size]
            scores, greedy = self._score([rows[i] for i in chunk])
            for i, score, is_greedy in zip(chunk, scores, greedy, strict=True):
                out[i] = (float(score), bool(is_greedy))
                self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def _score(self, rows):
        """Scores of `(ids, n)` rows: the log-likelihood of each row's last n ids after the
        others, and whether each was the argmax."""
        longest = max(len(ids) - 1 for ids, _ in rows)
        length = bucket_length(longest, self.max_length)
        batch = 1 << max(len(rows) - 1, 0).bit_length()
        inputs = np.zeros((batch, length), np.int32)
        targets = np.zeros((batch, length), np.int32)
        scored = np.zeros((batch, length), bool)
        valid = np.zeros((batch, length), bool)
        context = np.zeros((batch, length), bool)
        for row, (ids, n) in enumerate(rows + [rows[0]] * (batch - len(rows))):
            inputs[row, :len(ids) - 1] = ids[:-1]
            targets[row, :len(ids) - 1] = ids[1:]
            scored[row, len(ids) - 1 - n:len(ids) - 1] = True
            valid[row, :len(ids) - 1] = True
            context[row, :len(ids) - n] = True  # a prefix LM reads these both ways
        prefix = context if self.prefix_lm else None
        scores, greedy = _score_fn(self.model)(self.params, inputs, targets, scored, valid,
                                               prefix)
        return np.asarray(scores)[:len(rows)], np.asarray(greedy)[:len(rows)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood behind BOS, in disjoint windows of max_length (each
        window reads as much of what precedes it as fits)."""
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            ids = self.tok_encode(text, add_special_tokens=False)
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=ids,
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled where a task asks for it: request i draws with key i)
        of up to `max_gen_toks` tokens, cut before the first stop string or end token;
        requests with the same options are generated batch_size at a time."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        out = [""] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)  # EOS: by id
            new = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - len(self.start) - new
            if room < 1:
                raise ValueError(f"max_gen_toks={new} leaves no room for a context within "
                                 f"max_length={self.max_length}")
            options = dict(max_new_tokens=new, temperature=float(kwargs.get("temperature", 0)),
                           top_k=int(kwargs.get("top_k") or 0),
                           top_p=float(kwargs.get("top_p") or 1.0))
            for first in range(0, len(members), self.batch_size):
                chunk = members[first:first + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0], add_special_tokens=False)[-room:]
                           for i in chunk]
                rows = self.generator.generate_ids(prompts, prompt_indices=chunk, seed=0,
                                                   **options)
                for i, row in zip(chunk, rows, strict=True):
                    text = self.tokenizer_.decode(
                        decoding.before_end(row, self.generator.eos_ids))
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


@functools.lru_cache(maxsize=8)
def _score_fn(model: Transformer):
    """A jitted `(params, inputs, targets, scored, valid, prefix) -> (sums [B], greedy [B])`:
    the decoder reads `inputs` [B, T] as given (padding after them, `valid` False), a prefix
    LM's `prefix` in both directions; float32 log-softmax."""

    def run(params, inputs, targets, scored, valid, prefix):
        cache = init_cache(model.config, *inputs.shape)
        logits, _ = model.apply({"params": params}, None, None, inputs, cache=cache,
                                targets_prefix=prefix, targets_segmentation=valid,
                                method="decode")
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        hits = (jnp.argmax(logp, axis=-1) == targets) | ~scored
        return jnp.sum(jnp.where(scored, picked, 0.0), axis=-1), jnp.all(hits, axis=-1)

    return jax.jit(run)


def evaluate_tasks(lm: TransformerLM, include_path: str, tasks: list[str],
                   limit: int | None = None) -> dict[str, float]:
    """Scores of `tasks` defined by the task files in `include_path` (lm-eval's own tasks left
    out: nothing is downloaded), `limit` documents each: {"lm_eval/<task>/<metric>": value}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    check_task_files([include_path])
    manager = TaskManager(include_path=include_path, include_defaults=False)
    results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                              log_samples=False, bootstrap_iters=0)
    return {f"lm_eval/{task}/{metric.split(',')[0]}": float(value)
            for task, metrics in results["results"].items() for metric, value in metrics.items()
            if "_stderr" not in metric and isinstance(value, float)}


def for_training(cfg, model_config, params, tokenizer):
    """The scorer a training loop calls every `lm_eval_every_steps`: `score(params)` ->
    `evaluate_tasks` of the config's `lm_eval_tasks` (task files in `lm_eval_path`, the first
    `lm_eval_limit` documents) with those parameters. The task files are checked here, before
    the first step."""
    check_task_files([cfg.lm_eval_path])
    lm = TransformerLM(generator=Generator(cfg, model_config, params, tokenizer))
    tasks = [name.strip() for name in cfg.lm_eval_tasks.split(",") if name.strip()]

    def score(params) -> dict[str, float]:
        lm.params = lm.generator.params = params
        return evaluate_tasks(lm, cfg.lm_eval_path, tasks, int(cfg.lm_eval_limit) or None)

    return score


def check_task_files(paths) -> None:
    """Parses each lm-eval task yaml in `paths` (files, or folders searched for *.yaml) with
    lm-eval's own reader (its `!function` tags and includes): one line naming the first that
    does not parse. (lm-eval itself skips such a file with a warning, then finds no task.)"""
    from lm_eval.tasks._yaml_loader import load_yaml

    for given in map(pathlib.Path, paths):
        for path in sorted(given.rglob("*.yaml")) if given.is_dir() else [given]:
            try:
                load_yaml(path, resolve_func=False)
            except Exception as e:  # yaml's parse errors, not a mapping, a missing include
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(f"lm-eval task file {path} does not parse ({reason}): fix its "
                                 f"YAML (a mapping of task settings)") from None


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the model class `transformer` registered (and chosen when
    --model is not given); --include_path task files are checked before the run is opened."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model" not in argv and not any(a.startswith("--model=") for a in argv):
        argv = ["--model", NAME] + argv
    for i, arg in enumerate(argv):
        if arg == "--include_path" and i + 1 < len(argv):
            check_task_files(argv[i + 1].split(":"))
        elif arg.startswith("--include_path="):
            check_task_files(arg.split("=", 1)[1].split(":"))
    sys.argv = [sys.argv[0]] + argv
    cli_evaluate()


if __name__ == "__main__":
    main()
