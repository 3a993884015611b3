"""What the fault-injection tests share (tests/controller/test_fault_injection.py on CPU,
test_fault_injection_gpu.py on 2 GPUs): the "zygote" that forks `diffrl train` runs with a kill
hook, and the look-ups of the processes a killed run left behind.

The zygote is a process that has imported diffrl once (imports are most of a tiny run's time);
each child is `diffrl train` (`diffrl.cli.main`) with a hook that sends SIGKILL to itself, or to
one of its workers, at the chosen point, so the kill lands at the same place every time.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

ZYGOTE = textwrap.dedent(
    """
    import json, os, signal, sys, tempfile, time
    import diffrl.cli, diffrl.controller.run, diffrl.workers.roles, diffrl.workers.reward_workers, diffrl.train.checkpoint

    def log_processes():
        # The run's processes (Ray's GCS, raylet, its agents and workers descend from the driver)
        # for the test to check they are gone: Ray sets its processes' titles over their argv and
        # environment, so the environment tag the test looks for may no longer be readable there.
        import psutil

        tree = [[p.pid, p.create_time()] for p in psutil.Process().children(recursive=True)]
        sys.stderr.write(f"fault: processes {json.dumps(tree)}\\n")
        sys.stderr.flush()

    def die(signame=None):
        if signame is not None:  # a stop signal (SIGTERM, SIGINT), not a kill: the run goes on
            os.kill(os.getpid(), getattr(signal, signame))
            return
        log_processes()
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(kill):
        # Runs in the child: SIGKILL this process at the kill point `kill` names (or send it
        # kill["signal"] there).
        if kill is None:
            return
        what, at, signame = kill["at"], kill.get("call", 1), kill.get("signal")
        calls = [0]
        if what in ("actor", "reward", "trainer", "replica"):
            return kill_worker(what, kill.get("rank", 1), kill.get("when", "start"), kill.get("step", 1))
        if what == "rollout":  # the at-th decoded micro-batch handed to the reward workers
            owner, name = diffrl.workers.reward_workers.InProcessRewardWorkers, "submit"
        elif what == "update":  # entering the at-th optimizer step (earlier ones of the step are done)
            owner, name = diffrl.workers.roles.HybridWorker, "optim_step"
        elif what == "driver_update":  # the driver entering its at-th step update (separate placement,
            # where the optimizer steps in the trainer ranks' own processes)
            from diffrl.controller.policy_gradient import PolicyGradientTrainer as owner

            name = "_update"
        elif what == "save":  # the at-th metadata file of a checkpoint save (weights already written)
            owner, name = diffrl.train.checkpoint, "_write_durable"
        elif what == "saved":  # right after the at-th checkpoint is published (TrainingLoop.save returned)
            from diffrl.controller.loop import TrainingLoop as owner

            name = "save"
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if what == "saved":
                result = original(*args, **kwargs)
                calls[0] += 1
                if calls[0] == at:
                    die(signame)
                return result
            if what != "save" or str(args[0]).endswith("meta.json"):
                calls[0] += 1
                if calls[0] == at:
                    die(signame)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    # A worker that kills itself (when="sync" or "update") writes its kill time to this file first
    # (set in each child); the child copies it to the log when the run has ended (a Ray worker's
    # output does not go to the log).
    REPORT = None

    def arm(worker, when, report):
        # Runs in the worker's own process (through `__ray_call__`): SIGKILL it at its next
        #   sync    weight receive (a replica), right after the sync's first bucket header arrived:
        #           trainer rank 0 is streaming (it broadcast that header) and then waits, in the
        #           broadcasts and the acknowledgement that follow, for a peer that is gone
        #   update  optimizer step (a trainer rank), as it enters: the other ranks wait in the
        #           step's gradient all-reduce (of the norm under fsdp2, of the gradients under ddp)
        # Instance attributes, looked up by the calls that use them (Ray calls the actor's methods
        # through the functions it found on the class when it started, so patching those is futile).
        import os, signal, time
        import torch

        def die():
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else "cpu"
            with open(report, "w") as out:
                out.write(f"fault: worker on {device}\\n")
                out.write(f"fault: worker killed at {time.monotonic()}\\n")
            os.kill(os.getpid(), signal.SIGKILL)

        if when == "sync":
            group = worker._weight_sync
            original = group._broadcast_header

            def header(*values):
                original(*values)
                die()

            group._broadcast_header = header
        else:
            worker.engine.optim_step = die

    def report_kill():
        # The kill time a worker that killed itself left, into the log.
        if os.path.exists(REPORT):
            with open(REPORT) as report:
                sys.stderr.write(report.read())
            os.unlink(REPORT)

    def kill_worker(what, rank=1, when="start", step=1):
        # SIGKILL a worker process once, in step `step` (the first time the run reaches it: a run
        # that restarts itself runs that step again without a kill): a colocated actor ("actor", rank 1), a reward
        # actor ("reward"), a separate placement's trainer rank ("trainer") or rollout replica
        # ("replica"). when="start": as the step starts; "streaming": as the step's rollout is in
        # (one_step_off: the next batch's requests were just sent to the replicas); "sync" (a
        # replica) and "update" (a trainer rank or colocated actor): the worker kills itself in
        # its own process at that point of step 1 (`arm`). A replica that dies before the driver
        # fetched the scores it submitted (Ray made it their owner) fails the run the same way,
        # or through those scores (placement._ScoredFor): which one Ray reports first is a race,
        # so no case pins it.
        import ray
        from diffrl.controller.policy_gradient import PolicyGradientTrainer

        pids, killed = [], []
        original_step, original_rollout = PolicyGradientTrainer.train_step, PolicyGradientTrainer.rollout_for_step

        def kill():
            log_processes()
            os.kill(pids[0], signal.SIGKILL)
            # CLOCK_MONOTONIC is system-wide on Linux: the test compares it with its own clock.
            sys.stderr.write(f"fault: worker killed at {time.monotonic()}\\n")
            sys.stderr.flush()

        def train_step(self):
            if self.step == step and not pids:
                if what == "reward":
                    actor = self.rewards.actors[0]
                elif what == "replica":
                    actor = self.placement.replicas.actors[rank]
                else:
                    actor = self.workers.actors[rank]
                # asked before the step: an actor runs one call at a time, so once requests are
                # queued on it, this would wait for them and the kill would land after them
                pids.append(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60))
                if when == "start":
                    kill()
                elif when in ("sync", "update"):
                    log_processes()
                    ray.get(actor.__ray_call__.remote(arm, when, REPORT), timeout=60)
            return original_step(self)

        def rollout_for_step(self, *args, **kwargs):
            result = original_rollout(self, *args, **kwargs)
            if when == "streaming" and self.step == step and len(pids) == 1 and not killed:
                killed.append(True)
                kill()
            return result

        PolicyGradientTrainer.train_step = train_step
        PolicyGradientTrainer.rollout_for_step = rollout_for_step

    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA (see serve_zygote)
        sys.exit("zygote: CUDA was initialised while importing diffrl; the forked runs could not use it")

    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)  # the child's output goes to the log; stdout carries only status lines
            os.environ.update(job.get("env", {}))
            REPORT = os.path.join(tempfile.gettempdir(), f"diffrl-fault-{os.getpid()}.txt")
            hook(job.get("kill"))
            try:
                code = diffrl.cli.main(job["argv"])
            except BaseException as err:
                import traceback
                traceback.print_exc()
                code = 1
            report_kill()
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
    """
)

# How long one forked run may take before the test gives up on it (the zygote and everything it
# started are killed then): far above any tiny run's time, so only a hang reaches it.
RUN_DEADLINE_S = 600.0


def start_zygote(tmp_path_factory, env: dict[str, str] | None = None):
    """Generator for a module-scoped fixture: `serve_zygote` of this module's kill hooks, with a
    model cache of the module's own and `env` added to the environment."""
    env = {"DIFFRL_CACHE": str(tmp_path_factory.mktemp("cache")), **(env or {})}
    yield from serve_zygote(ZYGOTE, env, tmp_path_factory.mktemp("zygote") / "children.log")


