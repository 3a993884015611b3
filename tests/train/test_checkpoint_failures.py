"""A rank that fails during a checkpoint save ends the save on every rank at once."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from spawn_ranks import start_ranks

import diffrl.train.checkpoint as checkpoint

WORLD = 2
PG_TIMEOUT_S = 120  # what a rank left at a bare barrier would wait


def _worker(rank: int, port: int, out: str, failing_rank: int, failing_stage: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        model = torch.nn.Linear(4, 4)
        if rank == failing_rank:
            original = getattr(checkpoint, failing_stage)

            def fail(*args, **kwargs):
                original(*args, **kwargs)
                raise OSError(28, "No space left on device")

            setattr(checkpoint, failing_stage, fail)
        start = time.monotonic()
        try:
            checkpoint.save_checkpoint(
                Path(out) / "ckpt",
                3,
                model=model,
                optimizer=None,
                scheduler=None,
                trainable_only=False,
                extra={},
            )
            outcome = {"error": None}
        except Exception as err:
            outcome = {"error": type(err).__name__, "message": str(err)}
        outcome["seconds"] = time.monotonic() - start
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))
        dist.barrier()  # the group still works after the failed save
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, failing_rank: int, failing_stage: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_worker, (port, str(tmp_path), failing_rank, failing_stage), WORLD, fork=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_a_rank_failing_to_write_its_shards_fails_the_save_on_every_rank_at_once(tmp_path):
    outcomes = _run(tmp_path, failing_rank=1, failing_stage="_write_rank_files")
    assert outcomes[1]["error"] == "OSError" and "No space left" in outcomes[1]["message"]
    assert outcomes[0]["error"] == "RuntimeError"
    assert "another rank" in outcomes[0]["message"] and "writing the shards" in outcomes[0]["message"]
    assert max(o["seconds"] for o in outcomes) < PG_TIMEOUT_S / 4  # nobody waited for the timeout
    assert checkpoint.latest_checkpoint(tmp_path / "ckpt") is None  # nothing half-written published


def test_rank_0_failing_to_publish_fails_the_save_on_every_rank(tmp_path):
    outcomes = _run(tmp_path, failing_rank=0, failing_stage="_publish")
    assert outcomes[0]["error"] == "OSError"
    assert outcomes[1]["error"] == "RuntimeError" and "publishing" in outcomes[1]["message"]
    assert max(o["seconds"] for o in outcomes) < PG_TIMEOUT_S / 4
