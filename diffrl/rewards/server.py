"""Serve any registered reward over HTTP: the function behind `diffrl serve-reward NAME`.

    diffrl serve-reward ocr --port 8000
    diffrl serve-reward clip_score model=/models/clip-vit-large-patch14 --host 0.0.0.0 --token-env MY_TOKEN
    diffrl serve-reward my_rewards:brightness target=0.5

The trainer then uses `reward.functions.http.args.url=http://HOST:PORT`. The protocol is the one in
`diffrl.rewards.remote` (JSON, base64 PNG, never pickle). The server is the standard library's
`ThreadingHTTPServer`; scoring is serialised through a lock, since a reward model on one GPU gains
nothing from concurrent calls and most rewards are not thread-safe. Batch on the client side.

A peer can be hostile or broken, so every resource a request can take is bounded (`ServerLimits`,
one CLI flag each): connections, requests decoded/scored at once, body bytes being received, the
body, JSON items, images, pixels per image and per request (read from the PNG header before any
pixel is decoded; an edit run's source images count), prompt length, and a deadline on reading each request as a whole (a client trickling bytes is cut
off). Rejections are answered at once with 4xx/503 and `{"error", "limit", "value"}`. With a token
(`--token-env` or DIFFRL_REWARD_TOKEN) every request needs `Authorization: Bearer <token>`. The
default host is 127.0.0.1 (this machine only). A request's body is received before it takes one of
the `max_concurrent_requests` slots (decoding and scoring), so clients that send slowly hold only a
connection each. Peak memory is about `max_receiving_bytes + max_concurrent_requests x
(3 x max_body_bytes + 3 x max_request_pixels)` plus the reward model.

Importing this module imports only the standard library (`diffrl --help` builds the parser in
`serve_cli`, which imports this), and the reward stack (torch, the models) loads when a server is made.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffrl.rewards.base import Reward

logger = logging.getLogger(__name__)

TOKEN_ENV = "DIFFRL_REWARD_TOKEN"
PROTOCOL_VERSION = 1  # same as diffrl.rewards.remote.PROTOCOL_VERSION (a test checks they agree)


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may take from the server; each field is a `diffrl serve-reward` flag.

    Defaults fit a batch of 64 images of 1024x1024 (or an 81-frame 480x832 video) in one request.
    """

    max_connections: int = 64  # open connections (one thread each); more are answered 503 at once
    max_concurrent_requests: int = 4  # requests whose body has arrived, being decoded or scored; 503 beyond
    read_timeout: float = 60.0  # seconds to receive a request's headers and body, in total
    max_body_bytes: int = 64 << 20  # 64 MiB
    max_receiving_bytes: int = 256 << 20  # body bytes received, over every request still receiving its body
    max_json_items: int = 100_000  # JSON values (bounds json.loads's memory, ~60 bytes per value)
    max_images: int = 256  # images per request; video frames and source images count
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 1 << 26  # 64 Mi pixels = 192 MiB of RGB
    max_prompt_chars: int = 8192

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"reward server: {f.name}={value!r} is invalid: must be > 0")
        if self.max_receiving_bytes < self.max_body_bytes:
            raise ValueError(
                f"reward server: max_receiving_bytes={self.max_receiving_bytes} is below "
                f"max_body_bytes={self.max_body_bytes}, so a body of the allowed size could never be "
                "received: raise --max-receiving-bytes or lower --max-body-bytes"
            )


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
        from diffrl.rewards.remote import pillow_pixel_cap

        self.reward = reward
        self.spec = spec
        #: Whether the reward reads an edit run's source images: /health says so, and only then
        #: are a request's source images decoded (and counted toward the limits).
        self.takes_sources = takes_sources(reward)
        self.limits = limits or ServerLimits()
        if self.limits.max_image_pixels > pillow_pixel_cap():
            raise ValueError(
                f"reward server: max_image_pixels={self.limits.max_image_pixels} is above what Pillow "
                f"opens ({pillow_pixel_cap()} pixels, twice PIL.Image.MAX_IMAGE_PIXELS): lower "
                "--max-image-pixels, or raise PIL.Image.MAX_IMAGE_PIXELS in the serving process"
            )
        self.token = token or None
        self.score_lock = threading.Lock()
        self.connection_slots = threading.BoundedSemaphore(self.limits.max_connections)
        self.request_slots = threading.BoundedSemaphore(self.limits.max_concurrent_requests)
        self.receiving = _ByteBudget(self.limits.max_receiving_bytes)
        super().__init__(address, RewardRequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start a handler thread only while under `max_connections`; else answer 503 right here."""
        if not self.connection_slots.acquire(blocking=False):
            _refuse(request, self.limits.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connection_slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()


def _refuse(sock: socket.socket, max_connections: int) -> None:
    """A complete 503 answer written without reading the request (the accept loop must not block)."""
    body = json.dumps(
        {
            "error": f"too many connections: the server holds at most {max_connections}; retry later",
            "limit": "max_connections",
            "value": max_connections,
        }
    ).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        sock.settimeout(0.5)
        sock.sendall(head + body)
    except OSError:
        pass  # the peer is gone or not reading: it was refused either way


class _ByteBudget:
    """Body bytes held by requests still receiving theirs, over all connections: a connection
    counts what has arrived, not what it announced, so a client trickling its body holds the few
    bytes it sent, and clients sending fast cannot together hold more than the total."""

    def __init__(self, total: int) -> None:
        self.total, self.used, self.lock = total, 0, threading.Lock()

    def take(self, count: int) -> bool:
        with self.lock:
            if self.used + count > self.total:
                return False
            self.used += count
            return True

    def give(self, count: int) -> None:
        with self.lock:
            self.used -= count


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
        self.rfile.close()  # replaced by a reader whose deadline covers the request line, headers and body
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.server.limits.read_timeout))

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

    def do_GET(self) -> None:
        try:
            self._check_token()
            if self.path.rstrip("/") != "/health":
                raise Rejected(
                    HTTPStatus.NOT_FOUND, f"no such path {self.path!r}: use POST /score, GET /health"
                )
        except Rejected as err:
            self._answer(err.status, err.body())
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
            self._answer(err.status, err.body())
            self._discard_body(_content_length(self.headers.get("Content-Length", "0")) or 0)
            return
        try:
            # The body arrives before the request takes a slot: clients still sending (slowly, or
            # never) hold a connection each, never one of the few requests that decode and score.
            raw = self._receive_body(length)
        except Rejected as err:
            self._answer(err.status, err.body())
            return
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
        """The whole body, within the connection's read deadline; `Rejected` 408 (deadline), 400
        (the body ended short) or 503 (`max_receiving_bytes` is held by other requests' bodies)."""
        limits, receiving = self.server.limits, self.server.receiving
        chunks: list[bytes] = []
        received = 0
        try:
            while received < length:
                chunk = self.rfile.read1(min(length - received, 1 << 16))
                if not chunk:
                    self.close_connection = True
                    raise Rejected(HTTPStatus.BAD_REQUEST, f"body ended after {received} of {length} bytes")
                if not receiving.take(len(chunk)):
                    left = length - received - len(chunk)
                    receiving.give(received)
                    received = 0
                    chunks.clear()
                    self._discard_body(left)
                    raise Rejected(
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        f"busy: other requests' bodies being received hold {limits.max_receiving_bytes} "
                        "bytes; retry later",
                        "max_receiving_bytes",
                        limits.max_receiving_bytes,
                    )
                received += len(chunk)
                chunks.append(chunk)
            return b"".join(chunks)
        except TimeoutError as err:
            self.close_connection = True
            raise Rejected(HTTPStatus.REQUEST_TIMEOUT, str(err), "read_timeout", limits.read_timeout) from err
        finally:
            receiving.give(received)

    def _discard_body(self, left: int) -> None:
        """Read (and drop) the `left` bytes the client still sends, until the read deadline at most.

        Closing a socket with unread input resets the connection, and a client still sending its
        body then sees 'broken pipe' instead of the answer already written for it.
        """
        try:
            while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                left -= len(chunk)
        except OSError:  # TimeoutError included: the deadline bounds this like any other read
            pass
        self.close_connection = True

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
        from diffrl.rewards.remote import LimitExceeded, decode_request, encode_response

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
    except OSError as err:
        raise ValueError(
            f"cannot listen on {host}:{port}: {err.strerror or err}. Pick another --port (or --port 0 for any free one)"
        ) from err


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