def serve_zygote(script: str, env: dict[str, str], log: Path):
    """Generator for a fixture: starts `script` (a zygote reading one JSON job per line, as
    `ZYGOTE`) with `env` over this environment and one thread per process, and yields
    `run(argv, kill=None, env=None)`, the exit code of `diffrl <argv>` in a forked child (-9 when
    it was SIGKILLed); `run.log` is the children's output, `run.pid` the zygote's PID. A run that has not ended after
    `RUN_DEADLINE_S` fails the test; the zygote's process group (the zygote, the run and those of
    its processes that stayed in the group) is killed."""
    # PYTORCH_NVML_BASED_CUDA_CHECK: the imports ask torch.cuda.is_available(), which otherwise
    # queries the CUDA runtime and marks the process so that a forked child cannot initialise CUDA
    # ("Cannot re-initialize CUDA in forked subprocess"); through NVML it leaves the zygote clean.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1", **env}
    with open(log, "w") as children_output:
        proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=children_output,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, for the kill after a missed deadline
        )

        def run(argv, kill=None, env=None):
            """Exit code of `diffrl <argv>` in a forked child (-9 when it was SIGKILLed)."""
            proc.stdin.write(json.dumps({"argv": argv, "kill": kill, "env": env or {}}) + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], RUN_DEADLINE_S)
            if not ready:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(
                    f"diffrl {' '.join(argv)} (kill={kill}) did not end within {RUN_DEADLINE_S:g} s; "
                    f"the zygote's process group was killed. Log tail:\n{log.read_text()[-3000:]}"
                )
            line = proc.stdout.readline()
            assert line, log.read_text()[-3000:]
            return json.loads(line)["status"]

        run.log = log
        run.pid = proc.pid
        yield run
        proc.stdin.close()
        proc.wait(timeout=30)


