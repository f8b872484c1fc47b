"""Conversations for supervised fine-tuning: `data.objective = "sft"` on
`data.dataset = "chat:<glob>"`, jsonl files whose rows hold `messages`, a list of
{"role", "content"} (roles `ROLES`), read as any file source (`files.py`).

Each conversation is rendered with the checkpoint's own chat template, the `chat_template` of
its `tokenizer_config.json` (or a `chat_template.jinja`), by jinja2 as `transformers`'
`apply_chat_template` renders it (`compile_template`). The template is looked for in the run's
`vocab/`, beside `data.vocab_path`, and in the `init_from` run (its `vocab/`, else the Hugging
Face directory it was imported from), and the run keeps it in `vocab/tokenizer_config.json`.

The loss counts the assistant's tokens alone, as trl's completion-only loss does: assistant
turn i spans the text from the render of messages[:i] with the generation prompt to the render
of messages[:i + 1] (its end-of-turn marker included). The text is tokenized span by span, and
`targets_loss_mask` is 1 on the assistant's tokens. A conversation longer than
`data.max_length` is cut there. Conversations are packed several to a row as the causal
objective packs documents (`language_model.py`), each its own segment, with no EOS appended
(the template ends each turn).

Bad input is one line before training: no chat template, a row without `messages`, a message
that is not {role, content}, an unknown role, a conversation with no assistant turn.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import numpy as np
from etils import epath

from transformer.checkpoint import layout
from transformer.data import batching, files, language_model
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.file_formats import ShardReader
from transformer.data.file_specs import BadData

log = logging.getLogger("transformer")
PREFIX = "chat:"
ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"  # transformers' own file beside tokenizer_config.json
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def file_spec(spec: str, setting: str = "data.dataset") -> str:
    """The `jsonl:<glob>` of a `chat:<glob>`, else one line."""
    if not spec or not spec.startswith(PREFIX):
        raise BadData(f"{setting}={spec!r}: data.objective='sft' reads conversations; write "
                      f"it as chat:<glob> (jsonl files whose rows hold 'messages')")
    return "jsonl:" + spec[len(PREFIX):]


# ------------------------------------------------------------------ the template

def read_template(directory) -> dict | None:
    """{"chat_template", and the special tokens} from `directory`'s `chat_template.jinja` or
    `tokenizer_config.json`, else None. A list of named templates gives its "default"."""
    directory = epath.Path(directory)
    config = {}
    if (directory / CONFIG_FILE).exists():
        config = json.loads((directory / CONFIG_FILE).read_text())
    template = config.get("chat_template")
    if (directory / TEMPLATE_FILE).exists():
        template = (directory / TEMPLATE_FILE).read_text()
    if isinstance(template, list):  # [{"name", "template"}, ...]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str) or not template:
        return None
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return {"chat_template": template, **special}


def _init_from_dirs(init_from: str) -> list:
    """Where an `init_from` run may hold its template: its vocab/, then the Hugging Face
    directory it was imported from (config.json's provenance)."""
    workdir = init_from.rpartition(":")[0] if init_from.rpartition(":")[2].isdigit() \
        else init_from
    provenance = (layout.read_config_file(workdir) or {}).get("provenance") or {}
    source = provenance.get("huggingface", {}).get("source")
    return [layout.path(workdir, layout.VOCAB)] + ([source] if source else [])


def find_template(*, workdir: str | None, vocab_path: str | None,
                  init_from: str | None) -> dict:
    """The run's chat template (`read_template`): kept in `<workdir>/vocab/`, beside
    `data.vocab_path`, or the `init_from` run's; recorded in `<workdir>/vocab/` when found
    elsewhere. Else one line."""
    kept = layout.path(workdir, layout.VOCAB) if workdir else None
    places = [kept] if kept else []
    places += [os.path.dirname(vocab_path) or "."] if vocab_path else []
    places += _init_from_dirs(init_from) if init_from else []
    for place in places:
        if epath.Path(place).is_dir() and (found := read_template(place)):
            if kept and place != kept and not read_template(kept):
                epath.Path(kept).mkdir(parents=True, exist_ok=True)
                (epath.Path(kept) / CONFIG_FILE).write_text(json.dumps(found, indent=1))
            return found
    looked = ", ".join(map(str, places)) or "nowhere (no workdir, data.vocab_path or init_from)"
    raise BadData(f"data.objective='sft' needs the checkpoint's chat template and the "
                  f"vocabulary has none (looked in {looked}): add 'chat_template' to its "
                  f"tokenizer_config.json")


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled as `transformers`' `apply_chat_template` compiles it: a sandboxed
    environment, trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `tojson`
    without HTML escapes, `strftime_now`."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(chat: dict, messages: list, *, add_generation_prompt: bool = False) -> str:
    """The text of `messages` under `chat` (`read_template`'s), as apply_chat_template's."""
    special = {k: v for k, v in chat.items() if k != "chat_template"}
    return compile_template(chat["chat_template"]).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special)


