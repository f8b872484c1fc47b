"""Supervised fine-tuning on conversations (transformer/data/chat.py): the chat template rendered
as transformers renders it, the loss mask on the assistant's tokens, packing, one line per bad
input, and a short training run whose loss counts the assistant's tokens alone."""

import json

import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES, byte_level_bpe

from transformer.data import chat
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.file_specs import BadData

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..3
# ChatML with BOS, written over lines with indented tags: trim_blocks and lstrip_blocks matter
TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] == 'system' %}
{{ '<|im_start|>system\n' + message['content'] | trim + '<|im_end|>\n' }}
    {%- else %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}{% endif %}"""
CONVERSATION = [
    {"role": "system", "content": " Translate to German. "},
    {"role": "user", "content": "She goes often to the movies."},
    {"role": "assistant", "content": "Sie geht oft ins Kino."},
    {"role": "user", "content": "Opens a dialog where you can select a file."},
    {"role": "assistant",
     "content": "Öffnet einen Dialog, in dem Sie eine Datei auswählen können."},
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json with a tokenizer_config.json holding TEMPLATE."""
    directory = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer = byte_level_bpe(TRANSLATION_SENTENCES + ["user assistant system"],
                               vocab_size=320, special_tokens=SPECIAL)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        chat_template=TEMPLATE)))
    return directory


@pytest.fixture(scope="module")
def ours(hf_dir):
    data = (hf_dir / "tokenizer.json").read_bytes()
    return tokenizer_lib.HuggingFaceTokenizer(data, bos_id=0, eos_id=1, pad_id=None)


def _decode(tokenizer, ids) -> str:
    from tokenizers import Tokenizer

    model = Tokenizer.from_str(tokenizer.json_bytes.decode())
    return model.decode([int(i) for i in ids], skip_special_tokens=False)


def test_rendered_text_and_ids_equal_transformers_apply_chat_template(hf_dir, ours):
    transformers = pytest.importorskip("transformers")

    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    found = chat.read_template(hf_dir)
    for messages, prompt in ((CONVERSATION, False), (CONVERSATION[:2], True)):
        text = theirs.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=prompt)
        assert chat.render(found, messages, add_generation_prompt=prompt) == text
    assert text.startswith("<s><|im_start|>system\nTranslate to German.<|im_end|>\n")
    ids, _ = chat.encode(found, ours, CONVERSATION)
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)
    assert ids.tolist() == list(expected["input_ids"])


def test_the_loss_mask_covers_exactly_the_assistant_tokens(hf_dir, ours):
    ids, mask = chat.encode(chat.read_template(hf_dir), ours, CONVERSATION)
    assert ids.shape == mask.shape and set(mask.tolist()) == {0, 1}
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    runs = list(zip(edges[::2], edges[1::2], strict=True))  # the [start, stop) of each 1-run
    assert [_decode(ours, ids[a:b]) for a, b in runs] == [
        "Sie geht oft ins Kino.<|im_end|>\n",
        "Öffnet einen Dialog, in dem Sie eine Datei auswählen können.<|im_end|>\n"]
    for a, _ in runs:  # each run starts right after the assistant's header
        assert _decode(ours, ids[:a]).endswith("<|im_start|>assistant\n")
    assert _decode(ours, ids[runs[0][1]:runs[1][0]]) == (
        "<|im_start|>user\nOpens a dialog where you can select a file.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_the_template_of_an_imported_checkpoint_is_found_and_kept(hf_dir, tmp_path):
    """init_from an import: its Hugging Face directory's template (config.json's provenance),
    recorded in the new run's vocab/ so that a resumed run reads it there."""
    from transformer.checkpoint import layout

    imported = tmp_path / "imported"
    (imported / "vocab").mkdir(parents=True)
    layout.write_config(str(imported), {}, {"huggingface": {"source": str(hf_dir)}})
    run = tmp_path / "run"
    found = chat.find_template(workdir=str(run), vocab_path=None, init_from=f"{imported}:0")
    assert found == {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    assert chat.read_template(run / "vocab") == found
    assert chat.find_template(workdir=str(run), vocab_path=None, init_from=None) == found


def _conversations(n: int, rng) -> list[dict]:
    sentences = sorted(set(TRANSLATION_SENTENCES))
    rows = []
    for _ in range(n):
        a, b = rng.choice(len(sentences), 2, replace=False)
        rows.append({"messages": [{"role": "user", "content": sentences[a]},
                                  {"role": "assistant", "content": sentences[b]}]})
    return rows


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return f"chat:{path}"


def _source(hf_dir, tmp_path, train, evaluated=None, **kwargs):
    spec = _write(tmp_path / "train.jsonl", train)
    eval_spec = _write(tmp_path / "eval.jsonl", evaluated or train[:4])
    vocab_path = str(hf_dir / "tokenizer.json")
    options = dict(objective="sft", vocab_size=320, max_length=128, batch_size=4, seed=0,
                   eval_dataset=eval_spec, vocab_path=vocab_path) | kwargs
    return chat.ChatSource(spec, **options)


def test_packing_keeps_each_conversation_its_own_segment(hf_dir, ours, tmp_path):
    rows = _conversations(40, np.random.default_rng(0))
    source = _source(hf_dir, tmp_path, rows)
    found = chat.read_template(hf_dir)
    encoded = {tuple(chat.encode(found, ours, r["messages"])[0].tolist()):
               chat.encode(found, ours, r["messages"])[1] for r in rows}
    batch = source.train_batch(3, (0, 4))
    assert set(batch) == {"targets", "targets_segmentation", "targets_positions",
                          "targets_loss_mask"}
    segments = batch["targets_segmentation"][0]
    assert segments.max() >= 2  # several conversations to a row
    placed = 0
    for r, row in enumerate(segments):
        for segment in range(1, row.max() + 1):
            where = np.flatnonzero(row == segment)
            assert where[-1] - where[0] == len(where) - 1  # contiguous
            np.testing.assert_array_equal(batch["targets_positions"][0, r, where],
                                          np.arange(len(where)))
            ids = tuple(batch["targets"][0, r, where].tolist())
            assert ids in encoded  # one whole conversation, with its own mask
            np.testing.assert_array_equal(batch["targets_loss_mask"][0, r, where], encoded[ids])
            placed += 1
    assert placed >= 4 and (segments > 0).mean() > 0.6  # rows are filled
    assert not batch["targets_loss_mask"][0][segments == 0].any()  # padding is never counted


def test_bad_input_is_one_line(hf_dir, tmp_path):
    rows = _conversations(8, np.random.default_rng(1))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    with pytest.raises(BadData, match=r"^data.objective='sft' needs the checkpoint's chat "
                                      r"template and the vocabulary has none"):
        _source(hf_dir, tmp_path, rows, vocab_path=str(bare / "tokenizer.json"))
    cases = [
        ({"text": "hello"}, r"train.jsonl:3: no 'messages' \(it has \['text'\]\)"),
        ({"messages": [{"role": "user", "content": "hi"}]},
         r"train.jsonl:3: the conversation has no assistant turn"),
        ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant",
                                                            "content": "ok"}]},
         r"train.jsonl:3: message 0 has role 'robot', not one of system, user, assistant"),
    ]
    for bad, message in cases:
        with pytest.raises(BadData, match=message) as error:
            _source(hf_dir, tmp_path, rows[:2] + [bad] + rows[2:])
        assert "\n" not in str(error.value)
    last_marked = {"chat_template": "{% for m in messages %}{{ m['content'] }}"
                                    "{% if loop.last %}!{% endif %}{% endfor %}"}
    with pytest.raises(BadData, match=r"^the chat template renders turn 2 of a conversation "
                                      r"differently inside the whole"):
        chat.assistant_spans(last_marked, CONVERSATION)
    with pytest.raises(BadData, match=r"^data.dataset='jsonl:.*' .*write it as chat:<glob>"):
        chat.ChatSource("jsonl:x.jsonl", objective="sft", vocab_size=320, max_length=64,
                        batch_size=4)


