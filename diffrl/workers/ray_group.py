"""Ray worker groups: `RayGroup`, `ensure_ray`, `learn_identities`: the worker code that knows Ray.

- `RayGroup`: the `WorkerGroup` (see `group`) of one Ray actor per worker, each in its own bundle
  of a placement group, with the distributed environment (`DIST_ENV_VARS`: rank, world size, local
  rank, the address of a store the group hosts for them: `store_host`) that lets the workers form
  a torch.distributed process group among themselves. It asks each actor where it runs
  (`learn_identities`), so a later failure names the worker and quotes its last log lines
  (`errors`), and watches its actors (`liveness`), so one that dies is noticed within about a
  second, busy or idle.
- `ensure_ray`: the one place diffrl calls `ray.init`: a local cluster on loopback only, or an
  existing one at an address probed first.

Apart from the `WorkerGroup` API and `InProcessGroup` (`group`) so that the in-process code and
its tests read without Ray's placement, environment and cluster handling. Ray itself is imported
only inside functions. Builds on `group`, `futures`, `liveness`, `errors` and `store_host`.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from diffrl.workers import liveness
from diffrl.workers.errors import WorkerIdentity
from diffrl.workers.futures import RayFuture, WorkerFuture, gather
from diffrl.workers.group import WorkerGroup, _check_reserved_names, _check_size, bound_method
from diffrl.workers.store_host import HostedStore, host_store

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

__all__ = ["DIST_ENV_VARS", "PLACEMENT_STRATEGIES", "RayGroup", "ensure_ray", "learn_identities"]


PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENT_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

# Environment variables RayGroup sets on every actor; user env_vars may not override them.
DIST_ENV_VARS: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Start a local Ray cluster (`address=None`) or join one (`"auto"`, `"host:port"`, `"ray://..."`).

    The one place diffrl calls `ray.init` (groups never do, so tests and users keep control of the
    cluster). Returns True if this call started or joined Ray, False if Ray was already running in
    this process (the caller then should not `ray.shutdown()` it). A `host:port` address is probed
    with a plain TCP connection first, so an unreachable cluster fails in a second with a message
    rather than after Ray's long connection retries.

    A local cluster listens on loopback only. Ray resolves `_node_ip_address="127.0.0.1"` back to
    the machine's network address on Linux and then binds GCS, raylet, workers and agents to every
    interface; the one switch that keeps them all on 127.0.0.1 is Ray's single-machine mode
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the default on macOS and Windows), which Ray reads when
    it is first imported. This sets it unless the user chose a value; `=1` opts out (a local head
    other machines may join). Ray >= 2.59 also requires its token on a local cluster (~/.ray/auth_token).

    `ray.init` replaces the process's SIGTERM handler with one that calls `sys.exit(15)`, which
    ends in SIGABRT once the interpreter tears down Ray's threads; from the main thread this puts
    back the handler that was there before (the one `diffrl train` installs to stop cleanly, or
    the default: end at once, Ray's processes sharing the driver's fate).
    """
    import os
    import sys

    if address is None and "ray" not in sys.modules:
        os.environ.setdefault(_RAY_CLUSTER_MODE_ENV, "0")
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER and os.environ.get(_RAY_CLUSTER_MODE_ENV) is None:
            raise ValueError(
                "ensure_ray(): Ray was imported before diffrl could keep the local cluster on loopback, "
                "so it would listen on every network interface. Set "
                f"{_RAY_CLUSTER_MODE_ENV}=0 before starting Python (or =1 to accept a cluster reachable "
                "from the network), or start Ray yourself before calling diffrl"
            )
        from diffrl.telemetry.console import ray_init_kwargs

        # address="local": a cluster of this run's own. Without an address Ray joins any cluster
        # already running on the machine (RAY_ADDRESS, the last `ray start`, or a GCS process it
        # finds), e.g. another user's or another diffrl run's, sharing its workers and failing on
        # num_cpus. Then the workers' quieting environment and Ray's log level.
        with _keeping_sigterm_handler():
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **ray_init_kwargs())
        return True
    if num_cpus is not None:
        raise ValueError(
            f"ensure_ray(address={address!r}, num_cpus={num_cpus}): num_cpus only applies to a local "
            "cluster this process starts; an existing cluster has its own resources (drop num_cpus)"
        )
    _probe_address(address)
    try:
        from diffrl.telemetry.console import ray_init_kwargs

        with _keeping_sigterm_handler():
            ray.init(address=address, **ray_init_kwargs())
    except ConnectionError as err:
        raise ConnectionError(
            f"could not connect to the Ray cluster at address={address!r}: {err}. Start one with "
            "`ray start --head` on the head node, or leave the address empty (trainer.ray_address=null) "
            "to start a local cluster"
        ) from err
    return True


