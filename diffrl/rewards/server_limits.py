"""The reward server's settings and their checks: `ServerLimits`, the address, the token.

Every setting is checked when the server starts, before the reward model loads: a value that
parses but cannot work (`--read-timeout inf` used to start a server that dropped every request
with an OverflowError, `--port 70000` a traceback) is a ValueError naming the flag and its valid
range, which `diffrl serve-reward` prints as one line (exit 2). The counters that enforce the limits
while the server runs are `server_admission`'s.

Imports only the standard library (`diffrl --help` builds the serve-reward parser from these).
"""

from __future__ import annotations

import errno
import math
import re
import socket
from dataclasses import dataclass, fields
from typing import Any

#: By default one client address may hold at most this share of the connections still receiving
#: their request (and of the body bytes being received), so one slow address cannot lock out others.
CLIENT_SHARE_OF_CONNECTIONS = 4  # a quarter: 16 of the default 64
CLIENT_SHARE_OF_RECEIVING = 2  # a half: 128 MiB of the default 256 MiB


@dataclass(frozen=True)
class LimitRange:
    """The values a limit accepts, and the words that describe them in an error."""

    low: int | float
    high: int | float
    what: str  # "a whole number of connections", "a number of seconds", ...
    integer: bool = True


GIB = 1 << 30
#: Why each bound: the low end is the least that can serve one request; the high end is far past
#: any real workload and below what the platform can honour (a socket timeout past ~1e9 s
#: overflows time_t; ~100 bytes of thread stack and one file descriptor per connection).
LIMIT_RANGES: dict[str, LimitRange] = {
    "max_connections": LimitRange(1, 10_000, "a whole number of connections"),
    "max_connections_per_client": LimitRange(1, 10_000, "a whole number of connections"),
    "max_concurrent_requests": LimitRange(1, 1024, "a whole number of requests"),
    "read_timeout": LimitRange(0.01, 86_400.0, "a number of seconds", integer=False),
    "max_body_bytes": LimitRange(1, 16 * GIB, "a number of bytes"),
    "max_receiving_bytes": LimitRange(1, 64 * GIB, "a number of bytes"),
    "max_receiving_bytes_per_client": LimitRange(1, 64 * GIB, "a number of bytes"),
    "max_json_items": LimitRange(1, 1 << 28, "a number of JSON values"),
    "max_images": LimitRange(1, 1 << 20, "a number of images"),
    "max_image_pixels": LimitRange(1, 1 << 34, "a number of pixels"),
    "max_request_pixels": LimitRange(1, 1 << 34, "a number of pixels"),
    "max_prompt_chars": LimitRange(1, 1 << 24, "a number of characters"),
}
PORT_RANGE = LimitRange(0, 65_535, "a port number (0 = any free one)")
#: What `--max-connections` may reach beside the process's open-file limit: the listening socket,
#: stdio, the reward's own files (model weights, logs) need descriptors too.
RESERVED_FILE_DESCRIPTORS = 64


def flag(name: str) -> str:
    """`read_timeout` -> `--read-timeout`, the CLI flag of a setting."""
    return f"--{name.replace('_', '-')}"


def check_number(name: str, value: Any, valid: LimitRange) -> None:
    """`value` is a number of the right kind inside `valid`, else a ValueError naming the flag."""
    kind = int if valid.integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        problem = "is not a finite number" if not valid.integer else "is not a whole number"
    elif not valid.low <= value <= valid.high:
        problem = "is out of range"
    else:
        return
    raise ValueError(
        f"reward server: {flag(name)} {value!r} {problem}: use {valid.what} from "
        f"{_readable(valid.low)} to {_readable(valid.high)}"
    )


