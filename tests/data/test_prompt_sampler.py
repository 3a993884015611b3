import json
from collections import Counter

import numpy as np
import pytest

from diffrl.data import PromptRecord, PromptSampler
from diffrl.seeding import DATA_STREAM, derive_seed

RECORDS = [PromptRecord(f"prompt {i}", source=f"mem:{i}") for i in range(10)]


def indices(batch):
    return [i for i, _ in batch]


def stream(sampler, batches):
    return [indices(sampler.next_batch()) for _ in range(batches)]


def test_batches_pair_each_index_with_its_record():
    sampler = PromptSampler(RECORDS, 4, seed=0)
    for _ in range(5):
        batch = sampler.next_batch()
        assert len(batch) == 4
        assert all(record is RECORDS[i] for i, record in batch)


def test_every_record_once_per_epoch_in_the_documented_order():
    sampler = PromptSampler(RECORDS, 5, seed=3)
    flat = [i for batch in stream(sampler, 6) for i in batch]  # 3 epochs of 10
    for epoch in range(3):
        order = flat[epoch * 10 : (epoch + 1) * 10]
        assert sorted(order) == list(range(10))
        expected = np.random.default_rng(derive_seed(DATA_STREAM, 3, epoch)).permutation(10)
        assert order == expected.tolist()
    assert flat[:10] != flat[10:20] != flat[20:30]  # epochs differ
    assert sampler.state_dict() == {"epoch": 3, "position": 0, "num_records": 10}


def test_deterministic_per_seed_and_different_across_seeds():
    a = stream(PromptSampler(RECORDS, 3, seed=7), 8)
    assert a == stream(PromptSampler(RECORDS, 3, seed=7), 8)
    assert a != stream(PromptSampler(RECORDS, 3, seed=8), 8)


def test_no_shuffle_is_file_order():
    sampler = PromptSampler(RECORDS, 4, seed=0, shuffle=False)
    assert stream(sampler, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_a_batch_crossing_an_epoch_boundary_continues_into_the_next_epoch():
    sampler = PromptSampler(RECORDS, 4, seed=1)
    epoch0, epoch1 = sampler.epoch_order(0).tolist(), sampler.epoch_order(1).tolist()
    assert stream(sampler, 3) == [epoch0[:4], epoch0[4:8], epoch0[8:] + epoch1[:2]]
    assert sampler.state_dict() == {"epoch": 1, "position": 2, "num_records": 10}
    assert indices(sampler.next_batch()) == epoch1[2:6]


def test_batch_larger_than_the_records_wraps_over_epochs():
    records = RECORDS[:3]
    sampler = PromptSampler(records, 7, seed=2)
    batch = indices(sampler.next_batch())
    orders = [sampler.epoch_order(e).tolist() for e in range(3)]
    assert batch == orders[0] + orders[1] + orders[2][:1]
    assert Counter(batch) == Counter({0: 2, 1: 2, 2: 2}) + Counter(orders[2][:1])
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 1


def test_drop_last_keeps_batches_inside_one_epoch():
    sampler = PromptSampler(RECORDS, 4, seed=5, drop_last=True)
    orders = [sampler.epoch_order(e).tolist() for e in range(2)]
    assert stream(sampler, 4) == [orders[0][:4], orders[0][4:8], orders[1][:4], orders[1][4:8]]
    assert sampler.state_dict() == {"epoch": 2, "position": 0, "num_records": 10}
    with pytest.raises(ValueError, match="drop_last=True would drop every record"):
        PromptSampler(RECORDS, 11, seed=0, drop_last=True)


@pytest.mark.parametrize(
    ("batch_size", "k", "drop_last"),
    [(3, 1, False), (3, 3, False), (3, 4, False), (5, 2, False), (4, 2, True), (4, 3, True), (25, 2, False)],
)
def test_resume_after_k_batches_equals_the_uninterrupted_stream(batch_size, k, drop_last):
    # (3, 4): 12 records consumed, so the state sits mid-epoch 1; (3, 3): the 4th batch crosses the boundary
    full = stream(PromptSampler(RECORDS, batch_size, seed=11, drop_last=drop_last), k + 6)
    first = PromptSampler(RECORDS, batch_size, seed=11, drop_last=drop_last)
    assert stream(first, k) == full[:k]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = PromptSampler(RECORDS, batch_size, seed=11, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert stream(resumed, 6) == full[k:]


def test_resume_mid_epoch_crossing_the_boundary():
    full = stream(PromptSampler(RECORDS, 4, seed=0), 5)
    first = PromptSampler(RECORDS, 4, seed=0)
    first.next_batch()
    first.next_batch()
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 8, "num_records": 10}
    resumed = PromptSampler(RECORDS, 4, seed=0)
    resumed.load_state_dict(state)
    assert stream(resumed, 3) == full[2:]  # the first of these spans epochs 0 and 1


def test_iteration_is_endless_and_matches_next_batch():
    it = iter(PromptSampler(RECORDS, 4, seed=9))
    batches = [indices(next(it)) for _ in range(30)]
    assert batches == stream(PromptSampler(RECORDS, 4, seed=9), 30)


def test_bad_arguments_and_states():
    with pytest.raises(ValueError, match="at least one record"):
        PromptSampler([], 1, seed=0)
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        PromptSampler(RECORDS, 0, seed=0)
    with pytest.raises(ValueError, match="seed=-1 is invalid"):
        PromptSampler(RECORDS, 1, seed=-1)
    sampler = PromptSampler(RECORDS, 2, seed=0)
    with pytest.raises(ValueError, match="saved with 12 prompts but 10 are loaded now"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "num_records": 12})
    with pytest.raises(ValueError, match="position=10 is invalid"):
        sampler.load_state_dict({"epoch": 0, "position": 10})
    with pytest.raises(ValueError, match="epoch=None is invalid"):
        sampler.load_state_dict({"position": 0})
    with pytest.raises(ValueError, match="unknown sampler state keys"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "pos": 1})
    sampler.load_state_dict({"epoch": 2, "position": 3})  # num_records is optional
    assert sampler.state_dict() == {"epoch": 2, "position": 3, "num_records": 10}
