"""Workers: the processes that hold models, and the groups the single controller calls them through.

`group` holds the calling machinery (`WorkerGroup`, `RayGroup`, `InProcessGroup`, `gather`,
`wait_any`, `ensure_ray`); worker roles (actor, rollout, reference, hybrid) are plain classes in `roles`.
"""

from diffrl.workers.group import (
    InProcessGroup,
    RayGroup,
    WorkerError,
    WorkerFuture,
    WorkerGroup,
    WorkerIdentity,
    ensure_ray,
    gather,
    wait_any,
)

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
