"""How the members of a weight sync group meet: an address, a store, a backend of their own.

Rank 0 (trainer rank 0) picks an address (`free_address`, its port reserved until rank 0 listens)
and hosts a `TCPStore` there on a socket bound to that host only (`_listen_socket`); every member
then builds a `ProcessGroupGloo` or `ProcessGroupNCCL` directly on that store (`_make_backend`),
registered nowhere, so it coexists with the default group FSDP uses. This is apart from
`weight_sync` (what is streamed over the group and how) because it is socket and backend setup,
done once when the group forms, while the protocol runs at every sync.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from diffrl.workers.store_host import listening_socket

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_STORE_PREFIX = "diffrl_weight_sync"


def free_address(*, local: bool = True) -> tuple[str, int]:
    """(host, port) for a sync group's store, to be passed to every rank's `join`. Call it on the
    process that will be rank 0, and `join` soon after (within about a minute).

    `local=True` (one machine) gives the loopback address, so nothing listens beyond this host;
    `local=False` gives this node's IP as Ray sees it (the replicas are on other nodes). The port
    is reserved (`_reserve_port`) until rank 0 listens on it in `join`: a port merely free when
    picked could be taken by another process before then, and `join` would fail with EADDRINUSE.
    """
    if local:
        host = "127.0.0.1"
    else:
        import ray

        host = ray.util.get_node_ip_address()
    return host, _reserve_port(host)


def _reserve_port(host: str) -> int:
    """A port on `host` that stays taken for about a minute after this returns, though nothing
    listens on it, so that rank 0 can bind it later, in `join`, perhaps in another process.

    One connection to itself, closed from the accepting side first: that side's end (local address
    `host:port`) waits in TIME_WAIT for a minute. Meanwhile the OS gives the port to no one asking
    for any free port (port 0, or an outgoing connection), and a plain bind of it fails with
    EADDRINUSE; only a bind with SO_REUSEADDR succeeds, as `listening_socket`'s does. Nothing
    holds it in this process, so a store in a child process can take it as well as one here."""
    with listening_socket(host) as listener:
        port = int(listener.getsockname()[1])
        with socket.create_connection((host, port), timeout=10.0):
            accepted, _ = listener.accept()
            accepted.close()
    return port


def _listen_socket(host: str, port: int) -> socket.socket:
    """Rank 0's listening socket for the store at `host:port` (`free_address`'s), handed to the
    store as `master_listen_fd`."""
    try:
        return listening_socket(host, port)
    except OSError as err:
        raise ValueError(
            f"weight sync: cannot listen on {host}:{port} ({err}); pick a fresh address with free_address()"
        ) from None


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _make_backend(backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta, host: str):
    """The backend object itself (a `ProcessGroupGloo` or `ProcessGroupNCCL`): it has the
    collectives we need and is registered nowhere, so the default group never sees it."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # On one machine keep gloo's sockets on loopback; across nodes use the interface gloo picks
        # (GLOO_SOCKET_IFNAME chooses it).
        if host in _LOOPBACK:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    # Connect now, so a missing peer fails `join` (within the timeout) rather than the first sync.
    pg.eager_connect_single_device(_cuda_device())
    return pg


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
