"""Where a group's ranks meet: a port taken by another process while a group forms cannot break it.

Another process on the machine may bind any free port at any moment (Ray's own workers do, as does
any test or server). A rendezvous that picks a free port, lets it go and binds it again later can
lose it in between (EADDRINUSE, once in a while). These tests take the port in that very gap: a
RayGroup's MASTER_PORT just before its actors start, a weight-sync address before rank 0 listens.
"""

from __future__ import annotations

import errno
import socket
import sys
from datetime import timedelta

import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from diffrl.workers import RayGroup
from diffrl.workers.sync_rendezvous import _listen_socket, free_address

# pytest imports this file from tests/workers, which Ray's workers do not have on their path.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Joiner:
    """Joins the group's gloo process group in its constructor, as the training workers do."""

    def __init__(self) -> None:
        from diffrl.train.distributed import init_distributed

        init_distributed("gloo", timeout=timedelta(seconds=60))

    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor.item())


def _take(host: str, port: int) -> socket.socket | OSError:
    """What another process would do: listen on the port (plainly, no SO_REUSEADDR)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(1)
    except OSError as err:
        sock.close()
        return err
    return sock


class _ThiefRemote:
    """`ray.remote(Joiner)` as RayGroup uses it, taking rank 0's MASTER_PORT before any actor starts."""

    def __init__(self, made, taken: list) -> None:
        self.made, self.taken = made, taken

    def options(self, **options):
        if not self.taken:
            env = options["runtime_env"]["env_vars"]
            self.taken.append(_take(env["MASTER_ADDR"], int(env["MASTER_PORT"])))
        return self.made.options(**options)


def _steal_master_port(monkeypatch) -> list:
    taken: list = []
    real_remote = ray.remote

    def remote(*args, **kwargs):
        made = real_remote(*args, **kwargs)
        return _ThiefRemote(made, taken) if args and args[0] is Joiner else made

    monkeypatch.setattr(ray, "remote", remote)
    return taken


def _check_forms_despite_thief(monkeypatch, **group_options) -> RayGroup:
    taken = _steal_master_port(monkeypatch)
    try:
        group = RayGroup(Joiner, 2, num_cpus=0.5, **group_options)
        try:
            assert group.scatter("all_reduce", [1.5, 2.0]) == [3.5, 3.5]
            assert group.env_vars[0]["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback only
        finally:
            group.shutdown()
    finally:
        for item in taken:
            if isinstance(item, socket.socket):
                item.close()
    # The port was held from the moment it was chosen: the other process could not take it.
    assert len(taken) == 1 and isinstance(taken[0], OSError), taken
    assert taken[0].errno == errno.EADDRINUSE
    return group


def test_ray_group_forms_though_another_process_binds_its_port_first(shared_ray, monkeypatch):
    """The driver hosts the store (rank 0 on its node): the port is bound before the actors start."""
    _check_forms_despite_thief(monkeypatch)


def test_ray_group_whose_rank_0_is_on_another_node_hosts_the_store_there(shared_ray, monkeypatch):
    """On a multi-node cluster rank 0's node is not the driver's: a small actor in rank 0's bundle
    hosts the store. Here the driver is told rank 0 runs elsewhere, so that path runs on one node."""
    from diffrl.workers import store_host

    monkeypatch.setattr(store_host, "_driver_node_id", lambda: "another node")
    group = _check_forms_despite_thief(monkeypatch)
    assert group._stores == []  # shutdown ended the store's actor too


def test_weight_sync_address_is_held_until_rank_0_listens():
    """free_address's port stays reserved after it returns (another process's bind fails), while
    rank 0's own listening socket (SO_REUSEADDR, as `join` binds it) takes it at once."""
    host, port = free_address()
    taken = _take(host, port)
    if isinstance(taken, socket.socket):
        taken.close()
    assert isinstance(taken, OSError) and taken.errno == errno.EADDRINUSE, taken
    listen = _listen_socket(host, port)
    try:
        assert listen.getsockname() == (host, port)
        with socket.create_connection((host, port), timeout=5):
            pass  # it listens
    finally:
        listen.close()
