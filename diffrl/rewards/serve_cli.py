"""The `diffrl serve-reward` command: its parser (one flag per `ServerLimits` field) and its entry.

Importing this module imports only the standard library and `diffrl.rewards.server` (which does
too): `diffrl --help` builds this parser.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from diffrl.rewards.server import TOKEN_ENV, ServerLimits, serve_reward
from diffrl.rewards.server_limits import LIMIT_RANGES, check_token


def parse_key_values(items: Sequence[str]) -> dict[str, Any]:
    """`["model=/m", "batch_size=8", "a.b=[1,2]"]` -> nested dict with YAML-typed values (OmegaConf)."""
    from omegaconf import OmegaConf

    for item in items:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"reward argument {item!r} is not key=value (e.g. model=/models/clip)")
    container = OmegaConf.to_container(OmegaConf.from_dotlist(list(items)), resolve=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


SERVE_EPILOG = """\
examples:
  diffrl serve-reward jpeg_compressibility --port 8000
  DIFFRL_REWARD_TOKEN=$(openssl rand -hex 24) diffrl serve-reward ocr lang=eng --host 0.0.0.0 --port 8001
  diffrl serve-reward clip_score model=/models/clip-vit-large-patch14 --max-images 64
  diffrl serve-reward my_rewards:brightness target=0.5

then train with: reward.functions.http.args.url=http://HOST:PORT
  (and reward.functions.http.args.token_env=DIFFRL_REWARD_TOKEN when the server has a token)
Rewards and their args, the limits and what they protect: docs/rewards.md
"""

# flag name -> help; every ServerLimits field is one flag with its default shown.
LIMIT_HELP = {
    "max_connections": "open connections at once; more are answered 503 at once, unless a connection "
    "still sending its headers (or refused and closing) can give its slot up: the oldest such is dropped",
    "max_connections_per_client": "connections from one client address still sending their request (all "
    "local clients are one address, 127.0.0.1; an IPv6 /64 is one); more get 503 at once, unless one "
    "of them is still sending its headers: that one is dropped for the new one",
    "max_concurrent_requests": "requests decoded or scored at once (a body is received first); more get 503",
    "read_timeout": "seconds to receive a whole request (headers and body); slower clients are cut off",
    "max_body_bytes": "request body size in bytes (413 beyond)",
    "max_receiving_bytes": "body bytes received at once, summed over requests still receiving theirs "
    "(503 beyond; a slow client counts the bytes it sent)",
    "max_receiving_bytes_per_client": "the same, over the requests of one client address (503 beyond)",
    "max_json_items": "JSON values in a request body (413 beyond)",
    "max_images": "images per request, video frames and source images counted (413 beyond)",
    "max_image_pixels": "width x height of one image, read from its header before decoding (413 beyond)",
    "max_request_pixels": "width x height summed over a request's images, source images included (413 beyond)",
    "max_prompt_chars": "characters in one prompt (413 beyond)",
}


def _default_text(name: str, default: Any, derived: bool) -> str:
    if not derived:
        return str(default)
    share = (
        "a quarter of --max-connections"
        if name == "max_connections_per_client"
        else ("half of --max-receiving-bytes, at least --max-body-bytes")
    )
    return f"{share}: {default} with the defaults"


def limits_from_args(ns: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(ns, f.name) for f in fields(ServerLimits)})


def token_from_args(ns: argparse.Namespace) -> str | None:
    """The token from the environment variable `--token-env` names (default DIFFRL_REWARD_TOKEN).

    Never a command-line value: arguments are visible to every user of the machine (ps).
    """
    token = os.environ.get(ns.token_env)
    if ns.token_env != TOKEN_ENV and not token:
        raise ValueError(
            f"--token-env {ns.token_env} names an environment variable that is not set (or empty): "
            f"export {ns.token_env}=<a long random string>"
        )
    if token:
        check_token(token, ns.token_env)
    return token or None


def cmd_serve_reward(ns: argparse.Namespace) -> int:
    """The `diffrl serve-reward` command (logs one line per scored request to stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits, token = limits_from_args(ns), token_from_args(ns)
    serve_reward(ns.name, parse_key_values(ns.args), ns.host, ns.port, limits, token)
    return 0


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve-reward NAME [key=value ...] [--host H] [--port P] [--token-env VAR] [limits]`."""
    parser = subparsers.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP (JSON + base64 PNG)",
        description="Serve any registered reward (or module:function) over HTTP for `reward.functions.http`. "
        "Every request is bounded by the limits below; rejections are 4xx/503 with the limit named.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", metavar="NAME", help="a registered reward, NAME@LABEL, or module:function")
    parser.add_argument(
        "args", nargs="*", metavar="key=value", help="the reward's args, e.g. model=/models/clip"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free one)"
    )
    parser.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        metavar="VAR",
        help=f"environment variable holding the token every request must send as 'Authorization: Bearer' "
        f"(default {TOKEN_ENV}; unset = no authentication)",
    )
    defaults = ServerLimits()
    for f in fields(ServerLimits):
        default = getattr(defaults, f.name)
        valid = LIMIT_RANGES[f.name]
        # A per-client share left unset follows its total (a quarter / half of it), so it is None
        # here and resolved by ServerLimits; the help shows what it comes to with the defaults.
        derived = getattr(ServerLimits, f.name) is None
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=int if valid.integer else float,
            default=None if derived else default,
            help=f"{LIMIT_HELP[f.name]} (default {_default_text(f.name, default, derived)}; "
            f"{valid.low:,} to {valid.high:,})",
        )
    parser.set_defaults(func=cmd_serve_reward)
    return parser
