"""The separate placement with its pools in this process, for fast tests of what the controller does
with them (no Ray start: a tiny run takes seconds instead of half a minute).

The trainer rank is an `ActorWorker` and the replica a `RolloutWorker`, each an `InProcessGroup`
worker with a thread of its own (calls to one worker run one at a time, in the order they were
submitted, as a Ray actor's do); their weight-sync group is a real gloo group between the two
threads. One replica only: two model copies built at once in one process would race in diffusers'
empty-weights initialisation. `tests/controller/test_bounded.py` checks that a run on these pools
logs what the same run on Ray actors with two replicas logs.

`use_in_process_pools()` makes `diffrl.controller.run.train` (and `diffrl train` in this process)
use them; it returns the function it replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import diffrl.controller.run as run


@contextmanager
def in_process_pools(cfg: Any, plan: Any = None) -> Iterator[tuple[Any, Any]]:
    from diffrl.controller.placement import Separate
    from diffrl.workers.group import InProcessGroup
    from diffrl.workers.reward_workers import create_reward_workers
    from diffrl.workers.roles import ActorWorker, RolloutWorker
    from diffrl.workers.threads import set_threads

    assert cfg.trainer.placement == "separate" and cfg.world_size == 1 and cfg.rollout.replicas == 1
    roles = run.worker_options(cfg)
    with ExitStack() as stack:
        # one compute thread, as each Ray worker of a run capped at OMP_NUM_THREADS=1 gets: the
        # kernels (and so the bits) of the Ray run
        stack.callback(set_threads(1))
        trainer = InProcessGroup(ActorWorker, 1, cfg, **roles)
        stack.callback(trainer.shutdown)
        replicas = InProcessGroup(RolloutWorker, 1, cfg, with_old=bool(roles.get("with_old", False)))
        stack.callback(replicas.shutdown)
        trainer.timeout_s = replicas.timeout_s = cfg.trainer.worker_timeout_s
        placement = Separate(cfg, trainer, replicas, backend="gloo")
        stack.callback(placement.shutdown)
        rewards = create_reward_workers(cfg.reward, use_ray=False)
        stack.callback(rewards.close)
        yield placement, rewards


def use_in_process_pools() -> Any:
    replaced = run.placement_session
    run.placement_session = in_process_pools
    return replaced
