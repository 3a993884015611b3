"""The `diffrl` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

from diffrl import __version__

EPILOG = """\
examples:
  diffrl presets                                   list the built-in presets
  diffrl config                                    the default preset, fully resolved
  diffrl config default rollout.sde.noise_level=0.8 actor.optim.lr=1e-4
  diffrl config my_run.yaml trainer.total_steps=10 a YAML file of overrides instead of a preset

Keys and their meaning: docs/configuration.md
"""


def _split_source(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[PRESET|file.yaml] [key=value ...]` -> (source, overrides)."""
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def cmd_presets(args: argparse.Namespace) -> int:
    from diffrl.config import preset_names, preset_summary

    names = preset_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {preset_summary(name)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from diffrl.config import load_config, to_yaml

    source, overrides = _split_source(args.items)
    cfg = load_config(source, overrides)
    print(to_yaml(cfg), end="")
    print("# derived (computed from the keys above):")
    for line in OmegaConf.to_yaml(cfg.derived()).splitlines():
        print(f"#   {line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffrl",
        description="RL post-training for diffusion and flow-matching models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"diffrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    presets = sub.add_parser("presets", help="list the built-in presets")
    presets.set_defaults(func=cmd_presets)

    config = sub.add_parser(
        "config",
        help="print the resolved config of a preset or YAML file with key=value overrides",
        description="Print the fully resolved config: schema defaults <- preset or file <- overrides.",
    )
    config.add_argument(
        "items",
        nargs="*",
        metavar="[PRESET|file.yaml] [key=value ...]",
        help="a preset name (default: 'default') or a YAML file, then dotted key=value overrides",
    )
    config.set_defaults(func=cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        # User errors carry their own fix in the message; a traceback would bury it.
        print(f"diffrl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
