"""Workers: the processes that hold models, and the groups the single controller calls them through.

The calling machinery, each module importing only from those above it:

- `errors`: `WorkerError` (a worker's method raised or its process died) and `WorkerIdentity`
  (where a Ray worker runs), with the last lines a dead worker logged.
- `futures`: `WorkerFuture` (one pending call) and the waits `gather` and `wait_any`: fail fast,
  naming a dead worker before the peers it broke.
- `group`: the `WorkerGroup` API (`call`, `scatter`, `submit`, their `_async` forms) and
  `InProcessGroup`.
- `ray_group`: `RayGroup` (one Ray actor per worker, wired for torch.distributed) and
  `ensure_ray`.

Worker roles (actor, rollout, hybrid) are plain classes in `roles` and `rollout_worker`, each
composed of parts the controller addresses as `"part.method"`: `staging` (a step's trajectories
on the trainer ranks and the passes over them), `weight_source` (the trainer's side of a weight
sync), `checkpointing`, `reporting`. Weight sync from trainer ranks to rollout replicas is
`weight_sync` (the group and its protocol), over `sync_rendezvous` (how the group forms) and
`weight_specs` (what it streams, described); the thread plan is `threads`.
"""

from diffrl.workers.errors import WorkerError, WorkerIdentity
from diffrl.workers.futures import WorkerFuture, gather, wait_any
from diffrl.workers.group import InProcessGroup, WorkerGroup
from diffrl.workers.ray_group import RayGroup, ensure_ray

__all__ = [
    "InProcessGroup",
    "RayGroup",
    "WorkerError",
    "WorkerFuture",
    "WorkerGroup",
    "WorkerIdentity",
    "ensure_ray",
    "gather",
    "wait_any",
]
