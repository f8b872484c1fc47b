"""Packing plans: every example exactly once per epoch, budgets never exceeded, placements
reproducible from the batch alone, segment ids and positions per packed pair."""

import numpy as np
import pytest

from transformer.data import batching


def _lengths(n, length, seed=0):
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(np.log(12), 0.7, n).astype(np.int64), 2, length + 20)
    tgt = np.clip((src * rng.uniform(0.7, 1.4, n)).astype(np.int64), 2, length + 20)
    return src, tgt


@pytest.mark.parametrize("rows,length,budget", [(8, 32, 0), (8, 32, 200), (5, 64, 64)])
def test_plan_covers_each_example_once_within_budget(rows, length, budget):
    src, tgt = _lengths(3000, length)
    eligible = np.flatnonzero((src <= length) & (tgt <= length))
    plans = batching.EpochPlans(src, tgt, eligible, seed=3, rows=rows, length=length,
                                budget=budget)
    for epoch in (0, 1):
        order, starts = plans.epoch(epoch)
        assert sorted(order.tolist()) == eligible.tolist()
        seen = []
        for b in range(len(starts) - 1):
            examples = order[starts[b]:starts[b + 1]]
            assert len(examples) >= 1
            seen.extend(examples.tolist())
            if budget:
                assert src[examples].sum() <= budget and tgt[examples].sum() <= budget
            placement = batching.first_fit(src[examples], tgt[examples], rows, length)
            used_src = np.zeros(rows, int)
            used_tgt = np.zeros(rows, int)
            for i, (row, s_off, t_off) in zip(examples, placement, strict=True):
                assert s_off == used_src[row] and t_off == used_tgt[row]
                used_src[row] += src[i]
                used_tgt[row] += tgt[i]
            assert used_src.max() <= length and used_tgt.max() <= length
            if b + 1 < len(starts) - 1 and not budget:  # cut only where the next did not fit
                nxt = order[starts[b + 1]]
                assert ((used_src + src[nxt] > length) | (used_tgt + tgt[nxt] > length)).all()
        assert sorted(seen) == eligible.tolist()  # exactly once


def test_global_index_maps_across_epochs_deterministically():
    src, tgt = _lengths(500, 32)
    eligible = np.flatnonzero((src <= 32) & (tgt <= 32))
    make = lambda: batching.EpochPlans(src, tgt, eligible, seed=7, rows=4, length=32,  # noqa
                                       budget=0, keep=1)
    a = make()
    b = make()
    n0 = a.batches_in_epoch(0)
    assert a.locate(n0) == (1, 0) and a.locate(n0 - 1) == (0, n0 - 1)
    for index in (n0 + 3, 0, 2 * n0 + 5, 1):  # any order, evicted epochs recomputed
        np.testing.assert_array_equal(a.examples(index), b.examples(index))
    assert not np.array_equal(a.epoch(0)[0], a.epoch(1)[0])  # reshuffled per epoch
    other = batching.EpochPlans(src, tgt, eligible, seed=8, rows=4, length=32)
    assert not np.array_equal(other.epoch(0)[0], a.epoch(0)[0])


def test_pack_segments_positions_and_row_ranges():
    pieces = [(np.array([5, 6, 3]), np.array([7, 3])), (np.array([8, 3]), np.array([9, 9, 3])),
              (np.array([4, 4, 4, 3]), np.array([6, 3]))]
    placement = batching.first_fit([3, 2, 4], [2, 3, 2], rows=2, length=6)
    assert placement == [(0, 0, 0), (0, 3, 2), (1, 0, 0)]
    full = batching.pack(pieces, placement, (0, 2), 6, 6)
    np.testing.assert_array_equal(full["inputs"], [[5, 6, 3, 8, 3, 0], [4, 4, 4, 3, 0, 0]])
    np.testing.assert_array_equal(full["targets"], [[7, 3, 9, 9, 3, 0], [6, 3, 0, 0, 0, 0]])
    np.testing.assert_array_equal(full["inputs_segmentation"],
                                  [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(full["targets_positions"],
                                  [[0, 1, 0, 1, 2, 0], [0, 1, 0, 0, 0, 0]])
    second = batching.pack([None, None, pieces[2]], placement, (1, 2), 6, 6)
    for key in batching.KEYS:
        np.testing.assert_array_equal(second[key], full[key][1:])
        assert second[key].dtype == np.int32
    with pytest.raises(ValueError, match="does not fit"):
        batching.first_fit([7], [2], rows=2, length=6)
