"""Separate placement across Ray nodes (trainer.ray_address): a cluster of two simulated nodes on
this machine (`ray.cluster_utils.Cluster`), the trainer pinned to one by a custom resource and the
rollout replica to the other, weights streamed between them.

The suite's conftest keeps Ray in single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): both
nodes then take 127.0.0.1 as their address, so the cluster, the weight-sync store (hosted on the
trainer's node address when a ray_address is set) and gloo all stay on loopback; the test checks it.
"""

import ipaddress
import os
import threading

import psutil
import pytest

from diffrl.config import load_config
from diffrl.controller.placement import Separate
from diffrl.controller.policy_gradient import PolicyGradientTrainer
from diffrl.controller.run import placement_session, preflight, train
from diffrl.telemetry import RunLogger, read_metrics

_SHUTDOWN_TIMEOUT_S = 60.0


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@pytest.fixture(scope="module")
def two_nodes():
    """A head node offering `trainer_node` and a second node offering `rollout_node`, 2 CPUs each
    (the trainer rank and the reward worker fit on the head, the replica on the other)."""
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"trainer_node": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, resources={"rollout_node": 1})
        yield cluster
    finally:
        import ray

        if ray.is_initialized():  # a failed test may have left the driver connected
            ray.shutdown()
        # Cluster.shutdown waits for its processes without a limit: give it one, then kill them.
        stopper = threading.Thread(target=cluster.shutdown, daemon=True)
        stopper.start()
        stopper.join(_SHUTDOWN_TIMEOUT_S)
        if stopper.is_alive():
            for node in [cluster.head_node, *cluster.worker_nodes]:
                if node is not None:
                    node.kill_all_processes(check_alive=False, allow_graceful=False)
            pytest.fail(f"the two-node Ray cluster did not shut down within {_SHUTDOWN_TIMEOUT_S:g} s")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))


def overrides(cluster, tmp_path) -> list[str]:
    return [
        f"trainer.ray_address={cluster.address}",
        "trainer.placement=separate",
        "rollout.replicas=1",
        "trainer.ray_resources={trainer_node: 1}",
        "rollout.ray_resources={rollout_node: 1}",
        "trainer.total_steps=2",
        "trainer.save_freq=0",
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={tmp_path}",
    ]


def _nodes_with(resource: str) -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node["Alive"] and resource in node["Resources"]}


def _listening(pids) -> list[tuple[int, str, int]]:
    rows = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        rows += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return rows


def test_trainer_and_replica_on_different_nodes_share_weights_bitwise(two_nodes, tmp_path):
    cfg = load_config("tiny_sd3", overrides(two_nodes, tmp_path))
    train_records, _ = preflight(cfg)
    with (
        placement_session(cfg) as (placement, rewards),
        RunLogger(tmp_path, ["jsonl"], total_steps=2, config={}, run_name="sync") as logger,
    ):
        assert isinstance(placement, Separate)
        trainer_node = placement.trainer.identities[0].node_id
        replica_node = placement.replicas.identities[0].node_id
        # each pool runs on the one node started with its resource, and those are two nodes
        assert _nodes_with("trainer_node") == {trainer_node}
        assert _nodes_with("rollout_node") == {replica_node}
        assert trainer_node != replica_node

        # Everything listening (both nodes' Ray servers, the trainer rank hosting the weight-sync
        # store, the replica) is on loopback, and so are the replica's connections to the trainer
        # (the weight-sync store and gloo pair among them).
        trainer_pid = placement.trainer.identities[0].pid
        replica_pid = placement.replicas.identities[0].pid
        ray_pids = {
            info.process.pid
            for node in [two_nodes.head_node, *two_nodes.worker_nodes]
            for infos in node.all_processes.values()
            for info in infos
        }
        listening = _listening(ray_pids | {trainer_pid, replica_pid})
        assert not [row for row in listening if not _is_loopback(row[1])], listening
        trainer_ports = {port for pid, _, port in listening if pid == trainer_pid}
        to_trainer = [
            c
            for c in psutil.Process(replica_pid).net_connections(kind="inet")
            if c.raddr and c.raddr.port in trainer_ports
        ]
        assert to_trainer, "the replica has no connection to the trainer rank (weight sync not joined?)"
        assert all(_is_loopback(c.raddr.ip) and _is_loopback(c.laddr.ip) for c in to_trainer), to_trainer

        loop = PolicyGradientTrainer(
            cfg,
            tmp_path,
            reuse_rollout_log_probs=False,
            placement=placement,
            rewards=rewards,
            train_records=train_records,
            val_records=[],
            logger=logger,
        )
        before = placement.replicas.call("weight_digest")[0]
        for step in (1, 2):
            loop.step = step
            loop.train_step()
            placement.sync_weights(step)
            trainer = placement.trainer.call("weights.digest")[0]
            assert placement.replicas.call("weight_digest")[0] == trainer, f"step {step}: weights differ"
            assert trainer != before  # the step changed what crossed the nodes
            before = trainer


def test_train_runs_to_completion_across_two_nodes(two_nodes, tmp_path):
    run_dir = train("tiny_sd3", [*overrides(two_nodes, tmp_path), "trainer.run_name=multinode"])
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert sorted(metrics) == [1, 2]
    assert [metrics[k]["rollout/weight_version"] for k in (1, 2)] == [0, 1]
    assert "val/rewards/mean" in metrics[2]
    import ray

    assert not ray.is_initialized()  # train() disconnected from the cluster it joined
