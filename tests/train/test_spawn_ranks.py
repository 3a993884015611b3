"""The multi-rank tests' spawner kills ranks that hang and fails the test instead of waiting."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from spawn_ranks import spawn_with_deadlines


def _joins_then_hangs(rank: int, out_dir: str) -> None:
    Path(out_dir, f"joined{rank}").touch()
    time.sleep(600)


def _joins_and_returns(rank: int, out_dir: str) -> None:
    Path(out_dir, f"joined{rank}").touch()


def test_a_hanging_run_is_killed_at_its_deadline(tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"2-rank toy run did not finish within 2 s"):
        spawn_with_deadlines(
            _joins_then_hangs, (str(tmp_path),), 2, tmp_path, start_s=60, run_s=2, what="toy"
        )
    # the run deadline (2 s after both joined), not the 60 s start deadline, ended it
    assert time.monotonic() - start < 50


def test_ranks_that_finish_pass(tmp_path):
    spawn_with_deadlines(_joins_and_returns, (str(tmp_path),), 2, tmp_path, start_s=60, run_s=60, what="toy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joined0", "joined1"]
