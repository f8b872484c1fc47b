"""Preference pairs for DPO (transformer/data/preference.py): text and message pairs tokenized
with the response mask, sides cut at half a row, pairs packed two segments each, one line per
bad input. (trl's own tokenization of text pairs: tests/training/test_dpo.py.)"""

import json

import numpy as np
import pytest
from conftest import TRANSLATION_SENTENCES, byte_level_bpe

from transformer.data import preference
from transformer.data.file_specs import BadData

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..3
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json, its tokenizer_config.json holding TEMPLATE."""
    directory = tmp_path_factory.mktemp("preference_tokenizer")
    tokenizer = byte_level_bpe(TRANSLATION_SENTENCES + ["user assistant"], vocab_size=320,
                               special_tokens=SPECIAL)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        chat_template=TEMPLATE)))
    return directory


def _rows(n: int, seed: int = 0, messages: bool = False) -> list[dict]:
    sentences = sorted(set(TRANSLATION_SENTENCES))
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.choice(len(sentences), 3, replace=False)
        row = {"prompt": sentences[a][:30], "chosen": sentences[b][:25],
               "rejected": sentences[c][:20]}
        if messages:
            row = {"prompt": [{"role": "user", "content": row["prompt"]}],
                   "chosen": [{"role": "assistant", "content": row["chosen"]}],
                   "rejected": [{"role": "assistant", "content": row["rejected"]}]}
        rows.append(row)
    return rows


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"preference:{path}"


def _source(hf_dir, tmp_path, train, evaluated=None, **kwargs):
    options = dict(vocab_size=320, max_length=128, batch_size=4, seed=0,
                   eval_dataset=_write(tmp_path / "eval.jsonl", evaluated or train[:6]),
                   vocab_path=str(hf_dir / "tokenizer.json")) | kwargs
    return preference.PreferenceSource(_write(tmp_path / "train.jsonl", train), **options)


def _decode(source, ids) -> str:
    from tokenizers import Tokenizer

    model = Tokenizer.from_str(source.tokenizer.json_bytes.decode())
    return model.decode([int(i) for i in ids], skip_special_tokens=False)


def test_message_pairs_mask_the_rendered_responses(hf_dir, tmp_path):
    """Messages: each side is the template's render of prompt + response, the mask on the
    response's turn after the generation prompt; text: EOS appended to the response."""
    rows = _rows(12, messages=True)
    source = _source(hf_dir, tmp_path, rows)
    chosen, rejected = preference.encode_pair(rows[0], source.tokenizer, source.chat, 64)
    for side, response in ((chosen, rows[0]["chosen"]), (rejected, rows[0]["rejected"])):
        ids, mask = side
        start = int(np.argmax(mask))
        assert mask[start:].all() and not mask[:start].any()
        prompt = rows[0]["prompt"][0]["content"]
        assert _decode(source, ids[:start]) == (f"<|im_start|>user\n{prompt}<|im_end|>\n"
                                                f"<|im_start|>assistant\n")
        assert _decode(source, ids[start:]) == f"{response[0]['content']}<|im_end|>\n"
    text = _rows(1)[0]
    chosen, _ = preference.encode_pair(text, source.tokenizer, None, 64)
    start = int(np.argmax(chosen[1]))
    assert chosen[0][-1] == source.tokenizer.eos_id
    assert _decode(source, chosen[0][start:-1]) == text["chosen"]


def test_sides_are_cut_at_half_a_row_and_a_filled_prompt_drops_the_pair():
    class Bytes:  # one id per character, EOS 1
        eos_id = 1

        def encode(self, texts):
            return [[4 + ord(c) % 60 for c in text] for text in texts]

    pair = {"prompt": "p" * 10, "chosen": "c" * 20, "rejected": "r" * 3}
    chosen, rejected = preference.encode_pair(pair, Bytes(), None, 16)
    assert chosen.shape == (2, 16) and chosen[1].tolist() == [0] * 10 + [1] * 6
    assert rejected.shape == (2, 14) and rejected[0, -1] == 1  # 10 + 3 + EOS: uncut
    assert preference.encode_pair(pair | {"prompt": "p" * 16}, Bytes(), None, 16) is None


