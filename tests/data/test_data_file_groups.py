"""Packing groups over files (`data.pack_groups`): group g of G owns the shards k with
k % G == g and has its own order over them, so the process that packs some groups' rows opens
only those groups' shards; the groups partition the corpus, a mixture keeps its weights, and a
group without a shard is one line before any shard is read. A restart (or a process after
process 0) builds its source from the workdir's records without decoding a shard."""

import numpy as np
import pytest
from test_data_files import WORDS, documents, small_lm_files_config, write_shards

from transformer.data import file_formats, file_specs, files


@pytest.mark.parametrize("groups,window", [(1, 2), (3, 2), (4, 8)])
def test_each_group_s_epoch_visits_its_own_shards_documents_once(tmp_path, groups, window,
                                                                  caplog):
    write_shards(tmp_path, documents(230), shards=7)
    source = files.FileDocuments(f"jsonl:{tmp_path}/*.jsonl.zst", seed=3,
                                 shuffle_window=window, groups=groups)
    # 7 shards of 33 documents: 3 or 4 groups are of unequal size, and the log says so
    assert ("smaller ones repeat their documents sooner" in caplog.text) == (groups > 1)
    shard_of = np.searchsorted(source.offsets, np.arange(len(source)), side="right") - 1
    seen = []
    for g in range(groups):
        mine = np.flatnonzero(shard_of % groups == g)
        assert source.group_size(g) == len(mine)
        epoch = source.order(0, np.arange(len(mine)), g)
        np.testing.assert_array_equal(np.sort(epoch), mine)
        assert not np.array_equal(epoch, source.order(1, np.arange(len(mine)), g))
        # the endless draw runs epoch after epoch
        np.testing.assert_array_equal(source.draw(len(mine) - 5, len(mine) + 5, g),
                                      np.concatenate([epoch[-5:], source.order(1, range(5), g)]))
        # a window's run of documents comes from at most max(1, window // groups) shards
        per_window = max(1, window // groups) if groups > 1 else window
        assert len(set(shard_of[epoch[:10]].tolist())) <= per_window
        seen.append(epoch)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(len(source)))
    if groups == 1:  # one group is the order without groups, bit for bit
        plain = files.FileDocuments(f"jsonl:{tmp_path}/*.jsonl.zst", seed=3,
                                    shuffle_window=window)
        np.testing.assert_array_equal(plain.order(2, np.arange(230)),
                                      source.order(2, np.arange(230)))


def test_a_process_opens_only_its_groups_shards(tmp_path):
    from transformer.data.language_model import from_config

    cfg = small_lm_files_config(tmp_path)  # 6 shards
    cfg.data.pack_groups = 4
    cfg.grad_accum_steps = 2  # a group: one row of each micro-batch of 4 rows
    source = from_config(cfg, str(tmp_path / "run"))
    train = source.documents["train"]
    whole = source.train_batch(5, (0, 4))
    opened = []
    read = train._reader.read
    train._reader.read = lambda path: opened.append(path) or read(path)
    train._cache.clear()
    half = source.train_batch(5, (0, 2))  # rows 0-1 of both micro-batches: groups 0 and 1
    for key, value in half.items():
        np.testing.assert_array_equal(value, whole[key][:, :2])
    assert opened and set(opened) <= {train.paths[k] for k in (0, 4, 1, 5)}
    shard_of = np.searchsorted(train.offsets, source.batch_documents(5), side="right") - 1
    assert set(shard_of.tolist()) - {0, 4, 1, 5}  # the other groups read other shards
    for g in range(4):
        groups = np.searchsorted(train.offsets, source.group_documents(5, g), side="right") - 1
        assert set((groups % 4).tolist()) == {g}
    cfg.data.pack_groups = 8
    cfg.grad_accum_steps = 1
    with pytest.raises(file_specs.BadData, match=r"^data.pack_groups=8 exceeds the 6 shard\(s\) of "
                                                 r"data.dataset='jsonl:.*': each group reads its "
                                                 r"own shards; lower data.pack_groups or split the "
                                                 r"corpus into more shards$"):
        from_config(cfg, str(tmp_path / "other"))


def test_a_mixture_keeps_each_source_s_token_share_in_every_group(tmp_path):
    from transformer.data.language_model import from_config

    cfg = small_lm_files_config(tmp_path)
    rng = np.random.default_rng(2)
    for name, (low, high) in (("web", (5, 20)), ("code", (30, 80))):
        docs = [" ".join(rng.choice(WORDS, int(rng.integers(low, high)))) for _ in range(300)]
        write_shards(tmp_path / name, docs, shards=4)
    weights = {"web": 0.75, "code": 0.25}
    cfg.data.sources = [{"dataset": f"{tmp_path}/{n}/*.jsonl.zst", "weight": w}
                        for n, w in weights.items()]
    cfg.data.text_field = "text"
    cfg.data.eval_dataset = f"{tmp_path}/web/*.jsonl.zst"
    cfg.data.pack_groups = 2
    source = from_config(cfg)
    mixture = source.documents["train"]
    tokens = np.zeros((2, 2))  # [group, source]
    for index in range(300):
        for g in range(2):
            ids = source.group_documents(index, g)
            shard = np.array([np.searchsorted(s.offsets, i - mixture.offsets[k], side="right") - 1
                              for i, k in zip(ids, mixture.source_of(ids), strict=True)
                              for s in [mixture.sources[k]]])
            assert set((shard % 2).tolist()) == {g}
            lengths = [len(t) + 1 for t in source.tokenizer.encode(mixture.texts(ids))]
            np.add.at(tokens[g], mixture.source_of(ids), lengths)
    np.testing.assert_allclose(tokens.sum(0) / tokens.sum(), list(weights.values()), atol=0.01)
    np.testing.assert_allclose(tokens / tokens.sum(1, keepdims=True),
                               [list(weights.values())] * 2, atol=0.02)


def test_a_restart_decodes_no_shard_to_build_its_source(tmp_path, monkeypatch):
    from transformer.data.language_model import from_config

    cfg = small_lm_files_config(tmp_path)
    first = from_config(cfg, str(tmp_path / "run"))
    assert len(list((tmp_path / "run/vocab").glob("lengths-*.json"))) == 1

    def refuse(self, path):
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(file_formats.ShardReader, "read", refuse)
    again = from_config(cfg, str(tmp_path / "run"))  # rows, vocabulary and lengths recorded
    assert again.docs_per_batch == first.docs_per_batch
    with pytest.raises(AssertionError, match="read"):
        from_config(cfg, str(tmp_path / "elsewhere"))
