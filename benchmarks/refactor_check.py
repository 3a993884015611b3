"""Prove a refactor changed nothing: record the metrics of fixed runs, then compare after the change.

    python benchmarks/refactor_check.py record refactor_reference/   # before the first refactor commit
    python benchmarks/refactor_check.py compare refactor_reference/  # after it: exit 0 iff identical

The fixed runs are the default job for 6 steps, a 2-step run of every `shapes_*` preset (the SFT
preset through `diffrl sft`), 2-worker FSDP2 and DDP runs of the tiny SD3 preset, and the async
pipeline under separate placement (sync, one step off with KL and a checkpoint, bounded K = 2 with
KL, one step off with NFT). Each run's
metrics.jsonl is reduced to what the computation determines: wall-clock fields (timing, throughput,
MFU, memory, time stamps) are dropped, every other value must match bit for bit (floats compared as
their JSON text, which round-trips a Python float exactly). `--only NAME` restricts both commands to
some runs. Prints one JSON line: the runs compared and, per run, identical or the first differences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Keys measured on the clock, not computed: they differ between any two runs.
# The pools' balance (trainer/wait_fraction, rollout/idle_fraction, rollout/busy_*) is clock too.
WALL_CLOCK_PREFIXES = (
    "timing",
    "throughput",
    "perf/",
    "time",
    "memory",
    "mfu",
    "system/",
    "trainer/wait",
    "rollout/idle",
    "rollout/busy",
)


def fixed_runs() -> dict[str, list[str]]:
    """Run name -> the `diffrl` arguments (without output_dir / run_name, which are added)."""
    from diffrl.config import preset_names

    # Validation runs once, at the last step: it is the slowest part of a short CPU run.
    once = ["trainer.val_before_train=false"]
    runs: dict[str, list[str]] = {
        "default_6_steps": ["train", "default", "trainer.total_steps=6", "trainer.test_freq=6", *once]
    }
    for name in preset_names():
        if not name.startswith("shapes_"):
            continue
        command = "sft" if name.endswith("_sft") else "train"
        runs[name] = [
            command,
            name,
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=2",
            *once,
        ]
    runs["tiny_sd3_fsdp2_2_workers"] = [
        "train",
        "tiny_sd3",
        "trainer.total_steps=2",
        "trainer.n_gpus_per_node=2",
        "actor.strategy=fsdp2",
        *once,
    ]
    runs["tiny_sd3_ddp_2_workers"] = [
        "train",
        "tiny_sd3",
        "trainer.total_steps=2",
        "trainer.n_gpus_per_node=2",
        "actor.strategy=ddp",
        *once,
    ]
    # The async pipeline (controller/pipeline.py) under separate placement: K = 0, 1 with KL and a
    # checkpoint mid-run and a validation with a batch in flight, 2 with KL; NFT one step off.
    separate = ["trainer.placement=separate", "rollout.replicas=1", *once]
    runs["separate_sync"] = [
        "train",
        "shapes_async",
        "trainer.async_mode=sync",
        "trainer.total_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        *once,
    ]
    runs["separate_one_step_off_kl"] = [
        "train",
        "tiny_sd3",
        *separate,
        "trainer.async_mode=one_step_off",
        "actor.loss.kl_coef=0.01",
        "trainer.total_steps=5",
        "trainer.save_freq=3",
        "trainer.test_freq=4",
    ]
    runs["separate_bounded_k2_kl"] = [
        "train",
        "shapes_async",
        "trainer.async_mode=bounded",
        "trainer.max_staleness=2",
        "actor.loss.kl_coef=0.01",
        "trainer.total_steps=5",
        "trainer.save_freq=3",
        "trainer.test_freq=4",
        *once,
    ]
    runs["separate_one_step_off_nft"] = [
        "train",
        "shapes_nft",
        *separate,
        "trainer.async_mode=one_step_off",
        "trainer.total_steps=3",
        "trainer.save_freq=0",
        "trainer.test_freq=3",
    ]
    return runs


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(WALL_CLOCK_PREFIXES) and "seconds" not in k}


def run_metrics(name: str, args: list[str], workdir: Path) -> list[dict]:
    """Run one fixed command in a fresh output folder; its metrics rows without wall-clock fields."""
    out = workdir / name
    cmd = [sys.executable, "-m", "diffrl.cli", *args, f"trainer.output_dir={out}", "trainer.run_name=run"]
    print(f"refactor_check: {name}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    env = {**os.environ, "DIFFRL_CACHE": str(workdir / "cache")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(f"refactor_check: {name} failed (exit {done.returncode}):\n{tail}")
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    return [comparable(json.loads(line)) for line in lines if line.strip()]


def differences(reference: list[dict], now: list[dict], limit: int = 5) -> list[str]:
    found: list[str] = []
    if len(reference) != len(now):
        found.append(f"{len(reference)} rows recorded, {len(now)} now")
    for i, (old, new) in enumerate(zip(reference, now, strict=False)):
        for key in sorted(old.keys() | new.keys()):
            a, b = old.get(key, "<missing>"), new.get(key, "<missing>")
            same = json.dumps(a) == json.dumps(b) or (
                isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
            )
            if not same:
                found.append(f"row {i} (step {old.get('step')}) {key}: {a!r} -> {b!r}")
                if len(found) >= limit:
                    return found
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["record", "compare"])
    parser.add_argument("reference", type=Path, help="folder of recorded metrics (one NAME.jsonl per run)")
    parser.add_argument("--only", action="append", default=[], help="run only this fixed run (repeatable)")
    args = parser.parse_args(argv)

    runs = fixed_runs()
    unknown = sorted(set(args.only) - set(runs))
    if unknown:
        parser.error(f"--only {unknown}: not a fixed run; the fixed runs are {sorted(runs)}")
    selected = {name: runs[name] for name in (args.only or runs)}
    if args.action == "compare":
        missing = [n for n in selected if not (args.reference / f"{n}.jsonl").is_file()]
        if missing:
            parser.error(f"{args.reference} has no recording of {missing}: run `record` before the refactor")
    args.reference.mkdir(parents=True, exist_ok=True)

    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="refactor_check-") as tmp:
        for name, cmd in selected.items():
            rows = run_metrics(name, cmd, Path(tmp))
            path = args.reference / f"{name}.jsonl"
            if args.action == "record":
                path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
                result[name] = f"recorded {len(rows)} rows"
            else:
                recorded = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                # a recording made before a key counted as clock still compares
                diff = differences([comparable(row) for row in recorded], rows)
                result[name] = diff or "identical"
    identical = args.action == "record" or all(v == "identical" for v in result.values())
    print(json.dumps({"action": args.action, "identical": identical, "runs": result}))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