def test_pairs_pack_as_two_segments_each(hf_dir, tmp_path):
    rows = _rows(40, seed=1)
    source = _source(hf_dir, tmp_path, rows)
    encoded = set()  # each pair's (chosen, rejected) (ids, mask), flattened
    for row in rows:
        chosen, rejected = preference.encode_pair(row, source.tokenizer, None, 64)
        encoded.add((tuple(chosen.ravel().tolist()), tuple(rejected.ravel().tolist())))
    batch = source.train_batch(2, (0, 4))
    assert set(batch) == set(preference.KEYS)
    segments = batch["targets_segmentation"][0]
    found = 0
    for r, row in enumerate(segments):
        assert row.max() % 2 == 0  # whole pairs only
        for k in range(1, row.max() // 2 + 1):
            sides = []
            for segment in (2 * k - 1, 2 * k):
                where = np.flatnonzero(row == segment)
                assert where[-1] - where[0] == len(where) - 1  # contiguous
                np.testing.assert_array_equal(batch["targets_positions"][0, r, where],
                                              np.arange(len(where)))
                sides.append(np.stack([batch["targets"][0, r, where],
                                       batch["targets_loss_mask"][0, r, where]]))
            assert tuple(tuple(side.ravel().tolist()) for side in sides) in encoded  # in order
            found += 1
    assert found >= 8 and not batch["targets_loss_mask"][0][segments == 0].any()
    evaluated = [b for b in source.eval_batches("validation", (0, 4))]
    assert sum(b["targets_segmentation"].max(axis=-1).sum() // 2 for b in evaluated) == 6


def test_bad_input_is_one_line(hf_dir, tmp_path):
    rows = _rows(8)
    cases = [
        (rows[0] | {"chosen": ""}, r"train.jsonl:3: the chosen side is empty, so the pair "
                                   r"compares nothing; remove the row or write the chosen"),
        (rows[0] | {"rejected": "  "}, r"train.jsonl:3: the rejected side is empty"),
        (_rows(1, messages=True)[0] | {"rejected": []}, r"train.jsonl:3: the rejected side is "
                                                        r"empty"),
        ({"prompt": "a", "chosen": "b"}, r"train.jsonl:3: a preference row holds prompt, "
                                         r"chosen, rejected \(it has \['chosen', 'prompt'\]\)"),
        (rows[0] | {"chosen": [{"role": "assistant", "content": "x"}]},
         r"train.jsonl:3: prompt, chosen and rejected must all be text or all be lists of "
         r"messages \(they are str, list, str\)"),
    ]
    for bad, message in cases:
        with pytest.raises(BadData, match=message) as error:
            _source(hf_dir, tmp_path, rows[:2] + [bad] + rows[2:])
        assert "\n" not in str(error.value)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    with pytest.raises(BadData, match=r"^preference pairs of messages need the checkpoint's "
                                      r"chat template"):
        _source(hf_dir, tmp_path, _rows(8, messages=True),
                vocab_path=str(bare / "tokenizer.json"))
    with pytest.raises(BadData, match=r"^data.dataset='jsonl:x.jsonl': .*preference:<glob>"):
        preference.PreferenceSource("jsonl:x.jsonl", vocab_size=320, max_length=64,
                                    batch_size=4)
    from ml_collections import ConfigDict

    with pytest.raises(BadData, match=r"^data.objective='dpo' evaluates held-out pairs: set "
                                      r"data.eval_dataset='preference:<glob>'"):
        preference.from_config(ConfigDict(dict(data=dict(eval_dataset=""),
                                               model=dict(architecture="decoder"))))
