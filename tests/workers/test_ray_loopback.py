"""A local Ray cluster started by `ensure_ray` listens on loopback only, and requires Ray's token.

Each check runs in a fresh Python process: Ray reads its single-machine switch when first imported,
and a cluster started inside the pytest process would outlive the test.
"""

import json
import os
import subprocess
import sys
import textwrap

# Runs in the child: the `diffrl train` import path, then ensure_ray, one actor (so a worker process
# exists with its own gRPC server), then every listening TCP socket of the driver and its descendants
# (GCS, raylet, agents, workers are all started under the driver).
CLUSTER_SCRIPT = textwrap.dedent(
    """
    import json, os, psutil, sys
    import diffrl.controller.run  # what `diffrl train` imports before it starts Ray
    from diffrl.workers.ray_group import ensure_ray
    assert "ray" not in sys.modules, "diffrl imported ray before ensure_ray could configure it"
    assert ensure_ray(num_cpus=1)
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    @ray.remote(num_cpus=0)
    class Echo:
        def pid(self):
            return os.getpid()

    actor_pid = ray.get(Echo.remote().pid.remote(), timeout=120)
    me = psutil.Process()
    listening, errors = [], []
    # The actor's worker is named explicitly: Ray may start workers outside the driver's process tree.
    actor = psutil.Process(actor_pid)
    procs = {p.pid: p for p in [me, *me.children(recursive=True), actor, *actor.children(recursive=True)]}
    for proc in procs.values():
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error as err:
            errors.append([proc.pid, repr(err)])
            continue
        listening += [
            [proc.pid, name, c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN
        ]
    print(json.dumps({"actor_pid": actor_pid, "listening": listening, "errors": errors, "scanned": sorted(procs), "token": is_token_auth_enabled(),
                      "node_ip": ray.util.get_node_ip_address()}))
    ray.shutdown()
    """
)


def _child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The suite's conftest sets Ray's switch for every test; the child must show ensure_ray sets it.
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.pop("RAY_AUTH_MODE", None)
    return env


def _is_loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # "::ffff:127.0.0.1", as gRPC reports a dual-stack loopback bind
    return address.is_loopback


def test_is_loopback_helper():
    assert all(map(_is_loopback, ["127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.0.53"]))
    assert not any(map(_is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1"]))


def test_local_cluster_listens_on_loopback_only_and_requires_a_token():
    result = subprocess.run(
        [sys.executable, "-c", CLUSTER_SCRIPT],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    listening = report["listening"]
    names = {name for _, name, _, _ in listening}
    # The cluster's servers were all found (else an empty list would pass vacuously).
    assert {"gcs_server", "raylet"} <= names, listening
    # The actor's worker was looked at too (its gRPC port is not always listed by the time we look).
    assert report["actor_pid"] in report["scanned"] and not report["errors"], report
    exposed = [row for row in listening if not _is_loopback(row[2])]
    assert not exposed, f"Ray processes listening beyond loopback: {exposed}"
    assert report["node_ip"] == "127.0.0.1"
    assert report["token"], "Ray's token authentication is off for the local cluster"


def test_ray_imported_first_is_a_clear_error_not_an_exposed_cluster():
    script = "import ray\nfrom diffrl.workers.ray_group import ensure_ray\nensure_ray(num_cpus=1)\n"
    result = subprocess.run(
        [sys.executable, "-c", script], env=_child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "ValueError" in result.stderr and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in result.stderr
