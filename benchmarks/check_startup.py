"""What `trainer.check_at_start` adds to `diffrl train`'s start-up: the seconds from the start of
`train()` (imports excluded) to where it starts its workers, with the quick check on and off.

Each case runs in a fresh process: `diffrl.controller.run.attempt` (the workers' start) is replaced by one that stops there,
so nothing is written and no worker starts. Prints one JSON line.

    python benchmarks/check_startup.py default            # the default CPU job
    python benchmarks/check_startup.py shapes_flow_grpo --repeats 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import sys, time
from diffrl.controller import run

class Started(Exception):
    pass

def job(*args, **kwargs):
    raise Started

run.attempt = job
start = time.perf_counter()
try:
    run.train(sys.argv[1], sys.argv[2:])
except Started:
    pass
print(time.perf_counter() - start)
"""


def startup_s(preset: str, check: bool, output_dir: str) -> float:
    argv = [preset, f"trainer.check_at_start={str(check).lower()}", f"trainer.output_dir={output_dir}"]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], check=True, capture_output=True, text=True, timeout=600
    ).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="default")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        on = [startup_s(args.preset, True, out) for _ in range(args.repeats)]
        off = [startup_s(args.preset, False, out) for _ in range(args.repeats)]
    print(
        json.dumps(
            {
                "bench": "check_startup",
                "preset": args.preset,
                "with_check_s": on,
                "without_check_s": off,
                "added_s": min(on) - min(off),
            }
        )
    )


if __name__ == "__main__":
    main()
