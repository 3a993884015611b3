"""How the members of a weight sync group meet: an address, a store, a backend of their own.

Rank 0 (trainer rank 0) picks an address (`free_address`) and hosts a `TCPStore` there on a socket
bound to that host only (`_listen_socket`); every member then builds a `ProcessGroupGloo` or
`ProcessGroupNCCL` directly on that store (`_make_backend`), registered nowhere, so it coexists
with the default group FSDP uses. This is apart from `weight_sync` (what is streamed over the group
and how) because it is socket and backend setup, done once when the group forms, while the
protocol runs at every sync.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_STORE_PREFIX = "diffrl_weight_sync"


def free_address(*, local: bool = True) -> tuple[str, int]:
    """(host, port) for a sync group's store, to be passed to every rank's `join`. Call it on the
    process that will be rank 0.

    `local=True` (one machine) gives the loopback address, so nothing listens beyond this host;
    `local=False` gives this node's IP as Ray sees it (the replicas are on other nodes). The port
    is free now; rank 0 binds it in `join`, so call `join` soon after (another process could take
    it in between, in which case `join` fails with a clear error rather than joining a stranger).
    """
    if local:
        host = "127.0.0.1"
    else:
        import ray

        host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])


def _listen_socket(host: str, port: int) -> socket.socket:
    """The store's listening socket, bound to `host` only (torch's TCPStore server would listen on
    every interface); handed to the store as `master_listen_fd`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(
            f"weight sync: cannot listen on {host}:{port} ({err}); pick a fresh address with free_address()"
        ) from None
    sock.listen(128)
    return sock


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
