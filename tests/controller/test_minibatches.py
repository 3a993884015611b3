import torch

from diffrl.config import load_config
from diffrl.controller.minibatches import mini_batches


def config(*overrides):
    return load_config(
        "default",
        [
            "rollout.n=2",
            "data.prompts_per_step=4",
            "actor.mini_batch_size=4",
            "actor.micro_batch_size=1",
            "actor.epochs=2",
            *overrides,
        ],
    )


def test_mini_batches_hold_whole_groups_and_every_epoch_covers_every_sample():
    batches = list(mini_batches(config(), groups=4, step=3))
    assert [b.epoch for b in batches] == [0, 0, 1, 1]
    for b in batches:
        assert b.rows_B.tolist() == [g * 2 + j for g in b.groups for j in range(2)]
    for epoch in (0, 1):
        rows = torch.cat([b.rows_B for b in batches if b.epoch == epoch])
        assert sorted(rows.tolist()) == list(range(8))


def test_the_shuffle_is_seeded_per_step_and_epoch_and_off_keeps_the_sampled_order():
    cfg = config()
    orders = [[b.groups for b in mini_batches(cfg, 4, step)] for step in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2]
    unshuffled = [b.groups for b in mini_batches(config("actor.shuffle=false"), 4, 0)]
    assert unshuffled == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_shards_are_consecutive_equal_worker_shares_cut_into_micro_batches():
    (first, *_) = mini_batches(config("actor.shuffle=false"), 4, 0)
    shards = first.shards(world=2, micro_batch_size=1)
    assert [[rows.tolist() for rows in worker] for worker in shards] == [[[0], [1]], [[2], [3]]]
