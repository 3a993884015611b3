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

Slow clients, and who they can keep out (`server_admission` keeps the counts):
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

import contextlib
import hmac
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any

from diffrl.rewards.server_admission import ByteBudget, Connection, ConnectionTable, Refusal, client_key
from diffrl.rewards.server_limits import ServerLimits, bind_fix, check_settings, listening_family

if TYPE_CHECKING:
    from diffrl.rewards.base import Reward

logger = logging.getLogger(__name__)

TOKEN_ENV = "DIFFRL_REWARD_TOKEN"
PROTOCOL_VERSION = 1  # same as diffrl.rewards.wire.PROTOCOL_VERSION (a test checks they agree)
#: After refusing a request from its headers, what the server still reads of a body already on its
#: way before closing: a small body sent with the headers (most clients send both in one write) is
#: consumed, so that client reads its 401/413 instead of a reset; a large one is cut off.
REFUSED_LINGER_BYTES = 64 << 10
REFUSED_LINGER_S = 0.25

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


class _DeadlineReader(io.RawIOBase):
    """The request side of a connection, with one deadline for all of it.

    Each read waits at most for the time left, so a client sending a byte every second cannot hold
    its thread beyond `read_timeout` (a plain socket timeout restarts on every byte).
    """

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.sock, self.seconds = sock, seconds
        self.deadline = time.monotonic() + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the request was not received within read_timeout={self.seconds:g} s")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _BodyRefused(Exception):
    """A body refused while it arrived: the answer, and how many announced bytes were not read."""

    def __init__(self, error: Rejected, unread: int) -> None:
        super().__init__(str(error))
        self.error, self.unread = error, unread


class Rejected(Exception):
    """An answer other than 200, with the limit it enforces (if any)."""

    def __init__(self, status: int, message: str, limit: str | None = None, value: Any = None) -> None:
        super().__init__(message if limit is None else f"{message} (limit {limit}={value})")
        self.status, self.limit, self.value = status, limit, value

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": str(self)}
        if self.limit is not None:
            out.update(limit=self.limit, value=self.value)
        return out