def assistant_spans(chat: dict, messages: list) -> tuple[str, list[tuple[int, int]]]:
    """The whole text and the [start, stop) characters of each assistant turn: from the end of
    the render of the turns before it with the generation prompt to the end of the render
    through it (trl's prefix by prefix). One line when a prefix does not render as a prefix."""
    text = render(chat, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(chat, messages[:i], add_generation_prompt=True)
        through = render(chat, messages[:i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise BadData(f"the chat template renders turn {i} of a conversation differently "
                          f"inside the whole ({through[-60:]!r}): the assistant's tokens cannot "
                          f"be found; use a template whose renders of prefixes are prefixes")
        spans.append((len(before), len(through)))
    return text, spans


def encode(chat: dict, tokenizer, messages: list) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of a conversation: the text tokenized span by span, the mask 1 on the
    assistant spans' tokens."""
    text, spans = assistant_spans(chat, messages)
    cuts = [0, *[c for span in spans for c in span], len(text)]
    chunks = [text[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    ids = tokenizer.encode(chunks)
    mask = [np.full(len(part), k % 2, np.int32) for k, part in enumerate(ids)]
    return (np.concatenate([np.asarray(p, np.int32) for p in ids] + [np.zeros(0, np.int32)]),
            np.concatenate(mask + [np.zeros(0, np.int32)]))


# ------------------------------------------------------------------ the files

def check_messages(messages, where: str) -> None:
    """One line naming `where` (file:line) unless `messages` is a list of {role, content}
    with known roles and an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise BadData(f"{where}: 'messages' is {type(messages).__name__}, not a non-empty list "
                      f"of {{role, content}}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise BadData(f"{where}: message {k} is not a {{role, content}} object")
        if message["role"] not in ROLES:
            raise BadData(f"{where}: message {k} has role {message['role']!r}, not one of "
                          f"{', '.join(ROLES)}; fix the row")
        if not isinstance(message.get("content"), str) and "tool_calls" not in message:
            raise BadData(f"{where}: message {k} ({message['role']}) has no text 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadData(f"{where}: the conversation has no assistant turn, so nothing to learn; "
                      f"remove the row or add the assistant's reply")


class ChatReader(ShardReader):
    """A jsonl shard's conversations, each checked and kept as its messages' JSON."""

    def _record(self, record, where: str) -> tuple[str]:
        if not isinstance(record, dict) or "messages" not in record:
            have = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise BadData(f"{where}: no 'messages' (it has {have}); a chat row is "
                          f'{{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        check_messages(record["messages"], where)
        return (json.dumps(record["messages"]),)


class ChatDocuments(files.FileDocuments):
    reader_class = ChatReader


# ------------------------------------------------------------------ the source

class ChatSource(language_model.LanguageModelSource):
    """Packed conversations (the `Source` contract): `LanguageModelSource`'s order and packing,
    with each piece a rendered conversation and the batch key `targets_loss_mask`."""

    document_class = ChatDocuments

    def __init__(self, dataset: str, *, chat_template: dict | None = None,
                 init_from: str | None = None, eval_dataset: str | None = None,
                 sources=None, **kwargs):
        if sources:
            raise BadData("data.sources (a mixture) is not read by data.objective='sft': "
                          "give the conversations as data.dataset='chat:<glob>'")
        spec = file_spec(dataset)
        eval_spec = file_spec(eval_dataset, "data.eval_dataset") if eval_dataset else None
        # before any shard is read: the template
        self.chat = chat_template or find_template(
            workdir=kwargs.get("workdir"), vocab_path=kwargs.get("vocab_path"),
            init_from=init_from)
        super().__init__(spec, eval_dataset=eval_spec, **kwargs)

    def _tokenizer(self, vocab_size: int, sample_documents: int):
        kept = self.workdir and tokenizer_lib.vocabulary_file(
            layout.path(self.workdir, layout.VOCAB))
        if not self._given and not (kept and epath.Path(kept).exists()):
            raise BadData("data.objective='sft' fine-tunes a checkpoint with its own "
                          "vocabulary: set init_from (a run or an import) or data.vocab_path")
        return super()._tokenizer(vocab_size, sample_documents)

    def _cut(self, texts: list[str]) -> list[np.ndarray]:
        """Each conversation's [2, n] (ids, loss mask), cut at `data.max_length`."""
        pieces = []
        for text in texts:
            ids, mask = encode(self.chat, self.tokenizer, json.loads(text))
            pieces.append(np.stack([ids, mask])[:, :self.max_length])
        return pieces

    def _lengths(self, pieces) -> tuple[np.ndarray, np.ndarray]:
        n = np.array([p.shape[1] for p in pieces], np.int64)
        return n, n  # the mask rides on the inputs side, at the same offsets

    def _mean_lengths(self) -> list[float]:
        sample = self.documents["train"].sample(language_model.LENGTH_SAMPLE, (11,))
        return [float(np.mean([p.shape[1] for p in self._cut(
            self.documents["train"].texts(sample))]))]

    def _batch(self, pieces, placement, rows, stream, index, keys=None):
        del stream, index, keys  # no draws
        inside = [place is not None and rows[0] <= place[0] < rows[1] for place in placement]
        wanted = [(p[1], p[0]) if keep else None for p, keep in zip(pieces, inside, strict=True)]
        packed = batching.pack(wanted, placement, rows, self.max_length,
                                              self.max_length)
        return {"targets": packed["targets"],
                "targets_segmentation": packed["targets_segmentation"],
                "targets_positions": packed["targets_positions"],
                "targets_loss_mask": packed["inputs"]}


def from_config(cfg, workdir: str | None = None) -> ChatSource:
    """`ChatSource` from the config's `data` keys (those of `language_model.from_config`)."""
    if not cfg.data.get("eval_dataset"):
        raise BadData("data.objective='sft' evaluates held-out conversations: set "
                      "data.eval_dataset='chat:<glob>'")
    return language_model.from_config(cfg, workdir, source_class=ChatSource,
                                      init_from=cfg.get("init_from") or None)
