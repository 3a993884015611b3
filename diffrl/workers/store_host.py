"""The TCPStore a Ray worker group's ranks meet at, hosted for them: `host_store`, `StoreHost`; and
`listening_socket`, the socket a store serves on (the weight sync's too, diffrl.workers.sync_rendezvous).

torch's `env://` rendezvous has rank 0 host the store at `MASTER_PORT`. A `RayGroup` must write
that port into every rank's environment before any rank starts, so rank 0 would bind, seconds
later, a port that was merely free when the driver picked it, and any process on the node may take
a free port in between (rank 0 then fails with EADDRINUSE, once in a while). So the group hosts the
store itself, as torchrun's agent does for its workers: the port is picked by the very bind of the
socket the store serves on (`listening_socket` with port 0), before any rank starts, and every
rank, rank 0 included, joins it as a client (`TORCHELASTIC_USE_AGENT_STORE=True` in the ranks'
environment, torch's switch for a store hosted outside the ranks).

The store runs in the driver when rank 0 is on the driver's node, else in a zero-CPU actor in rank
0's bundle, and lives as long as the group: the default process group uses it to its end (new
subgroups, NCCL communicators). It listens on loopback when the whole group is on one node, else on
that node's address. Ray and torch are imported only inside functions.
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["HostedStore", "StoreHost", "host_store", "listening_socket"]

# Starting the store's actor (a fresh worker process) on a loaded node: seconds, unless it hangs.
_START_TIMEOUT_S = 60.0


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host` only (torch's TCPStore server would listen on every
    interface), for a store's `master_listen_fd`. With `port=0` the OS picks a free port in this
    very bind (read it with `getsockname`), so no other process can take it before the store
    serves on it. SO_REUSEADDR: this bind may take a port that diffrl.workers.sync_rendezvous
    reserved (its TIME_WAIT), which a plain bind may not."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


class StoreHost:
    """A TCPStore server on `127.0.0.1` (`local`) or this node's address, on a port the OS picked."""

    def __init__(self, local: bool) -> None:
        from datetime import timedelta

        import ray
        import torch.distributed as dist

        self.host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        listen = listening_socket(self.host)
        self.port = int(listen.getsockname()[1])
        # No fixed number of clients and no wait for them: the ranks connect as they start.
        self.store = dist.TCPStore(
            self.host,
            self.port,
            None,
            True,
            timedelta(minutes=10),
            wait_for_workers=False,
            master_listen_fd=listen.detach(),
        )

    def address(self) -> tuple[str, int]:
        return self.host, self.port


class HostedStore:
    """A group's store, wherever it runs: its `address`, and `close` once the group's ranks are gone."""

    def __init__(self, address: tuple[str, int], host: StoreHost | None, actor: Any = None) -> None:
        self.address = address
        self._host, self._actor = host, actor

    def close(self) -> None:
        if self._actor is not None:
            import ray

            ray.kill(self._actor)
        self._host = self._actor = None


def _driver_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def host_store(node_id: str, placement_group: Any, bundle_index: int, local: bool) -> HostedStore:
    """Host a store for a group whose rank 0 runs on `node_id`, in that rank's `bundle_index` of
    `placement_group`; `local`: the whole group is on that node (the store listens on loopback)."""
    if node_id == _driver_node_id():
        host = StoreHost(local)
        return HostedStore(host.address(), host)
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(
        placement_group=placement_group, placement_group_bundle_index=bundle_index
    )
    actor = ray.remote(num_cpus=0)(StoreHost).options(scheduling_strategy=strategy).remote(local)
    try:
        address = ray.get(actor.address.remote(), timeout=_START_TIMEOUT_S)
    except BaseException:
        ray.kill(actor)
        raise
    return HostedStore(tuple(address), None, actor)
