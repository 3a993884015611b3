"""Who the reward server lets in, and what each connection holds while its request arrives.

Two bookkeepers, shared by the accept loop and the handler threads:

- `ConnectionTable`: the open connections (at most `max_connections`), and per client address
  those still sending their request (at most `max_connections_per_client`). A connection goes
  through three phases: its request line and headers arriving, its body arriving, then arrived
  (decoded, scored, answered). Only the first two count toward the address's share, so a client
  whose requests arrive whole promptly is never held to it.
- `ByteBudget`: the body bytes that have arrived for requests still receiving theirs, in all and
  per client address.

Why eviction: the server cannot tell a legitimate client from a hostile one until the headers are
in (the token is a header), so connections that have not sent them yet are the ones it can drop.
When a new connection finds no free slot (the server's, or its address's), the connection that
has been sending its headers the longest gives its slot up: it is shut down and the newcomer takes
its place. A client that sends its headers in one go (every HTTP client does) is the newest of
them and the last to go, so connections trickling their headers, however many, cannot keep it out;
once its headers are in it is authenticated (a request without the token is answered 401 at once)
and never evicted. What this cannot do: connections past their headers (a client with the token,
or anyone where the server has no token) that then send their body slowly hold their slots until
the read deadline; from one address at most its share, from many addresses all of them.

All local clients are one address (127.0.0.1), so they share one share. Imports only the standard
library (`diffrl --help` builds the serve-reward parser from modules that import this).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def client_key(address: str) -> str:
    """The address one client's share is counted under: an IPv4 address itself; for IPv6 its /64
    network (one host is usually given a whole /64, so its single addresses are free to pick)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # not an IP (a Unix socket path): one client
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


# The phases of a connection. Only those in HEADERS or BODY count toward their address's share;
# those in HEADERS or REFUSED give their slot up to a new connection that finds none free.
HEADERS = "headers"  # request line and headers arriving: nothing is known of the client yet
BODY = "body"  # headers in (and the token checked), body arriving
ARRIVED = "arrived"  # the whole request is in: being decoded, scored, answered
REFUSED = "refused"  # answered 4xx/503 and closing: a moment's linger for the answer to get through


@dataclass(eq=False)
class Connection:
    """One admitted connection: its socket, its client's key, its phase, and whether it was evicted."""

    sock: socket.socket
    client: str
    order: int  # admission order: the lowest in the headers phase is the first to give its slot up
    phase: str = HEADERS
    evicted: bool = False


@dataclass(frozen=True)
class Refusal:
    """A connection refused at accept: the limit it hit and its value."""

    limit: str
    value: int
    message: str


@dataclass
class ConnectionTable:
    """The open connections, their phases, and per client address the ones still receiving.

    A connection stays in `connections` until its thread ends (`close`), evicted or not, so its
    handler always finds its record; `held` counts the slots, which an evicted one no longer has."""

    max_connections: int
    max_per_client: int
    connections: dict[socket.socket, Connection] = field(default_factory=dict)
    held: int = 0
    receiving: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _order: itertools.count = field(default_factory=itertools.count)

    def admit(self, sock: socket.socket, client: str) -> Connection | Refusal:
        """The new connection, or why it is refused (the caller answers 503).

        When it needs the slot of a connection still sending its headers, that one is shut down
        (its thread, blocked reading headers that do not come, ends at once) and its slot is the
        new connection's from now on."""
        with self.lock:
            victim = None
            if self.receiving[client] >= self.max_per_client:
                victim = self._oldest_sending_headers(client)
                if victim is None:
                    return Refusal(
                        "max_connections_per_client",
                        self.max_per_client,
                        f"too many connections from {client} are still sending their request: one "
                        f"client address may have at most {self.max_per_client}; retry later",
                    )
            elif self.held >= self.max_connections:
                victim = self._one_refused() or self._oldest_sending_headers(None)
                if victim is None:
                    return Refusal(
                        "max_connections",
                        self.max_connections,
                        f"too many connections: the server holds at most {self.max_connections}; retry later",
                    )
            if victim is not None:
                self._give_back(victim)
                victim.evicted = True
                logger.info(
                    "dropped a connection from %s still sending its headers, for a new one", victim.client
                )
                with contextlib.suppress(OSError):  # already closed by its peer: nothing to stop
                    victim.sock.shutdown(socket.SHUT_RDWR)
            connection = Connection(sock, client, next(self._order))
            self.connections[sock] = connection
            self.held += 1
            self.receiving[client] += 1
            return connection

    def _oldest_sending_headers(self, client: str | None) -> Connection | None:
        """The connection (of `client`, or of anyone) that has been in its headers phase the longest."""
        candidates = [
            c
            for c in self.connections.values()
            if c.phase == HEADERS and not c.evicted and (client is None or c.client == client)
        ]
        return min(candidates, key=lambda c: c.order, default=None)

    def _one_refused(self) -> Connection | None:
        """A connection already refused and closing, if there is one."""
        return next((c for c in self.connections.values() if c.phase == REFUSED and not c.evicted), None)

    def _give_back(self, connection: Connection) -> None:
        """Its slot, and its place in its address's share if it is still receiving (lock held)."""
        self.held -= 1
        if connection.phase in (HEADERS, BODY):
            self._stop_receiving(connection)

    def _stop_receiving(self, connection: Connection) -> None:
        self.receiving[connection.client] -= 1
        if not self.receiving[connection.client]:
            del self.receiving[connection.client]  # the table holds only addresses sending now

    def get(self, sock: socket.socket) -> Connection:
        with self.lock:
            return self.connections[sock]

    def headers_arrived(self, connection: Connection) -> bool:
        """Its headers are in: it can no longer be evicted. False if it was evicted already (its
        socket is shut down, the handler stops)."""
        with self.lock:
            if connection.evicted:
                return False
            connection.phase = BODY
            return True

    def request_arrived(self, connection: Connection) -> None:
        """The whole request is in: it no longer counts toward its address's share."""
        self._leave_receiving(connection, ARRIVED)

    def refused(self, connection: Connection) -> None:
        """It was answered with a refusal and is closing: a new connection may take its slot."""
        self._leave_receiving(connection, REFUSED)

    def _leave_receiving(self, connection: Connection, phase: str) -> None:
        with self.lock:
            if not connection.evicted and connection.phase in (HEADERS, BODY):
                self._stop_receiving(connection)
            connection.phase = phase

    def close(self, connection: Connection) -> None:
        """The connection's thread ended: its slot is free (an evicted one gave it away already)."""
        with self.lock:
            del self.connections[connection.sock]
            if not connection.evicted:
                self._give_back(connection)


class ByteBudget:
    """Body bytes held by requests still receiving theirs, over all connections and per client
    address: a connection counts what has arrived, not what it announced, so a client trickling
    its body holds the few bytes it sent, clients sending fast cannot together hold more than the
    total, and one address not more than its share."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self.used, self.used_by, self.lock = 0, Counter[str](), threading.Lock()

    def take(self, client: str, count: int) -> str | None:
        """None when the `count` bytes fit; else the name of the limit they are over."""
        with self.lock:
            if self.used_by[client] + count > self.per_client:
                return "max_receiving_bytes_per_client"
            if self.used + count > self.total:
                return "max_receiving_bytes"
            self.used += count
            self.used_by[client] += count
            return None

    def give(self, client: str, count: int) -> None:
        with self.lock:
            self.used -= count
            self.used_by[client] -= count
            if not self.used_by[client]:
                del self.used_by[client]
