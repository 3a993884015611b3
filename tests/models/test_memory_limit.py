"""`diffrl.models.memory.memory_limit`: the least of physical memory, the process's cgroup v1 and v2
memory limits (its own cgroup and every ancestor) and its RLIMIT_AS / RLIMIT_DATA, on fake
/proc and /sys trees in a temporary root, with the physical memory and getrlimit monkeypatched.
The trees follow the kernel's formats (proc(5): /proc/self/cgroup, /proc/self/mountinfo)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

import diffrl.models.memory as memory

GIB = 1 << 30
PHYSICAL = int(23.5 * GIB)
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes for "no limit" on 64-bit kernels

MOUNTINFO_V1 = """\
22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
31 22 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
MOUNTINFO_V2 = """\
22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate
"""


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    """23.5 GiB of physical memory and no rlimits, unless a test sets them."""
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: PHYSICAL)
    limits = {resource.RLIMIT_AS: resource.RLIM_INFINITY, resource.RLIMIT_DATA: resource.RLIM_INFINITY}
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (limits[which], resource.RLIM_INFINITY))
    return limits


def write(root: Path, path: str, text: str) -> None:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def v1_tree(root: Path, job_limit: str, parent_limit: str = V1_UNLIMITED) -> None:
    """A cgroup-v1 host: the process in the memory cgroup /batch/job42 (the hierarchy mounted whole)."""
    write(root, "proc/self/mountinfo", MOUNTINFO_V1)
    write(root, "proc/self/cgroup", "4:memory:/batch/job42\n2:cpu,cpuacct:/batch/job42\n0::/\n")
    write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", V1_UNLIMITED)
    write(root, "sys/fs/cgroup/memory/batch/memory.limit_in_bytes", parent_limit)
    write(root, "sys/fs/cgroup/memory/batch/job42/memory.limit_in_bytes", job_limit)


def test_a_cgroup_v1_limit_is_read(tmp_path):
    """The probe's case: an 8 GiB cgroup-v1 limit on a 23.5 GiB host (the check saw 23.5 GiB)."""
    v1_tree(tmp_path, str(8 * GIB))
    limit = memory.memory_limit(tmp_path)
    assert limit.bytes == 8 * GIB
    assert limit.source == f"cgroup v1 memory.limit_in_bytes of {tmp_path}/sys/fs/cgroup/memory/batch/job42"
    assert limit.describe().startswith("8.0 GiB (cgroup v1")


def test_cgroup_v1s_unlimited_value_is_no_limit(tmp_path):
    v1_tree(tmp_path, V1_UNLIMITED)
    assert memory.cgroup_limits(tmp_path) == []
    assert memory.memory_limit(tmp_path) == memory.MemoryLimit(PHYSICAL, "physical memory")


def test_a_parents_v1_limit_binds_its_children(tmp_path):
    v1_tree(tmp_path, V1_UNLIMITED, parent_limit=str(6 * GIB))
    assert memory.memory_limit(tmp_path).bytes == 6 * GIB


def test_a_cgroup_v2_limit_and_its_ancestors(tmp_path):
    write(tmp_path, "proc/self/mountinfo", MOUNTINFO_V2)
    write(tmp_path, "proc/self/cgroup", "0::/user.slice/job.scope\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", str(12 * GIB))
    write(tmp_path, "sys/fs/cgroup/user.slice/job.scope/memory.max", "max")
    limit = memory.memory_limit(tmp_path)
    assert limit.bytes == 12 * GIB and limit.source.startswith("cgroup v2 memory.max")
    write(tmp_path, "sys/fs/cgroup/user.slice/job.scope/memory.max", str(3 * GIB))
    assert memory.memory_limit(tmp_path).bytes == 3 * GIB


def test_a_container_that_sees_only_its_own_cgroup_reads_the_mount_point(tmp_path):
    """Without a cgroup namespace /proc/self/cgroup names the host's path, which the container's
    mount (of that very cgroup) does not hold: the mount point's own file is the limit."""
    write(
        tmp_path,
        "proc/self/mountinfo",
        "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,relatime - cgroup cgroup rw,memory\n",
    )
    write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(2 * GIB))
    assert memory.memory_limit(tmp_path).bytes == 2 * GIB
    write(tmp_path, "proc/self/cgroup", "4:memory:/elsewhere\n")
    assert memory.memory_limit(tmp_path).bytes == 2 * GIB


def test_without_proc_the_usual_mount_points_are_read(tmp_path):
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(5 * GIB))
    assert memory.memory_limit(tmp_path).bytes == 5 * GIB
    write(tmp_path, "sys/fs/cgroup/memory.max", str(4 * GIB))
    assert memory.memory_limit(tmp_path).bytes == 4 * GIB


def test_v1_and_v2_limits_together_the_smallest_wins(tmp_path):
    v1_tree(tmp_path, str(8 * GIB))
    write(tmp_path, "proc/self/cgroup", "4:memory:/batch/job42\n0::/job\n")
    write(tmp_path, "sys/fs/cgroup/unified/job/memory.max", str(7 * GIB))
    limit = memory.memory_limit(tmp_path)
    assert limit.bytes == 7 * GIB and limit.source.startswith("cgroup v2")


@pytest.mark.parametrize("name", ["RLIMIT_AS", "RLIMIT_DATA"])
def test_the_processs_own_rlimit_wins_when_smaller(tmp_path, machine, name):
    v1_tree(tmp_path, str(8 * GIB))
    machine[getattr(resource, name)] = 3 * GIB
    limit = memory.memory_limit(tmp_path)
    assert limit.bytes == 3 * GIB and name in limit.source
    machine[getattr(resource, name)] = 9 * GIB  # larger than the cgroup's: the cgroup's stands
    assert memory.memory_limit(tmp_path).bytes == 8 * GIB


def test_the_default_root_is_the_module_setting(tmp_path, monkeypatch):
    v1_tree(tmp_path, str(8 * GIB))
    monkeypatch.setattr(memory, "ROOT", tmp_path)
    assert memory.memory_limit().bytes == 8 * GIB
