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


def test_a_schedule_stratified_by_owner_deals_every_worker_the_groups_it_sampled():
    """4 workers sampled 2 groups each (worker r: groups 2r, 2r+1); mini-batches of 4 groups. Each
    worker must train exactly its own groups' samples, every mini-batch must hold one group of
    each worker, and every epoch must still cover every sample once."""
    from diffrl.controller.minibatches import local_owners

    cfg = config("data.prompts_per_step=8", "actor.mini_batch_size=8", "trainer.n_gpus_per_node=4")
    assert local_owners(cfg, groups=8, workers=4) == 4
    batches = list(mini_batches(cfg, groups=8, step=5, owners=4))
    assert len(batches) == 4  # 2 per epoch
    for b in batches:
        assert sorted(g // 2 for g in b.groups) == [0, 1, 2, 3]  # one group of each worker
        for rank, micro_batches in enumerate(b.shards(4, 1)):
            rows = torch.cat(micro_batches).tolist()
            assert all(row // 4 == rank for row in rows), (rank, rows)  # rank r sampled rows 4r..4r+3
    for epoch in (0, 1):
        rows = torch.cat([b.rows_B for b in batches if b.epoch == epoch])
        assert sorted(rows.tolist()) == list(range(16))
    # within each worker's groups the order is still the seeded shuffle's, and it moves with the step
    assert [b.groups for b in batches] != [b.groups for b in mini_batches(cfg, 8, step=6, owners=4)]
    # one owner: the plain shuffle
    assert [b.groups for b in mini_batches(cfg, 8, 5, owners=1)] == [
        b.groups for b in mini_batches(cfg, 8, 5)
    ]


def test_no_stratification_where_a_mini_batch_cannot_hold_every_worker_equally():
    from diffrl.controller.minibatches import local_owners

    cfg = config("data.prompts_per_step=8", "actor.mini_batch_size=4")  # 2 groups per mini-batch
    assert local_owners(cfg, groups=8, workers=1) == 1
    assert local_owners(cfg, groups=8, workers=4) == 1  # 2 groups cannot hold 4 workers' groups
    assert local_owners(cfg, groups=8, workers=2) == 2
    assert local_owners(cfg, groups=6, workers=4) == 1  # 6 groups do not split over 4 workers
