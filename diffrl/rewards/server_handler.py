"""One request on one connection of the reward server: read it under a deadline, refuse or score it.

`RewardRequestHandler` is what each handler thread of `diffrl.rewards.server.RewardHTTPServer`
runs: `GET /health` and `POST /score`, every answer JSON, one request per connection. It reads the
request line, headers and body through `_DeadlineReader` (one deadline for the whole request, so
trickled bytes cannot hold the thread), checks the token and headers before reading any body,
receives the body against the server's `ByteBudget` before taking a scoring slot, and bounds
decoding by `ServerLimits` before any pixel is decoded. A refusal (`Rejected`) is answered and the
connection closed without reading what the client may still send (`REFUSED_LINGER_*`).

Apart from the server module (the listening socket, admission of connections, the entry points)
because this is the per-request protocol, which the accept loop never runs. Like the server
module, it imports only the standard library at the top; the reward stack loads when a request
is scored.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import socket
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from diffrl.rewards.server_admission import Connection

if TYPE_CHECKING:
    from diffrl.rewards.server import RewardHTTPServer

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1  # same as diffrl.rewards.wire.PROTOCOL_VERSION (a test checks they agree)
#: After refusing a request from its headers, what the server still reads of a body already on its
#: way before closing: a small body sent with the headers (most clients send both in one write) is
#: consumed, so that client reads its 401/413 instead of a reset; a large one is cut off.
REFUSED_LINGER_BYTES = 64 << 10
REFUSED_LINGER_S = 0.25


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


def _content_length(value: str | None) -> int | None:
    """A Content-Length header as bytes, or None when absent or not plain ASCII digits.

    `str.isdigit` alone accepts other scripts' digits ('²'), which `int` then rejects, and a
    header of thousands of digits would hit Python's int-from-string limit: both are refused."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 18:
        return None
    return int(value)
