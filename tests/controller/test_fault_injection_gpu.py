"""Faults on real GPUs (run on a 2-GPU machine: pytest -m gpu; skipped with fewer GPUs): a worker
killed with SIGKILL in the middle of a collective ends the run within 60 s, with an error naming
it, and leaves no process of the run behind, none holding a GPU.

NCCL collectives wait for a dead peer until their timeout (ten minutes by default, and
rollout.weight_sync.timeout_s is 600 s); gloo's notice the closed connection at once. So on GPUs
the surviving ranks stay blocked, and the run ends only because the driver, told by Ray that the
worker died, kills the other workers (RayGroup.shutdown) and Ray. The cases:

- separate placement, one trainer rank and one replica on a GPU each, weights over NCCL: the
  replica kills itself inside its weight receive of step 1's first sync, right after the first
  bucket header arrived, so trainer rank 0 is streaming to it (fault_zygote.py, `arm`);
- colocated on both GPUs (fsdp2, ddp): trainer rank 1 kills itself entering its first optimizer
  step, where rank 0 waits in the step's all-reduce (of the gradient norm under fsdp2, of the
  gradients under ddp).

DIFFRL_FAULT_GPU_TESTS_ON_CPU=1 runs the same cases on CPU workers (gloo throughout: the weight
sync's backend is left to `auto`), without the gpu mark, to check the cases themselves on a
machine without GPUs.
"""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from fault_zygote import run_processes, run_until_killed, start_zygote, wait_gone

ON_CPU = os.environ.get("DIFFRL_FAULT_GPU_TESTS_ON_CPU") == "1"

pytestmark = (
    []
    if ON_CPU
    else [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
)

ARGS = [
    "tiny_sd3",
    "trainer.total_steps=2",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "reward.workers=1",
    "trainer.loggers=[jsonl]",
]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    yield from start_zygote(tmp_path_factory)


def gpu_holders() -> dict[int, str]:
    """Processes of this machine (this PID namespace) with a GPU open (/dev/nvidia<N>: a CUDA
    context on that GPU), by PID with their command."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            targets = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        if any(re.fullmatch(r"/dev/nvidia\d+", target) for target in targets):
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    return found


def nvidia_smi_pids() -> set[int]:
    """The compute processes nvidia-smi lists (PIDs as the driver sees them: the host's, which are
    this namespace's only outside a container)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def run_and_kill(zygote, tmp_path, args: list[str], kill: dict, message: str) -> None:
    """`diffrl train <args>` with `kill`: exit 1 within 60 s of the kill, an error matching
    `message`, then no process of the run left, and (on GPUs) none holding a GPU."""
    holders_before = {} if ON_CPU else gpu_holders()  # this test process's own, if any
    argv = ["train", *ARGS, *args, f"trainer.output_dir={tmp_path}", "trainer.run_name=dead"]
    tag, log = run_until_killed(zygote, argv, kill, message)
    assert re.search(r"fault: worker on cpu" if ON_CPU else r"fault: worker on cuda:\d", log), log[-3000:]
    run_pids = set(run_processes(tag, log))  # those still alive: wait_gone waits for them
    listed = {
        int(pid) for pid in re.findall(r"\[(\d+), [0-9.]+\]", re.findall(r"fault: processes (.*)", log)[-1])
    }
    assert wait_gone(tag, log, 20) == {}, "processes of the failed run were left behind"
    if ON_CPU:
        return
    deadline = time.monotonic() + 20
    while True:
        # The zygote is the harness, not the run: its imports open the GPUs' device files through
        # NVML (PYTORCH_NVML_BASED_CUDA_CHECK), possibly after holders_before was taken.
        new = {
            pid: cmd for pid, cmd in gpu_holders().items() if pid not in holders_before and pid != zygote.pid
        }
        smi = nvidia_smi_pids() & (listed | run_pids)
        if (not new and not smi) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert new == {}, f"processes hold a GPU after the run ended: {new}"
    assert smi == set(), f"nvidia-smi lists processes of the run as GPU users: {sorted(smi)}"


def test_a_replica_killed_during_an_nccl_weight_sync_ends_the_run_naming_it(zygote, tmp_path):
    run_and_kill(
        zygote,
        tmp_path,
        [
            "trainer.placement=separate",
            "trainer.async_mode=one_step_off",
            "trainer.n_gpus_per_node=1",
            "rollout.replicas=1",
            *([] if ON_CPU else ["rollout.weight_sync.backend=nccl"]),
        ],
        {"at": "replica", "rank": 0, "when": "sync"},
        r"RolloutWorker rank 0 \(of 1\) on node \S+ \(pid \d+\) died during RolloutWorker\.receive_weights: \w*Actor",
    )


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_trainer_rank_killed_during_an_update_ends_the_run_naming_it(zygote, tmp_path, strategy):
    run_and_kill(
        zygote,
        tmp_path,
        ["trainer.n_gpus_per_node=2", f"actor.strategy={strategy}"],
        {"at": "actor", "rank": 1, "when": "update"},
        r"HybridWorker rank 1 \(of 2\) on node \S+ \(pid \d+\) died during HybridWorker\.optim_step: \w*Actor",
    )
