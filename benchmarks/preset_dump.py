"""Dump every shipped preset's fully resolved config, to prove a change to the preset files changed
no resolved value:

    python benchmarks/preset_dump.py /tmp/presets_before   # before editing diffrl/config/presets/
    python benchmarks/preset_dump.py /tmp/presets_after    # after
    diff -r /tmp/presets_before /tmp/presets_after         # no output: every preset resolves the same

Each NAME.yaml is what `diffrl config NAME` prints: the resolved config (schema defaults <- the
preset and its bases), then the derived values as comments. A preset that does not load is written
as its error message, so a preset broken by the change shows up in the diff too. `*_sft` presets are
validated for the `sft` job (what `diffrl sft` does), the others for `train`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def resolved_text(name: str) -> str:
    from omegaconf import OmegaConf

    from diffrl.config import load_config, to_yaml

    try:
        cfg = load_config(name, job="sft" if name.endswith("_sft") else "train")
    except Exception as err:  # recorded, not raised: the diff shows it
        return f"# does not load: {type(err).__name__}: {err}\n"
    derived = "".join(f"#   {line}\n" for line in OmegaConf.to_yaml(cfg.derived()).splitlines())
    return to_yaml(cfg) + "# derived (computed from the keys above):\n" + derived


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder to write NAME.yaml into (created)")
    args = parser.parse_args(argv)
    from diffrl.config import preset_names

    args.out.mkdir(parents=True, exist_ok=True)
    names = preset_names()
    for name in names:
        (args.out / f"{name}.yaml").write_text(resolved_text(name))
    print(f"preset_dump: {len(names)} presets resolved into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
