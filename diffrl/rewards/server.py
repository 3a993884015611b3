"""Serve any registered reward over HTTP: the function behind `diffrl serve-reward NAME`.

    diffrl serve-reward ocr --port 8000
    diffrl serve-reward clip_score model=/models/clip-vit-large-patch14 --host 0.0.0.0 --port 8001
    diffrl serve-reward my_rewards:brightness target=0.5

The trainer then uses `reward.functions.http.args.url=http://HOST:PORT`. The protocol is the one in
`diffrl.rewards.remote` (JSON, base64 PNG, never pickle). The server is the standard library's
`ThreadingHTTPServer`: connections are accepted concurrently, but scoring is serialised through a
lock, since a reward model on one GPU gains nothing from concurrent calls and most rewards are not
thread-safe. Batch on the client side (micro-batches) instead.

There is no authentication: the default host is 127.0.0.1 (this machine only); bind 0.0.0.0 only
inside a trusted network. A bad request is answered 400 with the reason; a reward that raises, 500
with the exception (and a traceback in this server's log).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from diffrl.rewards.base import Reward, call_reward
from diffrl.rewards.registry import build_reward
from diffrl.rewards.remote import PROTOCOL_VERSION, decode_request, encode_response

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 30  # 1 GiB: a few hundred 1024² PNGs; larger batches should be split


class RewardHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding one reward object (models loaded once, at construction)."""

    daemon_threads = True  # a hung scoring call must not keep the process alive at shutdown

    def __init__(
        self,
        address: tuple[str, int],
        reward: Reward,
        spec: str,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.reward = reward
        self.spec = spec
        self.max_body_bytes = max_body_bytes
        self.score_lock = threading.Lock()
        super().__init__(address, RewardRequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class RewardRequestHandler(BaseHTTPRequestHandler):
    """POST /score and GET /health; every answer is JSON."""

    server: RewardHTTPServer

    def _answer(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._answer(
                HTTPStatus.OK, {"status": "ok", "reward": self.server.spec, "version": PROTOCOL_VERSION}
            )
        else:
            self._answer(
                HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}: use POST /score, GET /health"}
            )

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._answer(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}: use POST /score"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._answer(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length is required"})
            return
        if int(length) > self.server.max_body_bytes:
            self._answer(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                {
                    "error": f"body of {length} bytes exceeds {self.server.max_body_bytes}; send smaller batches"
                },
            )
            return
        start = time.perf_counter()
        try:
            pixels, prompts, metadata = decode_request(json.loads(self.rfile.read(int(length))))
        except ValueError as err:  # json.JSONDecodeError is a ValueError too
            self._answer(HTTPStatus.BAD_REQUEST, {"error": f"bad request: {err}"})
            return
        try:
            with self.server.score_lock:
                output = call_reward(self.server.reward, pixels, prompts, metadata, self.server.spec)
        except ValueError as err:
            logger.warning("reward %r rejected a batch of %d: %s", self.server.spec, len(prompts), err)
            self._answer(HTTPStatus.BAD_REQUEST, {"error": f"{type(err).__name__}: {err}"})
            return
        except Exception as err:
            logger.exception("reward %r failed on a batch of %d", self.server.spec, len(prompts))
            self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(err).__name__}: {err}"})
            return
        self._answer(HTTPStatus.OK, encode_response(output))
        logger.info(
            "scored %d sample(s) with %r in %.3f s",
            len(prompts),
            self.server.spec,
            time.perf_counter() - start,
        )

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


class RunningRewardServer:
    """A reward server answering on a background thread; a context manager that stops it on exit."""

    def __init__(self, server: RewardHTTPServer) -> None:
        self.server = server
        # A short poll interval makes close() quick (shutdown waits for the serving loop to notice).
        self.thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name=f"reward-server-{server.spec}", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def __enter__(self) -> RunningRewardServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def make_reward_server(
    reward: str | Reward,
    args: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> RewardHTTPServer:
    """A bound (not yet serving) server for a reward spec (built with `args`) or a reward object.

    `port=0` picks a free port; read it back from `server.url`.
    """
    if isinstance(reward, str):
        spec, reward_obj = reward, build_reward(reward, args)
    else:
        if args:
            raise ValueError(
                "args are only for a reward given by name; construct the reward object with them"
            )
        spec, reward_obj = getattr(reward, "name", type(reward).__name__), reward
    try:
        return RewardHTTPServer((host, port), reward_obj, spec, max_body_bytes)
    except OSError as err:
        raise ValueError(
            f"cannot listen on {host}:{port}: {err.strerror or err}. Pick another --port (or --port 0 for any free one)"
        ) from err


def start_reward_server(
    reward: str | Reward,
    args: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> RunningRewardServer:
    """Serve a reward on a background thread (tests, notebooks); `with` it or call `.close()`."""
    return RunningRewardServer(make_reward_server(reward, args, host, port))


def serve_reward(
    spec: str, args: Mapping[str, Any] | None = None, host: str = "127.0.0.1", port: int = 8000
) -> None:
    """Build the reward (models load now), then answer requests until interrupted (Ctrl-C)."""
    server = make_reward_server(spec, args, host, port)
    print(f"serving reward {spec!r} at {server.url}  (POST /score, GET /health; Ctrl-C stops)", flush=True)
    url = server.url
    if host in ("0.0.0.0", "::", ""):  # listening on every interface: name this machine instead
        url = f"http://{socket.gethostname()}:{server.server_address[1]}"
    print(f"use it with: reward.functions.http.args.url={url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ------------------------------------------------------------------------------------------- CLI
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
  diffrl serve-reward ocr lang=eng --host 0.0.0.0 --port 8001
  diffrl serve-reward clip_score model=/models/clip-vit-large-patch14
  diffrl serve-reward my_rewards:brightness target=0.5

then train with: reward.functions.http.args.url=http://HOST:PORT
Rewards and their args: docs/rewards.md
"""


def cmd_serve_reward(ns: argparse.Namespace) -> int:
    """The `diffrl serve-reward` command (logs one line per scored request to stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_reward(ns.name, parse_key_values(ns.args), ns.host, ns.port)
    return 0


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve-reward NAME [key=value ...] [--host H] [--port P]` to diffrl's subcommands."""
    parser = subparsers.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP (JSON + base64 PNG)",
        description="Serve any registered reward (or module:function) over HTTP for `reward.functions.http`.",
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
    parser.set_defaults(func=cmd_serve_reward)
    return parser