class _keeping_sigterm_handler:
    """Put back, after `ray.init`, the SIGTERM handler from before it (see `ensure_ray`)."""

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.getsignal(signal.SIGTERM) if main else None

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


# Ray's switch for single-machine mode (ray._private.ray_constants); "0" = loopback-only local cluster.
_RAY_CLUSTER_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _probe_address(address: str) -> None:
    """Fail fast and clearly when a `host:port` (or `ray://host:port`) address does not answer."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return  # "auto" (and anything not host:port) is resolved by Ray itself
    try:
        with socket.create_connection((host, int(port)), timeout=3.0):
            pass
    except OSError as err:
        raise ConnectionError(
            f"the Ray cluster at address={address!r} is unreachable ({err}); check the host and port "
            "(`ray status` on the head node prints them), start one with `ray start --head`, or leave "
            "the address empty (trainer.ray_address=null) to start a local cluster"
        ) from err


# The identity call runs after the constructors, on idle actors: seconds, unless an actor hangs.
_IDENTITY_TIMEOUT_S = 60.0


class RayGroup(WorkerGroup):
    """`n` Ray actors of `cls`, one per placement-group bundle, wired for torch.distributed.

    Every actor is `ray.remote(cls).options(num_cpus=..., num_gpus=..., scheduling_strategy=<its
    bundle>, runtime_env={"env_vars": ...})`, constructed with `*args, **kwargs`. The environment
    holds `RANK`, `WORLD_SIZE`, `LOCAL_RANK`/`LOCAL_WORLD_SIZE` (position among this group's
    workers on the same node), `MASTER_ADDR`/`MASTER_PORT` (a store on rank 0's node that the group
    hosts for the ranks, diffrl.workers.store_host; loopback when the group is on one node) and
    `TORCHELASTIC_USE_AGENT_STORE=True` (so torch's `env://` rendezvous joins that store, rank 0 as
    well), plus `env_vars` (one mapping for all ranks, or a sequence of one per rank).

    With `num_gpus=1` Ray sets `CUDA_VISIBLE_DEVICES` to the actor's GPU, so a worker uses
    `cuda:0` (its only visible device), not `cuda:LOCAL_RANK`.

    Placement: by default the group creates (and at `shutdown` removes) a placement group of `n`
    bundles `{"CPU": num_cpus, "GPU": num_gpus, **resources}` with `placement_strategy` (`PACK`: as
    few nodes as possible, for NVLink; `SPREAD`: across nodes); custom `resources` (e.g.
    `{"rollout_node": 1}`) keep a pool on the nodes started with them. Pass an existing `placement_group` (and
    `bundle_indices`, default `range(n)`) to colocate groups: e.g. a reward group with fractional
    GPUs in the bundles of the rollout group; the group then does not remove it.

    Requires a running Ray (`ensure_ray`); waits for placement (`placement_timeout_s`, then a
    `TimeoutError` listing the cluster's free resources) and for every constructor (errors
    re-raised as `WorkerError` with the rank). Then it asks each actor where it runs
    (`identities`: node IP and id, PID, log files), so a later call failing because the actor died
    raises a `WorkerError` that names it and quotes its last log lines, and watches the actors
    until `shutdown` (`liveness`): one that dies while the controller waits on anything else
    (another group, or this group's other ranks) ends that wait with its `WorkerError` too, and
    the message says whether it was running a call (which) or idle since its last one.
    """

    OPTIONS: tuple[str, ...] = (
        "num_cpus",
        "num_gpus",
        "env_vars",
        "placement_strategy",
        "placement_group",
        "bundle_indices",
        "placement_timeout_s",
        "resources",
    )

    def __init__(
        self,
        cls: type,
        n: int,
        *args: Any,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env_vars: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        placement_strategy: PlacementStrategy = "PACK",
        placement_group: PlacementGroup | None = None,
        bundle_indices: Sequence[int] | None = None,
        placement_timeout_s: float | None = 300.0,
        resources: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        import ray
        from ray.actor import ActorClass
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _check_size(n)
        if isinstance(cls, ActorClass):
            raise TypeError("RayGroup takes the plain worker class, not a ray.remote(...) actor class")
        _check_reserved_names(cls, self.OPTIONS, "RayGroup")
        if not ray.is_initialized():
            raise RuntimeError(
                "RayGroup needs a running Ray: call diffrl.workers.ensure_ray(address) first (the "
                "trainer does, from trainer.ray_address), or use InProcessGroup"
            )
        if num_cpus < 0 or num_gpus < 0 or (num_cpus == 0 and num_gpus == 0 and placement_group is None):
            raise ValueError(
                f"RayGroup(num_cpus={num_cpus}, num_gpus={num_gpus}): each worker needs a positive "
                "amount of CPUs or GPUs (its placement-group bundle cannot be empty)"
            )
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy={placement_strategy!r} is not one of {list(PLACEMENT_STRATEGIES)}"
            )
        per_rank_env = _per_rank_env_vars(env_vars, n)

        self.cls = cls
        self.size = n
        self.actors: list[ActorHandle] = []
        self.identities: list[WorkerIdentity] = []  # by rank, once every constructor returned
        # What each rank is doing, for the message of a death the watch finds (`_describe`): by
        # rank, its calls that may still run, oldest first, as (label, object ref), and the label
        # of its last call. The watch forgets the finished ones every probe round (`_forget_done`):
        # a ref kept longer would keep the call's result in Ray's object store after the
        # controller dropped it.
        self._calls: list[deque[tuple[str, Any]]] = [deque() for _ in range(n)]
        self._last_call = [""] * n
        self._calls_lock = threading.Lock()
        self._watch: liveness.Watch | None = None
        self._stores: list[HostedStore] = []  # the ranks' store (`_master_address`)
        self._owns_placement_group = placement_group is None
        if placement_group is None:
            bundle = {"CPU": float(num_cpus), "GPU": float(num_gpus), **(resources or {})}
            bundle = {key: float(value) for key, value in bundle.items() if value > 0}
            placement_group = ray.util.placement_group(
                [dict(bundle) for _ in range(n)], strategy=placement_strategy
            )
            bundle_indices = list(range(n))
        else:
            bundle_indices = list(range(n)) if bundle_indices is None else list(bundle_indices)
            if len(bundle_indices) != n:
                raise ValueError(
                    f"bundle_indices={bundle_indices} has {len(bundle_indices)} entries for n={n} workers"
                )
        self.placement_group = placement_group
        self.bundle_indices = bundle_indices
        try:
            self._wait_placed(placement_timeout_s, num_cpus, num_gpus)
            bundle_nodes = ray.util.placement_group_table(placement_group)["bundles_to_node_id"]
            nodes = [bundle_nodes[index] for index in bundle_indices]
            one_node = all(node == nodes[0] for node in nodes)
            self.master_addr, self.master_port = self._master_address(nodes[0], local=one_node)
            self.node_ids = nodes
            self.env_vars = [
                {**per_rank_env[rank], **self._dist_env(rank, nodes)} for rank in range(n)
            ]  # what each actor got
            remote_cls = ray.remote(cls)
            for rank in range(n):
                options = remote_cls.options(
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    resources=dict(resources or {}),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=placement_group,
                        placement_group_bundle_index=bundle_indices[rank],
                    ),
                    runtime_env={"env_vars": self.env_vars[rank]},
                )
                self.actors.append(options.remote(*args, **kwargs))
            # Wait for every constructor, so a failing __init__ surfaces here, with its rank.
            label = f"{cls.__name__}.__init__"
            gather(
                [
                    RayFuture(actor.__ray_ready__.remote(), rank, n, label)
                    for rank, actor in enumerate(self.actors)
                ]
            )
            self.identities = self._learn_identities(_IDENTITY_TIMEOUT_S)
            self._watch = liveness.watch(self.actors, self.identities, self._describe, self._forget_done)
        except BaseException:
            self.shutdown()
            raise

    def _wait_placed(self, timeout_s: float | None, num_cpus: float, num_gpus: float) -> None:
        import ray

        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(
                f"could not place {self.size} workers of {self.cls.__name__} (num_cpus={num_cpus}, "
                f"num_gpus={num_gpus} each) within placement_timeout_s={timeout_s}: the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free. Ask for fewer "
                "workers or resources, or add nodes"
            )

    def _master_address(self, node_id: str, local: bool = False) -> tuple[str, int]:
        """Host the ranks' store on rank 0's node `node_id` (diffrl.workers.store_host): its address.
        `local`: the whole group is on that node, so the store listens on loopback."""
        self._stores.append(host_store(node_id, self.placement_group, self.bundle_indices[0], local))
        return self._stores[-1].address

    def _dist_env(self, rank: int, nodes: Sequence[str]) -> dict[str, str]:
        same_node = [r for r in range(self.size) if nodes[r] == nodes[rank]]
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.size),
            "LOCAL_RANK": str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }

    def _share_args(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Serialize each argument once (`ray.put`), not once per actor; Ray resolves top-level refs."""
        import ray

        if self.size == 1:
            return args, kwargs

        def put(value: Any) -> Any:
            return value if isinstance(value, ray.ObjectRef) else ray.put(value)

        return tuple(put(a) for a in args), {key: put(value) for key, value in kwargs.items()}

    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerFuture:
        actor = self.actors[rank]
        if "." in method:  # a part's method: the actor's own `__ray_call__` runs it (in call order)
            ref = actor.__ray_call__.remote(_call_part, method, *args, **kwargs)
        else:
            ref = getattr(actor, method).remote(*args, **kwargs)
        label = f"{self.cls.__name__}.{method}"
        with self._calls_lock:
            self._calls[rank].append((label, ref))
            self._last_call[rank] = label
        return RayFuture(ref, rank, self.size, label, self.identities[rank])

    def _describe(self, rank: int) -> tuple[str, str]:
        """(state, method) of worker `rank` (WorkerError.state), asked by the liveness watch when
        it finds the worker dead: the oldest of its calls not finished, or one that failed with its
        death, is the one it was running; else it was idle since its last call."""
        import ray

        with self._calls_lock:
            calls, last = list(self._calls[rank]), self._last_call[rank]
        for label, ref in calls:
            ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
            if not ready:
                return "running", label
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                return "running", label  # failed by the death itself
            except Exception:
                continue  # the method raised, or its result is lost: not what it was running
        return "idle", last

    def _forget_done(self) -> None:
        """Drop the finished calls (calls to one actor finish in order): run by the liveness watch."""
        import ray

        with self._calls_lock:
            for calls in self._calls:
                while calls:
                    ready, _ = ray.wait([calls[0][1]], timeout=0, fetch_local=False)
                    if not ready:
                        break
                    calls.popleft()

    def _learn_identities(self, timeout_s: float) -> list[WorkerIdentity]:
        return learn_identities(self.actors, self.cls.__name__, timeout_s)

    def shutdown(self) -> None:
        """Kill the actors (at once, running calls included), end their store, remove our placement
        group."""
        import ray

        if self._watch is not None:  # first: the kills below are no deaths to report
            self._watch.stop()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        for store in getattr(self, "_stores", []):  # after the ranks: they use it to their end
            store.close()
        self._stores = []
        if self._owns_placement_group and getattr(self, "placement_group", None) is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        self._closed = True


def _call_part(worker: Any, method: str, /, *args: Any, **kwargs: Any) -> Any:
    """Runs inside an actor (`__ray_call__`): `part.method(*args, **kwargs)` of the worker."""
    return bound_method(worker, method)(*args, **kwargs)


def learn_identities(actors: Sequence[Any], cls_name: str, timeout_s: float) -> list[WorkerIdentity]:
    """Ask every Ray actor where it runs (one round trip), for failure messages that can name it."""
    label = f"{cls_name}.__ray_call__"
    futures = [
        RayFuture(actor.__ray_call__.remote(_actor_identity), rank, len(actors), label)
        for rank, actor in enumerate(actors)
    ]
    return [
        WorkerIdentity(rank, cls_name, node_ip, node_id, pid, log_files, actor_id)
        for rank, (node_ip, node_id, pid, log_files, actor_id) in enumerate(
            gather(futures, timeout=timeout_s)
        )
    ]


def _actor_identity(_instance: Any) -> tuple[str, str, int, tuple[str, ...], str]:
    """Runs inside an actor (`__ray_call__`): its node, PID, the files fd 1 and 2 point to, its actor id."""
    import ray

    files: list[str] = []
    for fd in (1, 2):
        try:
            # Linux's view of the process's own descriptors; elsewhere (macOS) this fails.
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.path.isabs(target) and os.path.isfile(target) and target not in files:
            files.append(target)
    return (
        ray.util.get_node_ip_address(),
        ray.get_runtime_context().get_node_id(),
        os.getpid(),
        tuple(files),
        ray.get_runtime_context().get_actor_id(),
    )


def _per_rank_env_vars(
    env_vars: Mapping[str, str] | Sequence[Mapping[str, str]] | None, n: int
) -> list[dict[str, str]]:
    """One env mapping per rank from `None`, a shared mapping, or a per-rank sequence; validated."""
    if env_vars is None:
        per_rank: list[Mapping[str, str]] = [{} for _ in range(n)]
    elif isinstance(env_vars, Mapping):
        per_rank = [env_vars] * n
    else:
        per_rank = list(env_vars)
        if len(per_rank) != n:
            raise ValueError(
                f"env_vars has {len(per_rank)} per-rank mappings for n={n} workers: pass one mapping "
                "for all ranks, or exactly one per rank"
            )
    checked = []
    for rank, env in enumerate(per_rank):
        clashes = sorted(set(env) & set(DIST_ENV_VARS))
        if clashes:
            raise ValueError(
                f"env_vars for rank {rank} sets {clashes}, which RayGroup sets itself; remove them"
            )
        bad = {
            key: value for key, value in env.items() if not isinstance(key, str) or not isinstance(value, str)
        }
        if bad:
            raise ValueError(f"env_vars for rank {rank} must map str to str; not: {bad}")
        checked.append(dict(env))
    return checked