def test_sft_lowers_the_assistant_loss_and_counts_nothing_else(hf_dir, tmp_path, load_config):
    """A tiny decoder trained on conversations: the loss (the assistant's tokens alone) falls;
    changing a trailing user turn's tokens leaves it unchanged to the bit (those tokens are
    neither counted nor seen by a counted token: their segment's later tokens are theirs, and
    attention across segments gets weight exactly 0), while changing an assistant token
    changes it."""
    from transformer.config import resolve
    from transformer.parallel import sharding
    from transformer.training import train_state

    rng = np.random.default_rng(2)
    rows = _conversations(32, rng)
    for r in rows:  # a user turn after the reply: not counted, and no counted token after it
        r["messages"].append({"role": "user", "content": "Sie geht oft ins Kino."})
    source = _source(hf_dir, tmp_path, rows, batch_size=8)
    cfg = load_config("lm_default.py", **{
        "data.objective": "sft", "data.vocab_size": 320, "data.max_length": 128,
        "data.batch_size": 8, "model.d_model": 32, "model.d_ff": 64, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.num_decoder_layers": 2, "model.max_len": 128,
        "model.bos_id": 0, "model.eos_id": 1, "model.pad_id": None,
        "optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 2, "num_train_steps": 40})
    run = resolve(cfg, 8)
    trainer = train_state.build_trainer(run, sharding.make_mesh(cfg.mesh))
    state = train_state.init_state(trainer, 0)
    step = train_state.make_train_step(trainer, run.config)
    evaluate = train_state.make_eval_step(trainer)
    rows_per_batch = (0, source.rows_per_batch)
    first = source.train_batch(0, rows_per_batch)

    def loss(state, local):
        sums = evaluate(state.params, train_state.global_batch(trainer.mesh, local))
        return float(sums["nll_sum"]) / float(sums["tokens"])

    start = loss(state, first)
    for i in range(25):
        state, _ = step(state, train_state.global_batch(trainer.mesh,
                                                        source.train_batch(i, rows_per_batch)))
    assert loss(state, first) < 0.5 * start  # ln(320) = 5.8 at the start; seen 0.18x
    mask = first["targets_loss_mask"]
    segments = first["targets_segmentation"]
    changed = {k: v.copy() for k, v in first.items()}
    trailing = np.zeros_like(mask, bool)  # each segment's tokens after its last counted one
    for a, r in np.ndindex(mask.shape[:2]):
        for s in range(1, segments[a, r].max() + 1):
            where = np.flatnonzero(segments[a, r] == s)
            last = where[mask[a, r, where] == 1].max()
            trailing[a, r, where[where > last]] = True
    changed["targets"][trailing] = rng.integers(4, 320, int(trailing.sum()))
    assert loss(state, changed) == loss(state, first)
    flipped = {k: v.copy() for k, v in first.items()}
    counted = np.argwhere(mask == 1)[3]
    flipped["targets"][tuple(counted)] = (first["targets"][tuple(counted)] + 7) % 316 + 4
    assert loss(state, flipped) != loss(state, first)