def _tagged_processes(tag: str) -> list[int]:
    """PIDs of live processes whose environment carries `tag` (the run's own, Ray's included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if tag.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()[:200]
    except OSError:
        return "(gone)"


def run_processes(tag: str, log: str) -> dict[int, str]:
    """The live processes of a killed run, by PID with their command: those carrying `tag` in
    their environment, and those the run's last kill point listed (`fault: processes`) that still
    exist (same PID and start time, so not a reused PID)."""
    import psutil

    found = set(_tagged_processes(tag))
    listed = re.findall(r"fault: processes (\[.*\])", log)
    for pid, started in json.loads(listed[-1]) if listed else []:
        try:
            if psutil.Process(pid).create_time() == started:
                found.add(pid)
        except psutil.NoSuchProcess:
            continue
    return {pid: _command(pid) for pid in sorted(found)}


def wait_gone(tag: str, log: str, seconds: float, ignore: tuple[str, ...] = ()) -> dict[int, str]:
    """`run_processes` after waiting up to `seconds` for them to end (those whose command starts
    with one of `ignore` aside)."""
    deadline = time.monotonic() + seconds
    while True:
        left = {pid: cmd for pid, cmd in run_processes(tag, log).items() if not cmd.startswith(ignore)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def kill_time(log: str) -> float:
    """The CLOCK_MONOTONIC time (system-wide on Linux) of the run's last worker kill."""
    return float(re.findall(r"fault: worker killed at ([0-9.]+)", log)[-1])


def run_until_killed(zygote, argv: list[str], kill: dict, message: str) -> tuple[str, str]:
    """`diffrl <argv>` in the zygote with `kill`, tagged so its processes can be found: it must exit
    1 with an error matching `message` within 60 s of the kill. Returns the tag and the run's part
    of the zygote's log, for the caller's checks of what the run left behind (`wait_gone`)."""
    tag = f"DIFFRL_FAULT_{uuid.uuid4().hex}"
    earlier = len(zygote.log.read_text())  # the log holds the module's earlier runs too
    code = zygote(argv, kill=kill, env={tag: "1"})
    ended = time.monotonic()
    log = zygote.log.read_text()[earlier:]
    assert code == 1, log[-3000:]
    found = re.search(message, log)
    assert found, log[-3000:]
    # The bound is on noticing the death, not on starting Ray and the workers (load-dependent).
    killed_at = kill_time(log)
    print(f"\n{kill}: the run ended {ended - killed_at:.1f} s after the kill: {found.group(0)}")
    assert ended - killed_at < 60, f"the run took {ended - killed_at:.0f} s to end after the kill"
    return tag, log
