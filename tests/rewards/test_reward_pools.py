"""Rewards with GPUs of their own (`reward.functions.<name>.gpus`): a pool of reward workers each,
merged scores equal to one MultiReward's, and Ray placing their actors on GPUs that the policy's
placement group does not hold (issue 50 item 2)."""

import pytest
import torch

from diffrl.config.schema import RewardConfig, RewardFnConfig
from diffrl.rewards import MultiReward, reward_specs
from diffrl.rewards.multi import RewardBatch
from diffrl.workers.reward_workers import (
    InProcessRewardWorkers,
    PooledRewardWorkers,
    RayRewardWorkers,
    create_reward_workers,
    gather,
    reward_pools,
    reward_resources,
)

FUNCTIONS = {
    "jpeg_compressibility": {"weight": 0.3},
    "reward_test_helpers:mean_brightness": {"weight": 1.7, "gpus": 1.0},
    "python@fails": {
        "weight": 2.0,
        "required": False,
        "args": {"function": "reward_test_helpers:always_fails"},
    },
    "shapes": {"weight": 0.5, "gpus": 0.5, "workers": 2},
}


def _config(**shared):
    return RewardConfig(functions={n: RewardFnConfig(**e) for n, e in FUNCTIONS.items()}, **shared)


def _micro_batches(n=3, batch=4):
    generator = torch.Generator().manual_seed(0)
    prompts = ["a red circle", "three circles", "a green triangle", "a circle left of a square"]
    return [
        (
            torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, generator=generator),
            prompts[:batch],
            None,
        )
        for _ in range(n)
    ]


def test_each_reward_with_gpus_gets_a_pool_of_its_own():
    pools = reward_pools(_config(workers=2, cpus_per_worker=1.5, gpus_per_worker=0.25))
    assert [([s.name for s in specs], w, c, g) for specs, w, c, g in pools] == [
        (["jpeg_compressibility", "python@fails"], 2, 1.5, 0.25),  # the shared pool
        (["reward_test_helpers:mean_brightness"], 1, 1.5, 1.0),
        (["shapes"], 2, 1.5, 0.5),
    ]
    assert reward_resources(_config(workers=2, cpus_per_worker=1.5, gpus_per_worker=0.25)) == (7.5, 2.5)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (
            {"workers": 2},
            r"shapes\.workers=2 applies to a reward with workers of its own: set reward\.functions\.shapes\.gpus > 0",
        ),
        ({"gpus": -1.0}, r"shapes\.gpus=-1\.0 is invalid: GPUs for each of this reward's own workers"),
        ({"gpus": 1.0, "workers": 0}, r"shapes\.workers=0 is invalid: must be an integer >= 1"),
        ({"gpu": 1}, r"unknown key\(s\) \['gpu'\]: use weight, required, args, video_frames, gpus, workers"),
    ],
)
def test_bad_own_worker_settings_name_the_key_and_the_fix(entry, match):
    with pytest.raises(ValueError, match=match):
        reward_specs({"shapes": entry})


def test_merged_pools_score_as_one_multi_reward_bitwise():
    specs = reward_specs(FUNCTIONS)
    alone = MultiReward(specs)
    pools = [
        InProcessRewardWorkers([specs[0], specs[2]], overlap=True),
        InProcessRewardWorkers([specs[1]], overlap=True),
        InProcessRewardWorkers([specs[3]], overlap=False),
    ]
    with PooledRewardWorkers(specs, pools) as pooled:
        step = gather([pooled.submit(*mb) for mb in _micro_batches()], timeout=60)
    expected = RewardBatch.concat([alone(*mb) for mb in _micro_batches()])
    assert torch.equal(step.total_B, expected.total_B)
    assert list(step.scores) == [s.name for s in specs]  # the config's order
    for name in expected.scores:
        assert torch.equal(step.scores[name], expected.scores[name])
        assert torch.equal(step.failed[name], expected.failed[name])
        assert step.failed_batches[name] == expected.failed_batches[name]
    assert step.failed_batches["python@fails"] == 3
    assert set(step.extras) == set(expected.extras)
    for key in expected.extras:
        torch.testing.assert_close(step.extras[key], expected.extras[key], equal_nan=True, rtol=0, atol=0)


def test_in_process_every_reward_scores_in_this_process():
    workers = create_reward_workers(_config(), use_ray=False)
    assert isinstance(workers, InProcessRewardWorkers)
    workers.close()


RAY_FUNCTIONS = {  # registered rewards only: the cluster's workers cannot import the tests' helpers
    "jpeg_compressibility": {"weight": 0.3},
    "jpeg_incompressibility": {"weight": 1.7, "gpus": 1.0},
    "shapes": {"weight": 0.5, "gpus": 0.5, "workers": 2},
}


@pytest.mark.gpu
def test_ray_gives_a_reward_pool_gpus_the_policy_does_not_hold():
    """A cluster of its own with 3 declared GPUs (Ray's accounting; no GPU is used, but the cluster
    start alone takes ~12 s on 2 cores, hence the gpu mark: it runs with the GPU tests): the
    policy's placement group holds one, and the reward pools, one of 2 workers of 0.5 GPU and one
    of 1 GPU, get the other two."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from diffrl.telemetry.console import ray_init_kwargs

    ray.init(address="local", num_cpus=6, num_gpus=3, include_dashboard=False, **ray_init_kwargs())
    try:
        policy = placement_group([{"CPU": 1, "GPU": 1}])
        ray.get(policy.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(placement_group=policy, placement_group_bundle_index=0)
        policy_gpus = ray.get(
            ray.remote(num_gpus=1, num_cpus=1)(ray.get_gpu_ids)
            .options(scheduling_strategy=strategy)
            .remote(),
            timeout=60,
        )
        cfg = RewardConfig(
            functions={n: RewardFnConfig(**e) for n, e in RAY_FUNCTIONS.items()}, cpus_per_worker=0.5
        )
        workers = create_reward_workers(cfg, use_ray=True)
        assert isinstance(workers, PooledRewardWorkers) and len(workers.pools) == 3
        try:
            assert all(isinstance(p, RayRewardWorkers) for p in workers.pools)
            shared, incompressibility, shapes = (
                ray.get([a.__ray_call__.remote(lambda _: ray.get_gpu_ids()) for a in p.actors], timeout=60)
                for p in workers.pools
            )
            assert shared == [[]]  # the shared pool: no GPU (reward.gpus_per_worker=0)
            assert len(incompressibility) == 1 and len(incompressibility[0]) == 1
            assert len(shapes) == 2 and shapes[0] == shapes[1]  # two workers of 0.5 share one GPU
            assert len({*policy_gpus, incompressibility[0][0], shapes[0][0]}) == 3  # three different GPUs
            step = gather([workers.submit(*mb) for mb in _micro_batches(n=2)], timeout=120)
        finally:
            workers.close()
        expected = RewardBatch.concat([MultiReward(RAY_FUNCTIONS)(*mb) for mb in _micro_batches(n=2)])
        assert torch.equal(step.total_B, expected.total_B)
        assert isinstance(workers.pools, list) and not workers.pools
        remove_placement_group(policy)
    finally:
        ray.shutdown()
