"""StatefulLoader: exact resume, epoch coverage, seeding."""

import json
import logging

import pytest

from hybridrl.data import StatefulLoader


def take(loader, k):
    return [loader.next_batch() for _ in range(k)]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 11])
def test_exact_resume(k, drop_last):
    data = list(range(10))
    original = StatefulLoader(data, 3, seed=7, drop_last=drop_last)
    take(original, k)
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON round trip
    restored = StatefulLoader(data, 3, seed=123, drop_last=drop_last)
    restored.load_state_dict(state)
    assert take(restored, 10) == take(original, 10)
    assert restored.state_dict() == original.state_dict()


def test_each_epoch_covers_each_item_once():
    data = list(range(12))
    loader = StatefulLoader(data, 4, seed=1)
    assert loader.batches_per_epoch == 3
    orders = []
    for epoch in range(3):
        assert loader.epoch == epoch
        items = [x for batch in take(loader, 3) for x in batch]
        assert sorted(items) == data
        orders.append(items)
    assert loader.epoch == 3
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_drop_last_skips_the_remainder_and_without_it_the_last_batch_is_short():
    dropped = StatefulLoader(list(range(10)), 4, seed=0)
    assert dropped.batches_per_epoch == 2
    batches = take(dropped, 2)
    assert [len(b) for b in batches] == [4, 4] and len(set(sum(batches, []))) == 8
    assert dropped.epoch == 1
    kept = StatefulLoader(list(range(10)), 4, seed=0, drop_last=False)
    assert kept.batches_per_epoch == 3
    batches = take(kept, 3)
    assert [len(b) for b in batches] == [4, 4, 2] and sorted(sum(batches, [])) == list(range(10))


def test_order_depends_only_on_seed_and_epoch():
    data = list(range(50))
    a = take(StatefulLoader(data, 10, seed=0), 10)
    assert a == take(StatefulLoader(data, 10, seed=0), 10)
    assert a != take(StatefulLoader(data, 10, seed=1), 10)
    assert take(StatefulLoader(data, 10, shuffle=False), 6)[5] == list(range(10))


def test_state_dict_contents():
    loader = StatefulLoader(list("abcdefg"), 2, seed=3)
    take(loader, 2)
    assert loader.state_dict() == {"epoch": 0, "index": 4, "seed": 3, "batch_size": 2,
                                   "dataset_size": 7}


def test_batch_larger_than_dataset_names_the_fix():
    with pytest.raises(ValueError, match=r"batch_size \(8\) is larger than the dataset \(5 items\)"
                       r".*drop_last=False"):
        StatefulLoader(list(range(5)), 8)
    assert len(StatefulLoader(list(range(5)), 8, drop_last=False).next_batch()) == 5


def test_load_warns_on_size_changes_and_rejects_out_of_range(caplog):
    loader = StatefulLoader(list(range(10)), 2)
    state = {"epoch": 1, "index": 4, "seed": 0, "batch_size": 4, "dataset_size": 12}
    with caplog.at_level(logging.WARNING, logger="hybridrl.data"):
        loader.load_state_dict(state)
    text = caplog.text
    assert "dataset of 12 items into one of 10" in text and "batch_size 4" in text
    assert loader.state_dict()["index"] == 4 and loader.epoch == 1
    with pytest.raises(ValueError, match="out of range"):
        loader.load_state_dict({**state, "index": 11})
    with pytest.raises(ValueError, match="out of range"):
        loader.load_state_dict({**state, "epoch": -1})
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 0})
