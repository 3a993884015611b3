"""Serve any registered reward over HTTP: the function behind `diffrl serve-reward NAME`.

    diffrl serve-reward ocr --port 8000
    diffrl serve-reward clip_score model=/models/clip-vit-large-patch14 --host 0.0.0.0 --token-env MY_TOKEN
    diffrl serve-reward my_rewards:brightness target=0.5

The trainer then uses `reward.functions.http.args.url=http://HOST:PORT`. The protocol is the one in
`diffrl.rewards.wire` (JSON, base64 PNG, never pickle). The server is the standard library's
`ThreadingHTTPServer`; scoring is serialised through a lock, since a reward model on one GPU gains
nothing from concurrent calls and most rewards are not thread-safe. Batch on the client side.

A peer can be hostile or broken, so every resource a request can take is bounded (`ServerLimits`,
one CLI flag each, checked at start: `server_limits`): connections (in all, and from one client
address while they send their request), requests decoded/scored at once, body bytes being
received (in all, and from one client address), the body, JSON items, images, pixels per image and
per request (read from the PNG header before any pixel is decoded; an edit run's source images
count), prompt length, and a deadline on reading each request as a whole (a client trickling bytes
is cut off). Rejections are answered at once with 4xx/503 and `{"error", "limit", "value"}`.

Slow clients, and who they can keep out (`server_admission` keeps the counts, `server_handler`
reads, refuses and scores each request):
- A request refused from its headers (401, 404, 411, 413, 415) is answered and its connection
  closed without reading its body, so a client without the token holds its thread for a moment
  (`REFUSED_LINGER_S`), not for the read deadline.
- A connection still sending its headers gives its slot up to a new connection when none is free,
  oldest first, so clients trickling their headers cannot keep out one that sends its request.
- A request's body is received before it takes one of the `max_concurrent_requests` slots, so
  clients that send their body slowly hold only a connection each, and one address at most
  `max_connections_per_client` of those (all local clients are one address, 127.0.0.1).
With a token (`--token-env` or DIFFRL_REWARD_TOKEN) every request needs `Authorization: Bearer
<token>`. The default host is 127.0.0.1 (this machine only). Peak memory is about
`max_receiving_bytes + max_concurrent_requests x (3 x max_body_bytes + 3 x max_request_pixels)`
plus the reward model.

Importing this module imports only the standard library (`diffrl --help` builds the parser in
`serve_cli`, which imports this), and the reward stack (torch, the models) loads when a server is made.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import asdict
from http.server import ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any

from diffrl.rewards.server_admission import ByteBudget, ConnectionTable, Refusal, client_key
from diffrl.rewards.server_handler import RewardRequestHandler
from diffrl.rewards.server_limits import ServerLimits, bind_fix, check_settings, listening_family

if TYPE_CHECKING:
    from diffrl.rewards.base import Reward

logger = logging.getLogger(__name__)

TOKEN_ENV = "DIFFRL_REWARD_TOKEN"

__all__ = ["TOKEN_ENV", "RewardHTTPServer", "RunningRewardServer", "ServerLimits", "make_reward_server"]


class RewardHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding one reward object (models loaded once, at construction)."""

    daemon_threads = True  # a hung scoring call must not keep the process alive at shutdown

    def __init__(
        self,
        address: tuple[str, int],
        reward: Reward,
        spec: str,
        limits: ServerLimits | None = None,
        token: str | None = None,
    ) -> None:
        from diffrl.rewards.base import takes_sources

        self.limits = limits or ServerLimits()
        self.token = token or None
        check_settings(address[0], address[1], self.limits, self.token)
        self.reward = reward
        self.spec = spec
        #: Whether the reward reads an edit run's source images: /health says so, and only then
        #: are a request's source images decoded (and counted toward the limits).
        self.takes_sources = takes_sources(reward)
        self.score_lock = threading.Lock()
        self.connections = ConnectionTable(
            self.limits.max_connections, self.limits.max_connections_per_client
        )
        self.request_slots = threading.BoundedSemaphore(self.limits.max_concurrent_requests)
        self.receiving = ByteBudget(
            self.limits.max_receiving_bytes, self.limits.max_receiving_bytes_per_client
        )
        self.address_family = listening_family(address[0])  # the class default is IPv4
        # Connections waiting to be accepted: socketserver's default of 5 drops the SYNs of a burst
        # (a client then waits 1-3 s for its retransmit); the kernel caps this at net.core.somaxconn.
        self.request_queue_size = socket.SOMAXCONN
        super().__init__(address, RewardRequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start a handler thread if `ConnectionTable.admit` finds the connection a slot (taking
        one from a connection still sending its headers if need be); else answer 503 right here."""
        admitted = self.connections.admit(request, client_key(client_address[0]))
        if isinstance(admitted, Refusal):
            _refuse(request, admitted.message, admitted.limit, admitted.value)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.close(admitted)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        connection = self.connections.get(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.close(connection)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A handler's exception: a connection dropped for a newer one fails its reads and writes,
        which is expected and logged quietly; anything else as the standard library does."""
        if self.connections.get(request).evicted:
            logger.debug("connection from %s ended after it was dropped", client_address[0])
            return
        super().handle_error(request, client_address)


def _refuse(sock: socket.socket, message: str, limit: str, value: int) -> None:
    """A complete 503 answer written without reading the request (the accept loop must not block)."""
    body = json.dumps({"error": message, "limit": limit, "value": value}).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        sock.settimeout(0.5)
        sock.sendall(head + body)
    except OSError:
        pass  # the peer is gone or not reading: it was refused either way


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
    limits: ServerLimits | None = None,
    token: str | None = None,
) -> RewardHTTPServer:
    """A bound (not yet serving) server for a reward spec (built with `args`) or a reward object.

    `port=0` picks a free port; read it back from `server.url`. `token`: require
    `Authorization: Bearer <token>` on every request (None: no authentication).
    """
    from diffrl.rewards.registry import build_reward

    limits = limits or ServerLimits()
    check_settings(host, port, limits, token or None)  # before the reward's models load
    if isinstance(reward, str):
        spec, reward_obj = reward, build_reward(reward, args)
    else:
        if args:
            raise ValueError(
                "args are only for a reward given by name; construct the reward object with them"
            )
        spec, reward_obj = getattr(reward, "name", type(reward).__name__), reward
    try:
        return RewardHTTPServer((host, port), reward_obj, spec, limits, token)
    except OSError as err:  # taken since check_settings bound it (another process was quicker)
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}. {bind_fix(err)}") from err


def start_reward_server(
    reward: str | Reward,
    args: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits | None = None,
    token: str | None = None,
) -> RunningRewardServer:
    """Serve a reward on a background thread (tests, notebooks); `with` it or call `.close()`."""
    return RunningRewardServer(make_reward_server(reward, args, host, port, limits, token))


def serve_reward(
    spec: str,
    args: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    token: str | None = None,
) -> None:
    """Build the reward (models load now), then answer requests until interrupted (Ctrl-C)."""
    server = make_reward_server(spec, args, host, port, limits, token)
    auth = "token required" if server.token else "no token: anyone who can reach the port may score"
    print(
        f"serving reward {spec!r} at {server.url}  (POST /score, GET /health; {auth}; Ctrl-C stops)",
        flush=True,
    )
    print(f"limits: {json.dumps(asdict(server.limits))}", flush=True)
    url = server.url
    if host in ("0.0.0.0", "::", ""):  # listening on every interface: name this machine instead
        url = f"http://{socket.gethostname()}:{server.server_address[1]}"
    hint = f" reward.functions.http.args.token_env={TOKEN_ENV}" if server.token else ""
    print(f"use it with: reward.functions.http.args.url={url}{hint}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