def _readable(number: int | float) -> str:
    return f"{number:,}" if isinstance(number, int) else f"{number:g}"


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may take from the server; each field is a `diffrl serve-reward` flag.

    Defaults fit a batch of 64 images of 1024x1024 (or an 81-frame 480x832 video) in one request.
    The two per-client limits default to a share of their totals (None: a quarter of the
    connections, half of the receiving bytes but at least one whole body).
    """

    max_connections: int = 64  # open connections (one thread each); more are answered 503 at once
    max_connections_per_client: int | None = None  # from one address, still sending their request; 503 beyond
    max_concurrent_requests: int = 4  # requests whose body has arrived, being decoded or scored; 503 beyond
    read_timeout: float = 60.0  # seconds to receive a request's headers and body, in total
    max_body_bytes: int = 64 << 20  # 64 MiB
    max_receiving_bytes: int = 256 << 20  # body bytes received, over every request still receiving its body
    max_receiving_bytes_per_client: int | None = None  # the same, over one client address's requests
    max_json_items: int = 100_000  # JSON values (bounds json.loads's memory, ~60 bytes per value)
    max_images: int = 256  # images per request; video frames and source images count
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 1 << 26  # 64 Mi pixels = 192 MiB of RGB
    max_prompt_chars: int = 8192

    def __post_init__(self) -> None:
        if self.max_connections_per_client is None and _is_count(self.max_connections):
            share = max(1, self.max_connections // CLIENT_SHARE_OF_CONNECTIONS)
            object.__setattr__(self, "max_connections_per_client", share)
        if (
            self.max_receiving_bytes_per_client is None
            and _is_count(self.max_receiving_bytes)
            and _is_count(self.max_body_bytes)
        ):
            share = max(self.max_receiving_bytes // CLIENT_SHARE_OF_RECEIVING, self.max_body_bytes)
            object.__setattr__(self, "max_receiving_bytes_per_client", min(share, self.max_receiving_bytes))
        for f in fields(self):
            check_number(f.name, getattr(self, f.name), LIMIT_RANGES[f.name])
        # Relations: a setting that could never take effect, or would make another useless, is an
        # error naming both flags (the fix is to change either).
        self._at_most(
            "max_connections_per_client",
            "max_connections",
            "one client cannot hold more connections than the server has",
        )
        self._at_most(
            "max_concurrent_requests", "max_connections", "each request being scored holds a connection"
        )
        self._at_most(
            "max_body_bytes", "max_receiving_bytes", "a body of the allowed size could never be received"
        )
        self._at_most(
            "max_body_bytes",
            "max_receiving_bytes_per_client",
            "a body of the allowed size could never be received from one client",
        )
        self._at_most(
            "max_receiving_bytes_per_client",
            "max_receiving_bytes",
            "one client cannot hold more than every client together",
        )

    def _at_most(self, small: str, large: str, why: str) -> None:
        if getattr(self, small) > getattr(self, large):
            raise ValueError(
                f"reward server: {flag(small)} {getattr(self, small)} is above {flag(large)} "
                f"{getattr(self, large)}, but {why}: lower {flag(small)} or raise {flag(large)}"
            )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_open_file_limit(limits: ServerLimits) -> None:
    """`max_connections` fits the process's open-file limit (one descriptor per connection):
    past it, accept() fails with EMFILE and the server stops answering anyone."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to compare with
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    room = soft - RESERVED_FILE_DESCRIPTORS
    if limits.max_connections > room:
        raise ValueError(
            f"reward server: {flag('max_connections')} {limits.max_connections} is above what this "
            f"process can open: its open-file limit is {soft} (ulimit -n), {RESERVED_FILE_DESCRIPTORS} of "
            f"them kept for the reward's own files: lower {flag('max_connections')} to at most "
            f"{max(room, 0)}, or raise `ulimit -n`"
        )


def check_address(host: Any, port: Any) -> None:
    """The server can listen on `--host`:`--port`, else a ValueError naming the flag and the fix.

    Checked by binding a socket there (and closing it at once), as the server will, before the
    reward model loads: a malformed or unknown host, an address of another machine, a port in use
    or one that needs privileges is reported in a second, not after the model has loaded."""
    if isinstance(port, bool) or not isinstance(port, int) or not PORT_RANGE.low <= port <= PORT_RANGE.high:
        raise ValueError(
            f"reward server: --port {port!r} is invalid: use {PORT_RANGE.what} from "
            f"{PORT_RANGE.low} to {PORT_RANGE.high}"
        )
    if not isinstance(host, str):
        raise ValueError(f"reward server: --host {host!r} is invalid: {bind_fix(None)}")
    try:
        with socket.socket(listening_family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own bind
            probe.bind((host, port))
    except (OSError, UnicodeError) as err:  # UnicodeError: a name the IDNA codec refuses (a label > 63)
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(
            f"reward server: cannot listen on --host {host!r} --port {port}: {reason}. {bind_fix(err)}"
        ) from None


def listening_family(host: str) -> socket.AddressFamily:
    """IPv6 for an IPv6 address ("::" for every interface), else IPv4 (the standard library's default)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_fix(err: BaseException | None) -> str:
    """What to change when the server cannot listen, by the reason."""
    if isinstance(err, OSError) and err.errno == errno.EADDRNOTAVAIL:
        return "--host is not an address of this machine: use one of its addresses, 127.0.0.1 or 0.0.0.0"
    if isinstance(err, OSError) and err.errno == errno.EACCES:
        return "Ports below 1024 need privileges: pick --port 1024 or above (or --port 0 for any free one)"
    if isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
        return "Another process listens on that port: pick another --port (or --port 0 for any free one)"
    return (
        "--host must be an IP address of this machine or a name that resolves to one (127.0.0.1, the "
        "default: this machine only; 0.0.0.0: every interface)"
    )


#: Token characters: visible ASCII. A header value is read as Latin-1 and the token compared as
#: bytes, so a token with spaces, control or non-ASCII characters could never match.
_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}")


def check_token(token: str, source: str) -> None:
    """A token every client can send in `Authorization: Bearer <token>`; `source` names where it
    came from (the environment variable) for the error."""
    if not _TOKEN.fullmatch(token):
        raise ValueError(
            f"reward server: the token in {source} is unusable: it must be 1 to 4096 visible ASCII "
            "characters (no spaces, no control or non-ASCII characters), or an HTTP client could never "
            f"send it; e.g. export {source}=$(openssl rand -hex 24)"
        )


def check_settings(host: str, port: int, limits: ServerLimits, token: str | None) -> None:
    """Every setting a server starts with can work, else a ValueError naming the flag (before the
    reward model loads, when `make_reward_server` calls it). `ServerLimits` checks its own ranges."""
    from diffrl.rewards.wire import pillow_pixel_cap

    check_address(host, port)
    check_open_file_limit(limits)
    if limits.max_image_pixels > pillow_pixel_cap():
        raise ValueError(
            f"reward server: --max-image-pixels {limits.max_image_pixels} is above what Pillow "
            f"opens ({pillow_pixel_cap()} pixels, twice PIL.Image.MAX_IMAGE_PIXELS): lower "
            "--max-image-pixels, or raise PIL.Image.MAX_IMAGE_PIXELS in the serving process"
        )
    if token is not None:
        check_token(token, "the server's token (--token-env)")