class RewardRequestHandler(BaseHTTPRequestHandler):
    """POST /score and GET /health; every answer is JSON. One request per connection (HTTP/1.0)."""

    server: RewardHTTPServer

    def setup(self) -> None:
        super().setup()
        self.record: Connection = self.server.connections.get(self.request)
        self.client = self.record.client  # what its per-client shares are counted under
        self.rfile.close()  # replaced by a reader whose deadline covers the request line, headers and body
        self.reader = _DeadlineReader(self.connection, self.server.limits.read_timeout)
        self.rfile = io.BufferedReader(self.reader)

    def _answer(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        # Writing has its own bound: a peer that never reads cannot hold the thread either.
        self.connection.settimeout(self.server.limits.read_timeout)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            self.send_header("Retry-After", "1")
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError as err:  # the peer left (its own deadline passed) or stopped reading
            logger.info("could not answer %s: %s", self.address_string(), err)
            self.close_connection = True

    def _check_token(self) -> None:
        expected = self.server.token
        if expected is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        # compare_digest: the time taken does not reveal how many leading characters were right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), expected.encode()):
            raise Rejected(
                HTTPStatus.UNAUTHORIZED,
                "this server requires a token: send 'Authorization: Bearer <token>' "
                "(the http reward's args.token_env names the variable holding it)",
            )

    def _refuse_and_close(self, err: Rejected, unread: int) -> None:
        """Answer `err` and end the connection without reading the `unread` body bytes the client
        may still be sending (a request refused from its headers, or cut off mid-body).

        The answer is followed at once by the end of the stream (shutdown for writing), so the
        client sees both now; then at most REFUSED_LINGER_BYTES already on their way are read,
        for REFUSED_LINGER_S at most, so a small body sent along with the headers does not turn
        the answer into a reset; closing with more unread resets the connection, which stops a
        client still sending (it can read the answer, already received: the http reward does)."""
        self._answer(err.status, err.body())
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
        self.server.connections.refused(self.record)  # a new connection may take its slot from now
        self.reader.deadline = min(self.reader.deadline, time.monotonic() + REFUSED_LINGER_S)
        left = min(unread, REFUSED_LINGER_BYTES)
        try:
            while left > 0 and (chunk := self.rfile.read1(left)):
                left -= len(chunk)
        except OSError:  # TimeoutError included: the linger's deadline passed
            pass

    def _announced_length(self) -> int:
        """The body length the headers announce (0 when absent or unusable): what a refusal leaves unread."""
        return _content_length(self.headers.get("Content-Length", "0")) or 0

    def parse_request(self) -> bool:
        """The standard library's parsing of the request line and headers; then the connection
        leaves the phase in which a newer one may take its slot (False if one already has)."""
        return super().parse_request() and self.server.connections.headers_arrived(self.record)

    def do_GET(self) -> None:
        self.server.connections.request_arrived(self.record)  # a GET has no body
        try:
            self._check_token()
            if self.path.rstrip("/") != "/health":
                raise Rejected(
                    HTTPStatus.NOT_FOUND, f"no such path {self.path!r}: use POST /score, GET /health"
                )
        except Rejected as err:
            self._refuse_and_close(err, self._announced_length())
            return
        self._answer(
            HTTPStatus.OK,
            {
                "status": "ok",
                "reward": self.server.spec,
                "version": PROTOCOL_VERSION,
                "sources": self.server.takes_sources,
            },
        )

    def do_POST(self) -> None:
        try:
            self._check_token()
            if self.path.rstrip("/") != "/score":
                raise Rejected(HTTPStatus.NOT_FOUND, f"no such path {self.path!r}: use POST /score")
            length = self._check_headers()
        except Rejected as err:
            # Refused from its headers (the token, the path, the type or size): the body is never
            # read, so a client without the token cannot hold this thread while it sends one.
            self._refuse_and_close(err, self._announced_length())
            return
        try:
            # The body arrives before the request takes a slot: clients still sending (slowly, or
            # never) hold a connection each, never one of the few requests that decode and score.
            raw = self._receive_body(length)
        except _BodyRefused as refused:
            self._refuse_and_close(refused.error, refused.unread)
            return
        self.server.connections.request_arrived(self.record)
        if not self.server.request_slots.acquire(blocking=False):
            limit = self.server.limits.max_concurrent_requests
            del raw
            self._answer(
                HTTPStatus.SERVICE_UNAVAILABLE,
                Rejected(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    f"busy: {limit} requests are being scored; retry later",
                    "max_concurrent_requests",
                    limit,
                ).body(),
            )
            return
        try:
            self._score(raw)
        finally:
            self.server.request_slots.release()

    def _receive_body(self, length: int) -> bytes:
        """The whole body, within the connection's read deadline; `_BodyRefused` with 408
        (deadline), 400 (the body ended short) or 503 (the body bytes being received, in all or
        from this client's address, are at `max_receiving_bytes` / `max_receiving_bytes_per_client`)."""
        limits, receiving = self.server.limits, self.server.receiving
        chunks: list[bytes] = []
        received = 0
        try:
            while received < length:
                chunk = self.rfile.read1(min(length - received, 1 << 16))
                if not chunk:
                    error = Rejected(HTTPStatus.BAD_REQUEST, f"body ended after {received} of {length} bytes")
                    raise _BodyRefused(error, 0)
                if (over := receiving.take(self.client, len(chunk))) is not None:
                    who = "this client's" if over == "max_receiving_bytes_per_client" else "all"
                    error = Rejected(
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        f"busy: {who} request bodies being received hold {getattr(limits, over)} bytes; "
                        "retry later",
                        over,
                        getattr(limits, over),
                    )
                    raise _BodyRefused(error, length - received - len(chunk))
                received += len(chunk)
                chunks.append(chunk)
            return b"".join(chunks)
        except TimeoutError as err:
            error = Rejected(HTTPStatus.REQUEST_TIMEOUT, str(err), "read_timeout", limits.read_timeout)
            raise _BodyRefused(error, length - received) from err
        finally:
            receiving.give(self.client, received)

    def _check_headers(self) -> int:
        """The body's length, once Content-Type and Content-Length are acceptable."""
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise Rejected(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type must be application/json, got {self.headers.get('Content-Type')!r}",
            )
        length = _content_length(self.headers.get("Content-Length"))
        if length is None:
            raise Rejected(
                HTTPStatus.LENGTH_REQUIRED, "Content-Length is required: a decimal number of bytes"
            )
        limit = self.server.limits.max_body_bytes
        if length > limit:
            raise Rejected(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {length} bytes is too large; send smaller batches",
                "max_body_bytes",
                limit,
            )
        return length

    def _score(self, raw: bytes) -> None:
        from diffrl.rewards.base import call_reward
        from diffrl.rewards.wire import LimitExceeded, decode_request, encode_response

        limits = self.server.limits
        start = time.perf_counter()
        try:
            # Every JSON value but the innermost is followed by ',' or opens '[' / '{': counting them
            # (a fast bytes scan) bounds what json.loads allocates before it runs.
            items = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
            if items > limits.max_json_items:
                raise LimitExceeded("max_json_items", limits.max_json_items, f"about {items} JSON values")
            body = json.loads(raw)
            del raw
            pixels, prompts, metadata, sources = decode_request(
                body,
                max_images=limits.max_images,
                max_image_pixels=limits.max_image_pixels,
                max_request_pixels=limits.max_request_pixels,
                max_prompt_chars=limits.max_prompt_chars,
                with_sources=self.server.takes_sources,
            )
            del body
        except LimitExceeded as err:
            self._answer(
                err.status, {"error": f"request too large: {err}", "limit": err.limit, "value": err.value}
            )
            return
        except (ValueError, RecursionError) as err:  # json.JSONDecodeError is a ValueError too
            self._answer(HTTPStatus.BAD_REQUEST, {"error": f"bad request: {err}"})
            return
        try:
            with self.server.score_lock:
                output = call_reward(
                    self.server.reward, pixels, prompts, metadata, self.server.spec, sources=sources
                )
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


def _content_length(value: str | None) -> int | None:
    """A Content-Length header as bytes, or None when absent or not plain ASCII digits.

    `str.isdigit` alone accepts other scripts' digits ('²'), which `int` then rejects, and a
    header of thousands of digits would hit Python's int-from-string limit: both are refused."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 18:
        return None
    return int(value)
