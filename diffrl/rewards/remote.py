"""The `http` reward: score on a remote server (`diffrl serve-reward NAME`), over JSON.

Why: a big reward model (a VLM judge, a private scorer) often lives on other machines or in
another Python environment; the trainer only needs its numbers. The wire format is plain JSON with
PNG images in base64, never pickle, so a server can be written in any language and a malicious
peer cannot run code in the trainer.

The wire format and its protocol (version 1) are `diffrl.rewards.wire`'s.

The client (`HttpReward`) retries connection failures, timeouts, and 429/502/503/504 answers with
exponential backoff (`backoff * 2**attempt` seconds, capped at `max_backoff`), `retries` times;
other errors (a 400 for a bad request, a 500 when the remote reward raised) are reported at once
with the server's message. When every attempt fails it raises `ConnectionError` (unreachable) or
`TimeoutError` (no complete answer within `timeout` seconds), naming the URL and the fix. A server
that answers with an error is reachable, and says so: `ScorerAnswered` (a RuntimeError) explains
the status (401: the token is missing or wrong, naming `token_env`; 403: something in front of the
scorer refused; 404: args.url is not the server's base address; 5xx: the scorer is failing) and is
never reported as "cannot reach". A server may answer a request it refuses from its headers (401,
413) before the body is sent, then close: the client reads that answer instead of reporting the
broken pipe of its unfinished send.

`timeout` is a deadline for the whole attempt (connect, send, scoring, reading every byte of the
answer), not a per-read socket timeout: a server that trickles one byte a second, or accepts and
never answers, is cut off at the deadline. An answer that is not JSON, has the wrong number of
scores, or non-finite scores is a ValueError naming the server. With `token_env`, the client sends
`Authorization: Bearer <the value of that environment variable>` (the server's `--token`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import RewardOutput, check_batch
from diffrl.rewards.registry import register_reward
from diffrl.rewards.wire import decode_response, encode_request

torch = lazy_import("torch")  # deferred: see diffrl.lazy

RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_TIMEOUT_S = 86_400.0  # one attempt of a day is already far past any batch; also below time_t's overflow
MAX_RETRIES = 100
MAX_BACKOFF_S = 3600.0
MAX_RESPONSE_BYTES = 64 << 20  # scores and extras of one batch; anything larger is a broken server


@register_reward("http")
class HttpReward:
    """Client of a remote scorer speaking the protocol above.

    Args:
        url: the server's base URL, e.g. "http://scorer-host:8000" (requests go to <url>/score).
        timeout: deadline in seconds for one attempt as a whole: connecting, sending, the remote
            scoring, and reading the complete answer.
        retries: extra attempts after the first, for connection errors, timeouts and 429/502/503/504.
        backoff: seconds before the first retry; doubles each retry.
        max_backoff: cap on one wait, in seconds.
        token_env: name of an environment variable holding the server's token (`diffrl serve-reward
            --token`, or DIFFRL_REWARD_TOKEN on the server); sent as `Authorization: Bearer ...`.
            The token itself never goes into the config (config.yaml is saved with every run).
    """

    name = "http"

    def __init__(
        self,
        url: str,
        timeout: float = 300.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        token_env: str | None = None,
    ) -> None:
        parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
        try:
            valid_url = parsed is not None and parsed.scheme in ("http", "https") and bool(parsed.hostname)
            valid_url = valid_url and parsed.port != 0  # .port raises ValueError past 65535
        except ValueError:
            valid_url = False
        if not valid_url:
            raise ValueError(
                f"http reward: url={url!r} is invalid: use http://HOST:PORT with a port from 1 to 65535 "
                "(the address `diffrl serve-reward` prints)"
            )
        _check_seconds("timeout", timeout, MAX_TIMEOUT_S, positive=True)
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise ValueError(
                f"http reward: retries={retries!r} is invalid: use a whole number from 0 to {MAX_RETRIES}"
            )
        _check_seconds("backoff", backoff, MAX_BACKOFF_S, positive=False)
        _check_seconds("max_backoff", max_backoff, MAX_BACKOFF_S, positive=False)
        self.token: str | None = None
        self.token_env = token_env
        if token_env is not None:
            self.token = os.environ.get(token_env)
            if not self.token:
                raise ValueError(
                    f"http reward: token_env={token_env!r} names an environment variable that is not set "
                    f"(or empty): export {token_env}=<the token the server was started with>"
                )
            if not self.token.isascii() or not self.token.isprintable() or " " in self.token:
                raise ValueError(
                    f"http reward: the token in {token_env} has spaces, control or non-ASCII characters, "
                    "which no server's token can have (an HTTP header could not carry it): set "
                    f"{token_env} to the exact token the server was started with"
                )
        self.url = url.rstrip("/")
        self._parsed = urllib.parse.urlparse(self.url)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self._server_takes_sources: bool | None = None  # from /health, on the first batch with sources

    def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """One attempt: (status, body bytes), all of it within `timeout` seconds.

        A watchdog shuts the socket down at the deadline, which unblocks whatever read or write is
        in progress (the per-operation socket timeout alone would let a trickling server go on forever).
        """
        deadline = time.monotonic() + self.timeout
        connection_cls = (
            http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        )
        conn = connection_cls(self._parsed.hostname, self._parsed.port, timeout=self.timeout)
        expired = threading.Event()

        def cut_off() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed: the attempt is over anyway
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout, cut_off)
        watchdog.daemon = True
        watchdog.start()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            try:
                conn.request(method, f"{self._parsed.path}{path}", body=body, headers=headers)
            except (BrokenPipeError, ConnectionResetError) as send_error:
                response = _answer_before_the_body_was_sent(conn, send_error)
            else:
                response = conn.getresponse()
            chunks, size = [], 0
            while chunk := response.read(1 << 16):
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ValueError(
                        f"http reward: {self.url}{path} sent more than {MAX_RESPONSE_BYTES} bytes; "
                        "a score answer is far smaller, so this is not a diffrl reward server"
                    )
                chunks.append(chunk)
            if expired.is_set() or time.monotonic() > deadline:
                raise TimeoutError(f"the answer was not complete within {self.timeout:g} s")
            return response.status, b"".join(chunks)
        except (OSError, http.client.HTTPException) as err:
            if expired.is_set() or time.monotonic() > deadline:
                raise TimeoutError(f"no complete answer within {self.timeout:g} s") from err
            raise
        finally:
            watchdog.cancel()
            conn.close()

    def _post(self, body: bytes) -> Any:
        """POST to <url>/score with retries; the decoded JSON answer."""
        return self._send("POST", "/score", body)

    def _send(self, method: str, path: str, body: bytes | None) -> Any:
        """`method` <url><path> with retries; the decoded JSON answer."""
        endpoint = f"{self.url}{path}"
        attempts = self.retries + 1
        last: Exception | None = None
        timed_out = False
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            try:
                status, data = self._request(method, path, body)
            except TimeoutError as err:
                last, timed_out = err, True
                continue
            except (OSError, http.client.HTTPException) as err:
                last, timed_out = err, False
                continue
            if status == 200:
                return _parse_json(data, endpoint)
            last, timed_out = self._answered(endpoint, status, data), False
            if status in RETRY_STATUSES:
                continue
            raise last
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        if isinstance(last, ScorerAnswered):  # it answered, only not with scores: not "cannot reach"
            raise ScorerAnswered(f"{last} ({tries})", last.status) from None
        if timed_out:
            raise TimeoutError(
                f"http reward: {endpoint} did not answer within timeout={self.timeout:g} s ({tries}). If the "
                "scorer is just slow for this batch size, raise args.timeout; otherwise check the server's log"
            ) from last
        raise ConnectionError(
            f"http reward: cannot reach {endpoint} ({tries}; last error: {_reason(last)}). Is the scorer running "
            f"(`diffrl serve-reward NAME --host HOST --port PORT`) and is args.url right?"
        ) from last

    def health(self) -> dict[str, Any]:
        """GET <url>/health (no retries): the server's status and the reward it serves."""
        endpoint = f"{self.url}/health"
        try:
            status, data = self._request("GET", "/health", None)
        except (OSError, http.client.HTTPException) as err:
            raise ConnectionError(f"http reward: cannot reach {endpoint}: {_reason(err)}") from err
        if status != 200:
            raise self._answered(endpoint, status, data)
        answer = _parse_json(data, endpoint)
        if isinstance(answer, dict):  # the start-up probe answers `server_takes_sources` too
            self._server_takes_sources = answer.get("sources") is True
        return answer

    def _answered(self, endpoint: str, status: int, data: bytes) -> ScorerAnswered:
        """The error for an answer other than 200: what the status means here, and what to change."""
        said = f"http reward: {endpoint} answered HTTP {status}: {_error_message(data)}"
        if status == 401 and self.token_env is None:
            fix = (
                "the scorer requires a token and this client sends none: set args.token_env to the name "
                "of an environment variable holding the server's token (the server reads it from "
                "DIFFRL_REWARD_TOKEN, or from the variable its --token-env names)"
            )
        elif status == 401:
            fix = (
                f"the token in the environment variable {self.token_env} (args.token_env) is not the "
                "server's: set it to the value the server was started with (its DIFFRL_REWARD_TOKEN, or "
                "the variable its --token-env names)"
            )
        elif status == 403:
            fix = (
                "`diffrl serve-reward` never answers 403, so something else at args.url refused the "
                "request (a proxy's access rules, another service on that port): check args.url and "
                "what is in front of the scorer"
            )
        elif status == 404:
            fix = (
                f"args.url={self.url!r} has no {endpoint.removeprefix(self.url)}: it must be the server's "
                "base address as `diffrl serve-reward` prints it (http://HOST:PORT, no path), and no other "
                "service may listen on that port"
            )
        elif status == 500:
            fix = "the scorer is running but its reward raised: the traceback is in the server's log"
        elif status in (502, 504):
            fix = "a proxy in front of the scorer could not get an answer from it: check that the scorer runs"
        elif status in (429, 503):
            fix = (
                "the scorer is running but busy (the answer names the limit): raise args.retries or "
                "args.backoff, send smaller batches, or raise that limit on the server"
            )
        elif status >= 500:
            fix = "the scorer (or a proxy in front of it) is running but failing: see its log"
        else:
            return ScorerAnswered(said, status)  # a 4xx about the request: the server's message says it
        return ScorerAnswered(f"{said}. {fix[0].upper()}{fix[1:]}", status)

    def server_takes_sources(self) -> bool:
        """Whether the server's reward reads source images (its /health says `"sources": true`),
        asked once (with the retries of a score request) and remembered."""
        if self._server_takes_sources is None:
            answer = self._send("GET", "/health", None)
            self._server_takes_sources = isinstance(answer, dict) and answer.get("sources") is True
        return self._server_takes_sources

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> RewardOutput:
        """Score remotely. `sources` (an edit run's source images) are sent only to a server whose
        reward reads them (`server_takes_sources`)."""
        rows = check_batch(pixels, prompts, metadata)
        if sources is not None and not self.server_takes_sources():
            sources = None
        try:
            body = json.dumps(encode_request(pixels, prompts, rows, sources)).encode()
        except TypeError as err:
            raise ValueError(f"http reward: metadata must be JSON-serialisable to send it: {err}") from err
        return decode_response(self._post(body), int(pixels.shape[0]), f"http {self.url}")


class ScorerAnswered(RuntimeError):
    """The scorer's URL answered, with an HTTP error status: it is reachable, so this is never a
    "cannot reach, start it" error; the message says what the status means and what to change."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _answer_before_the_body_was_sent(
    conn: http.client.HTTPConnection, send_error: OSError
) -> http.client.HTTPResponse:
    """The answer a server sent before it closed on a body still being sent (it refused the
    request from its headers: 401, 413): read from what has arrived; without one, `send_error`."""
    try:
        return conn.getresponse()
    except (OSError, http.client.HTTPException):
        raise send_error from None


def _check_seconds(name: str, value: Any, most: float, *, positive: bool) -> None:
    """`value` is a finite number of seconds from 0 (excluded when `positive`) to `most`."""
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if number and (value > 0 if positive else value >= 0) and value <= most:
        return
    low = "above 0" if positive else "from 0"
    raise ValueError(
        f"http reward: {name}={value!r} is invalid: use a finite number of seconds {low} to {most:g}"
    )


def _parse_json(data: bytes, endpoint: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:
        raise ValueError(
            f"http reward: {endpoint} answered HTTP 200 with a body that is not JSON ({err}): "
            f"{data[:200]!r}. Is args.url a `diffrl serve-reward` server?"
        ) from err


def _error_message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("error", data[:500]))
    except Exception:
        return repr(data[:500])


def _reason(err: BaseException | None) -> str:
    return f"{type(err).__name__}: {err}" if err is not None else "unknown"
