"""Reward workers: submit returns at once, results come back in order; Ray actors match in-process."""

import os
import time

import pytest
import torch

from diffrl.config import RewardConfig, RewardFnConfig
from diffrl.rewards import RewardError
from diffrl.workers.reward_workers import (
    InProcessRewardWorkers,
    RayRewardWorkers,
    create_reward_workers,
    gather,
)

FUNCTIONS = {
    "jpeg_compressibility": {"weight": 1.0},
    "jpeg_incompressibility@q50": {"weight": 0.25, "args": {"quality": 50}},
}


def _micro_batches():
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=generator)
    pixels[0] = 7  # one flat image among noise
    prompts = ["a", "a", "b", "b"]
    return [(pixels[:2], prompts[:2], [{}, {}]), (pixels[2:], prompts[2:], [{}, {}])]


def _edit_micro_batch():
    """Two samples of one edit prompt, its source image as parquet bytes (a ConditionImage)."""
    import io

    import numpy as np
    from edit_images import condition_image

    from diffrl.data.images import read_condition_image

    buffer = io.BytesIO()
    condition_image(1, 32, 32).save(buffer, format="PNG")
    source = read_condition_image(buffer.getvalue(), None, "edit.parquet row 1", "image")
    first = torch.from_numpy(np.array(condition_image(1, 32, 32))).permute(2, 0, 1)
    pixels = torch.stack([first, torch.zeros_like(first)])
    return pixels, ["make it red", "make it red"], [{}, {}], [(source,), (source,)]


def _expected():
    with InProcessRewardWorkers(FUNCTIONS, overlap=False) as workers:
        return gather([workers.submit(*mb) for mb in _micro_batches()])


def test_in_process_submit_overlaps_and_gathers_in_order():
    slow = {"reward_test_helpers:slow": {"args": {"seconds": 0.3}}, **FUNCTIONS}
    with InProcessRewardWorkers(slow, overlap=True) as workers:
        start = time.perf_counter()
        handles = [workers.submit(*mb) for mb in _micro_batches()]
        assert time.perf_counter() - start < 0.2  # returned before the 2 x 0.3 s of scoring
        assert not handles[1].done()
        step = gather(handles)
        # the deadline is for the whole gather, not each handle: 2 x 0.3 s of scoring > 0.45 s
        late = [workers.submit(*mb) for mb in _micro_batches()]
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            gather(late, timeout=0.45)
        assert time.perf_counter() - start < 0.55
    expected = _expected()
    torch.testing.assert_close(step.scores["jpeg_compressibility"], expected.scores["jpeg_compressibility"])
    torch.testing.assert_close(step.total_B, expected.total_B)
    jpeg_kb = expected.extras["jpeg_compressibility/jpeg_kb"]
    torch.testing.assert_close(expected.scores["jpeg_compressibility"], -jpeg_kb)
    assert expected.scores["jpeg_compressibility"][0] > expected.scores["jpeg_compressibility"][1:].max()


def test_in_process_errors_surface_at_result():
    failing = {"reward_test_helpers:always_fails": {}}
    for overlap in (True, False):
        with InProcessRewardWorkers(failing, overlap=overlap) as workers:
            handle = workers.submit(*_micro_batches()[0])
            with pytest.raises(RewardError, match=r"reward_test_helpers:always_fails"):
                handle.result()


def test_from_config_in_process():
    cfg = RewardConfig(functions={"jpeg_compressibility": RewardFnConfig()}, overlap=False)
    workers = create_reward_workers(cfg, use_ray=False)
    assert isinstance(workers, InProcessRewardWorkers) and not workers.overlap
    workers.close()


def test_ray_workers_need_a_running_ray():
    import ray

    # tests/conftest.py stops the shared cluster before a test that does not ask for it
    assert not ray.is_initialized()
    with pytest.raises(RuntimeError, match=r"needs a running Ray: call ray.init\(\) first"):
        RayRewardWorkers(FUNCTIONS)


def test_ray_workers_match_in_process_scores(shared_ray):
    """On the tests' shared Ray cluster (tests/conftest.py), not one of its own: a cluster start is
    most of this test's time on 2 cores."""
    import ray

    cfg = RewardConfig(
        functions={name: RewardFnConfig(**entry) for name, entry in FUNCTIONS.items()},
        workers=2,
        cpus_per_worker=1.0,
    )
    workers = create_reward_workers(cfg, use_ray=True)
    assert isinstance(workers, RayRewardWorkers) and len(workers.actors) == 2
    # where each runs, for the message naming one that dies
    pids = ray.get([a.__ray_call__.remote(lambda _: os.getpid()) for a in workers.actors], timeout=60)
    assert [i.pid for i in workers.identities] == pids
    handles = [workers.submit(*mb) for mb in _micro_batches()]
    step = gather(handles, timeout=60)
    assert all(h.done() for h in handles)
    workers.close()
    # An edit run's micro-batch: the ConditionImages travel to the actor, which decodes them.
    with RayRewardWorkers({"edit_preservation": {}}) as edit_workers:
        pixels, prompts, metadata, sources = _edit_micro_batch()
        edit_step = edit_workers.submit(pixels, prompts, metadata, sources=sources).result(timeout=60)
    # A worker that cannot load its model fails at creation, with the model's own error type.
    with pytest.raises(FileNotFoundError, match=r"args.model='/no/such/clip' does not exist"):
        RayRewardWorkers({"clip_score": {"args": {"model": "/no/such/clip"}}})
    expected = _expected()
    with InProcessRewardWorkers({"edit_preservation": {}}, overlap=False) as in_process:
        edit_expected = in_process.submit(*_edit_micro_batch()[:3], sources=_edit_micro_batch()[3]).result()
    torch.testing.assert_close(edit_step.total_B, edit_expected.total_B)
    assert edit_step.total_B[0] == 1.0 > edit_step.total_B[1]  # the first result is its source
    torch.testing.assert_close(step.total_B, expected.total_B)
    for name in FUNCTIONS:
        torch.testing.assert_close(step.scores[name], expected.scores[name])
