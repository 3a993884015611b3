"""`diffrl serve-reward` against hostile or broken clients: every limit answers 4xx/503 naming itself,
slow clients are cut off at the read deadline, and memory stays bounded under a mixed attack."""

import base64
import contextlib
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from PIL import Image

from diffrl.rewards import build_reward
from diffrl.rewards.remote import ScorerAnswered
from diffrl.rewards.server import ServerLimits, start_reward_server
from diffrl.rewards.server_handler import PROTOCOL_VERSION
from diffrl.rewards.wire import PROTOCOL_VERSION as CLIENT_PROTOCOL
from diffrl.rewards.wire import encode_request

SMALL = ServerLimits(
    max_connections=8,
    max_connections_per_client=4,
    max_concurrent_requests=2,
    read_timeout=1.5,
    max_body_bytes=4 << 20,
    max_json_items=5_000,
    max_images=8,
    max_image_pixels=256 * 256,
    max_request_pixels=4 * 256 * 256,
    max_prompt_chars=100,
)


def _png(width, height, mode="L") -> str:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def huge_png():
    """8000x8000 zeros: ~60 KB on the wire, 192 MB once decoded to RGB (the decompression bomb)."""
    return _png(8000, 8000)


def _body(images, prompts=None, **extra) -> bytes:
    prompts = prompts if prompts is not None else ["a"] * len(images)
    return json.dumps({"version": 1, "images": images, "prompts": prompts, **extra}).encode()


def _post(url, data: bytes, content_type="application/json", token=None, timeout=10, source="127.0.0.1"):
    """(status, JSON answer) of POST /score, sent from the loopback address `source`.

    A request refused from its headers is answered before its body has been read, and the
    connection closed: a client still sending a large body then gets a broken pipe, with the
    answer already received; it is read from there (what the `http` reward does too)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request("POST", "/score", body=data, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _connect(url, source="127.0.0.1") -> socket.socket:
    """A connection from the loopback address `source` (Linux answers all of 127/8 on loopback,
    so each address is another client to the server)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))


def _half_sent(url, length=1000, source="127.0.0.1") -> socket.socket:
    """Headers announcing a body that never comes."""
    sock = _connect(url, source)
    sock.sendall(
        f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{".encode()
    )
    return sock


def _read_all(sock) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_protocol_versions_agree():
    assert PROTOCOL_VERSION == CLIENT_PROTOCOL


def test_each_limit_is_a_4xx_naming_itself(huge_png):
    ok = _png(16, 16, "RGB")
    cases = [
        ("max_body_bytes", _body([ok], ["x" * (SMALL.max_body_bytes + 1)])),
        ("max_json_items", _body([ok], metadata=[{"k": list(range(6_000))}])),
        ("max_images", _body([ok] * 9)),
        ("max_image_pixels", _body([huge_png])),
        ("max_image_pixels", _body([_png(257, 256)])),
        ("max_request_pixels", _body([_png(256, 256)] * 5)),
        ("max_prompt_chars", _body([ok], ["p" * 101])),
    ]
    with start_reward_server("jpeg_compressibility", limits=SMALL) as server:
        for limit, data in cases:
            status, answer = _post(server.url, data)
            assert status == 413, (limit, answer)
            assert answer["limit"] == limit and answer["value"] == getattr(SMALL, limit), answer
            assert limit in answer["error"]
        # a long prompt list for one image is refused before any decoding (prompts must match images)
        status, answer = _post(server.url, _body([ok], ["a"] * 1000))
        assert status == 400 and "1000 prompts" in answer["error"]
        # exactly at the limits is fine, and scores equal the local reward
        at_limit = [_png(256, 256, "RGB")] * 4
        status, answer = _post(server.url, _body(at_limit))
        assert status == 200 and len(answer["scores"]) == 4
        status, answer = _post(server.url, _body([ok]), content_type="text/plain")
        assert status == 415 and "application/json" in answer["error"]
        # digits of other scripts ('²' is str.isdigit) and absurdly long numbers are no length
        for length in ("\u00b2", "9" * 5000):
            with _connect(server.url) as sock:
                sock.sendall(
                    b"POST /score HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: "
                    + length.encode("latin-1")
                    + b"\r\n\r\n"
                )
                assert _read_all(sock).startswith(b"HTTP/1.0 411"), length[:5]


def _png_header(width, height) -> str:
    """A PNG that claims width x height (a valid signature and IHDR, no pixel data): what a client
    needs to send to reach the decoder's own size checks."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


def test_an_image_over_pillows_own_cap_is_refused_with_the_servers_limit():
    """Pillow refuses an image of more than 2 x PIL.Image.MAX_IMAGE_PIXELS (178,956,970) pixels in
    `Image.open`, before the server sees its size: the answer still names the server's limit."""
    pillow_cap = 2 * Image.MAX_IMAGE_PIXELS
    side = 20_000  # 400 M pixels: over Pillow's cap and over every limit below
    assert side * side > pillow_cap
    for limits in (SMALL, ServerLimits(max_image_pixels=pillow_cap)):
        with start_reward_server("jpeg_compressibility", limits=limits) as server:
            status, answer = _post(server.url, _body([_png(8, 8), _png_header(side, side)]))
        assert status == 413, answer
        assert answer["limit"] == "max_image_pixels" and answer["value"] == limits.max_image_pixels, answer
        assert f"max_image_pixels={limits.max_image_pixels}" in answer["error"]
        assert "image 1" in answer["error"] and str(Image.MAX_IMAGE_PIXELS) not in answer["error"]
    # a limit above what Pillow opens could never be honoured: refused when the server starts
    with pytest.raises(ValueError, match=rf"--max-image-pixels {pillow_cap + 1} is above what Pillow opens"):
        start_reward_server("jpeg_compressibility", limits=ServerLimits(max_image_pixels=pillow_cap + 1))


def test_token_is_required_and_compared(monkeypatch):
    pixels, prompts = torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["a", "b"]
    body = json.dumps(encode_request(pixels, prompts, None)).encode()
    with start_reward_server("jpeg_compressibility", token="s3cret-token") as server:
        assert _post(server.url, body)[0] == 401
        assert _post(server.url, body, token="s3cret-tokeN")[0] == 401
        status, answer = _post(server.url, body, token="s3cret-token")
        assert status == 200 and len(answer["scores"]) == 2
        with pytest.raises(RuntimeError, match=r"HTTP 401.*args.token_env"):
            build_reward("http", {"url": server.url, "retries": 0})(pixels, prompts)
        # A body larger than loopback's socket buffers (8 incompressible 512x512 PNGs, ~8 MB): the
        # server answers 401 and closes while the client is still sending, and the client reports
        # the 401 it received, not the broken pipe ("cannot reach ... Is the scorer running?").
        seeded = torch.Generator().manual_seed(0)
        large = torch.randint(0, 256, (8, 3, 512, 512), dtype=torch.uint8, generator=seeded)
        with pytest.raises(ScorerAnswered, match=r"HTTP 401") as info:
            build_reward("http", {"url": server.url, "retries": 0})(large, ["a"] * 8)
        assert "requires a token and this client sends none: set args.token_env" in str(info.value)
        monkeypatch.setenv("WRONG_TOKEN", "not-the-token")
        with pytest.raises(ScorerAnswered, match=r"WRONG_TOKEN \(args.token_env\) is not the server's"):
            build_reward("http", {"url": server.url, "retries": 0, "token_env": "WRONG_TOKEN"})(
                pixels, prompts
            )
        monkeypatch.setenv("SCORER_TOKEN", "s3cret-token")
        client = build_reward("http", {"url": server.url, "token_env": "SCORER_TOKEN"})
        local = build_reward("jpeg_compressibility")(pixels, prompts, None)
        torch.testing.assert_close(client(pixels, prompts).scores_B, local.scores_B)
        assert client.health()["status"] == "ok"
    with pytest.raises(ValueError, match=r"token_env='NOT_SET_ANYWHERE' .* not set"):
        build_reward("http", {"url": "http://127.0.0.1:1", "token_env": "NOT_SET_ANYWHERE"})


def test_slow_clients_are_cut_off_at_the_read_deadline():
    with start_reward_server("jpeg_compressibility", limits=SMALL) as server:
        # trickling: one byte every 0.1 s, which a per-read timeout would never stop
        start = time.monotonic()
        sock = _connect(server.url)
        request = (
            b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Pad: " + b"a" * 200
        )
        cut = None
        for byte in request:
            try:
                sock.send(bytes([byte]))
            except OSError:
                cut = time.monotonic() - start
                break
            time.sleep(0.1)
            if _closed(sock):
                cut = time.monotonic() - start
                break
        sock.close()
        # cut at the total deadline: not sooner (a per-read timeout would never cut a trickle)
        assert cut is not None and SMALL.read_timeout - 0.1 < cut < SMALL.read_timeout + 1.0, cut
        # headers sent, body never: 408 naming read_timeout, at the deadline
        start = time.monotonic()
        sock = _half_sent(server.url)
        answer = _read_all(sock).decode()
        sock.close()
        assert SMALL.read_timeout - 0.1 < time.monotonic() - start < SMALL.read_timeout + 1.0
        assert " 408 " in answer.splitlines()[0] and '"limit": "read_timeout"' in answer


def _readable(sock) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def _closed(sock) -> bool:
    """The server closed (EOF or reset) or answered."""
    if not _readable(sock):
        return False
    try:
        return sock.recv(65536, socket.MSG_DONTWAIT) is not None
    except BlockingIOError:
        return False
    except OSError:
        return True


class _HeldReward:
    """Scores zeros once `release` is set (a slow reward model): requests holding a slot stay held."""

    def __init__(self):
        self.release, self.calls = threading.Event(), 0

    def __call__(self, pixels, prompts, metadata):
        self.calls += 1
        assert self.release.wait(30), "the test never released the reward"
        return torch.zeros(len(prompts))


def _post_in_thread(url, data, results, token=None):
    thread = threading.Thread(target=lambda: results.append(_post(url, data, token=token, timeout=30)))
    thread.start()
    return thread


def test_excess_requests_and_connections_get_503_at_once():
    reward = _HeldReward()
    body = _body([_png(8, 8, "RGB")])
    with start_reward_server(reward, limits=SMALL) as server:
        # requests whose body arrived hold the slots while they are scored
        held, threads = [], []
        for _ in range(SMALL.max_concurrent_requests):
            threads.append(_post_in_thread(server.url, body, held))
        deadline = time.monotonic() + 10
        while reward.calls < 1 and time.monotonic() < deadline:  # one scores, the others wait for it
            time.sleep(0.05)
        time.sleep(0.3)
        start = time.monotonic()
        status, answer = _post(server.url, body)
        assert status == 503 and answer["limit"] == "max_concurrent_requests", answer
        assert time.monotonic() - start < SMALL.read_timeout  # refused at once, not after a wait
        reward.release.set()
        for thread in threads:
            thread.join(30)
        assert [status for status, _ in held] == [200] * SMALL.max_concurrent_requests
        # connections past their headers (here: the body never comes) hold their slots: one
        # address up to its share, two addresses all of the server's
        per_client = SMALL.max_connections_per_client
        held = [_half_sent(server.url, source="127.0.0.2") for _ in range(per_client)]
        _wait_until(lambda: _sending(server, "body") == per_client)
        answer = _read_all(_connect(server.url, "127.0.0.2")).decode()
        assert " 503 " in answer.splitlines()[0] and '"limit": "max_connections_per_client"' in answer
        held += [_half_sent(server.url, source="127.0.0.3") for _ in range(per_client)]  # another client
        _wait_until(lambda: _sending(server, "body") == 2 * per_client == SMALL.max_connections)
        answer = _read_all(_connect(server.url, "127.0.0.4")).decode()
        assert " 503 " in answer.splitlines()[0] and '"limit": "max_connections"' in answer, answer
        for sock in held:
            sock.close()


def _sending(running, phase) -> int:
    """How many of the server's connections are in `phase` ("headers", "body")."""
    table = running.server.connections
    with table.lock:
        return sum(c.phase == phase and not c.evicted for c in table.connections.values())


def _wait_until(condition, seconds=10.0):
    """Poll `condition` (the server's threads move on their own) until true, or fail the test."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        time.sleep(0.01)


def test_a_client_whose_requests_arrived_whole_is_not_held_to_its_share():
    """`max_connections_per_client` counts connections still sending: requests of one address
    that have arrived and are being scored leave its share free for the next one."""
    reward = _HeldReward()
    limits = ServerLimits(
        max_connections=8, max_connections_per_client=1, max_concurrent_requests=3, read_timeout=5.0
    )
    body = _body([_png(8, 8, "RGB")])
    with start_reward_server(reward, limits=limits) as server:
        results, threads = [], []
        for waiting in range(3):  # each arrives whole, then is scored (or waits for the score lock)
            threads.append(_post_in_thread(server.url, body, results))
            _wait_until(lambda n=waiting + 1: server.server.connections.held == n and not _receiving(server))
        reward.release.set()
        for thread in threads:
            thread.join(30)
    assert [status for status, _ in results] == [200] * 3, results


def _receiving(running) -> int:
    table = running.server.connections
    with table.lock:
        return sum(table.receiving.values())


def test_connections_sending_their_headers_give_their_slots_to_new_ones():
    """Connections that opened and never finished their headers (slowloris; a token is a header,
    so nothing about them is known) cannot keep out a client that sends its request: the oldest
    of them is dropped for it, from its own address's share or from the server's."""
    limits = ServerLimits(max_connections=6, max_connections_per_client=3, read_timeout=30.0)
    with start_reward_server("jpeg_compressibility", limits=limits, token="s3cret-token") as server:
        stalled = [_connect(server.url, source) for source in ["127.0.0.2"] * 3 + ["127.0.0.3"] * 3]
        for sock in stalled:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        _wait_until(lambda: _sending(server, "headers") == 6)
        # 127.0.0.1 is under its share but the server is full: the oldest stalled one makes room
        status, answer = _post(server.url, _body([_png(8, 8, "RGB")]), token="s3cret-token", timeout=5)
        assert status == 200, answer
        # 127.0.0.3 is at its share: it drops its own oldest, not another address's
        status, _ = _post(server.url, _body([_png(8, 8, "RGB")]), token="s3cret-token", source="127.0.0.3")
        assert status == 200
        assert [_closed(sock) for sock in stalled] == [True, False, False, True, False, False]
        for sock in stalled:
            sock.close()


def test_a_request_refused_with_401_is_not_read_further():
    """Issue 55: the server answered 401 to a request without the token, then kept reading its body
    until the read deadline, so clients without the token held connections as long as they liked.
    It now closes at once: the client sees the end of the stream, and its slot is free."""
    limits = ServerLimits(
        max_connections=2, max_connections_per_client=2, max_concurrent_requests=1, read_timeout=30.0
    )
    with start_reward_server("jpeg_compressibility", limits=limits, token="s3cret-token") as server:
        refused = [_half_sent(server.url, length=1 << 20) for _ in range(2)]  # 1 byte of 1 MiB sent
        for sock in refused:
            sock.settimeout(5.0)  # far below the read deadline: the old server was still reading
            answer = _read_all(sock).decode()  # returns at the end of the stream
            assert " 401 " in answer.splitlines()[0], answer
        _wait_until(lambda: server.server.connections.held == 0)
        status, answer = _post(server.url, _body([_png(8, 8, "RGB")]), token="s3cret-token")
        assert status == 200, answer
        for sock in refused:
            sock.close()


def test_slow_clients_without_the_token_cannot_lock_out_one_with_it(monkeypatch):
    """Issue 55's probe: 64 clients without the token (the default max_connections), all from
    127.0.0.1 like the legitimate one, half trickling their headers and half sending whole headers
    and then a body byte a second, used to keep the legitimate client out for the whole read
    deadline. It is now scored at once, with no retry."""
    limits = ServerLimits(read_timeout=30.0)
    stop, threads = threading.Event(), []
    with start_reward_server("jpeg_compressibility", limits=limits, token="s3cret-token") as server:
        for index in range(limits.max_connections):
            target = _slow_headers if index % 2 else _slow_body
            threads.append(threading.Thread(target=target, args=(server.url, stop)))
            threads[-1].start()
        _wait_until(lambda: server.server.connections.held >= limits.max_connections_per_client)
        time.sleep(0.2)  # every attacker has connected (or been refused at once, past its address's share)
        monkeypatch.setenv("SCORER_TOKEN", "s3cret-token")
        client = build_reward(
            "http", {"url": server.url, "retries": 0, "timeout": 10, "token_env": "SCORER_TOKEN"}
        )
        scores = client(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["a", "b"]).scores_B
        assert scores.shape == (2,)
        stop.set()
        for thread in threads:
            thread.join(10)


def _slow_headers(url, stop):
    """A connection that sends a header line every 0.1 s and never ends its headers."""
    with contextlib.suppress(OSError), _connect(url) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\n")
        while not stop.wait(0.1):
            sock.sendall(b"X-Pad: a\r\n")


def _slow_body(url, stop):
    """Whole headers without the token, announcing 1000 bytes, then a byte every 0.1 s."""
    with contextlib.suppress(OSError), _half_sent(url) as sock:
        while not stop.wait(0.1):
            sock.sendall(b" ")


def _trickle(url, token, length, stop, answers):
    """Full headers announcing `length` bytes, then the body one byte every 0.1 s (the issue's attack)."""
    sock = _connect(url)
    sock.sendall(
        (
            f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {length}\r\n\r\n"
        ).encode()
    )
    data = b""
    for _ in range(length):
        if stop.is_set() or _readable(sock):
            break
        try:
            sock.send(b" ")
        except OSError:
            break
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        sock.settimeout(10)
        data = _read_all(sock)
    sock.close()
    answers.append(data.split(b" ")[1].decode() if data.startswith(b"HTTP/") else "closed")


def test_clients_trickling_their_bodies_do_not_hold_the_request_slots():
    """Issue 32, item 7: with a token, four clients that send whole headers announcing 1000 bytes and
    then trickle the body used to hold all four request slots, and everyone else got 503 for the
    whole read deadline. A body is now received before its request takes a slot: the normal client
    is scored while they trickle, and they are cut off at the read deadline (408)."""
    limits = ServerLimits(max_concurrent_requests=4, read_timeout=4.0)
    token = "s3cret-token"
    with start_reward_server("jpeg_compressibility", limits=limits, token=token) as server:
        stop, answers = threading.Event(), []
        tricklers = [
            threading.Thread(target=_trickle, args=(server.url, token, 1000, stop, answers))
            for _ in range(limits.max_concurrent_requests)
        ]
        for thread in tricklers:
            thread.start()
        time.sleep(1.0)  # every trickler has sent its headers and some of its body
        status, answer = _post(server.url, _body([_png(8, 8, "RGB")] * 2), token=token)
        assert status == 200 and len(answer["scores"]) == 2, answer
        assert not answers, "a trickler was answered before the read deadline"
        for thread in tricklers:
            thread.join(limits.read_timeout + 10)
        stop.set()
        assert answers == ["408"] * limits.max_concurrent_requests


def test_bodies_being_received_are_bounded_by_the_bytes_that_arrived():
    """What requests still receiving their bodies hold is counted in bytes that arrived (not in
    announced lengths): past max_receiving_bytes a further body gets 503 naming it, while a client
    that announced a large body but sent little holds little."""
    limits = ServerLimits(
        max_connections=8,
        max_connections_per_client=4,
        read_timeout=4.0,
        max_body_bytes=1 << 20,
        max_receiving_bytes=(1 << 20) + (1 << 19),
    )
    with start_reward_server("jpeg_compressibility", limits=limits) as server:
        # announced 1 MiB each, sent 10 bytes: 20 bytes held, a normal request is served
        small = [_half_sent(server.url, length=1 << 20) for _ in range(2)]
        time.sleep(0.3)
        assert _post(server.url, _body([_png(8, 8, "RGB")]))[0] == 200
        # another client sends 1 MiB - 1 byte of its body and stalls: 1 MiB of the 1.5 MiB held
        big = _half_sent(server.url, length=1 << 20, source="127.0.0.2")
        big.sendall(b" " * ((1 << 20) - 2))
        time.sleep(0.5)
        status, answer = _post(server.url, _body([_png(8, 8, "RGB")], ["x" * (900 << 10)]))
        assert status == 503 and answer["limit"] == "max_receiving_bytes", answer
        assert answer["value"] == limits.max_receiving_bytes
        status, answer = _post(server.url, _body([_png(8, 8, "RGB")]))
        assert status == 200, answer  # a small body still fits
        # ... but not from the stalled client's address: it holds its whole share (one body)
        assert limits.max_receiving_bytes_per_client == limits.max_body_bytes
        status, answer = _post(server.url, _body([_png(8, 8, "RGB")]), source="127.0.0.2")
        assert status == 503 and answer["limit"] == "max_receiving_bytes_per_client", answer
        for sock in [*small, big]:
            sock.close()
    with pytest.raises(ValueError, match=r"--max-body-bytes 20 is above --max-receiving-bytes 10"):
        ServerLimits(max_body_bytes=20, max_receiving_bytes=10)


# ------------------------------------------------------------------------------------ load test
SERVER_SCRIPT = textwrap.dedent(
    """
    import sys
    from diffrl.rewards.server import ServerLimits, make_reward_server
    limits = ServerLimits(max_connections=48, max_concurrent_requests=4, read_timeout=2.0,
                          max_body_bytes=4 << 20, max_json_items=20_000, max_images=16,
                          max_image_pixels=512 * 512, max_request_pixels=16 * 512 * 512)
    server = make_reward_server("jpeg_compressibility", port=0, limits=limits)
    print(server.url, flush=True)
    server.serve_forever(0.05)
    """
)
RSS_ALLOWANCE_MB = 200  # 4 concurrent x (3 x 4 MiB body + 12 MiB pixels) = ~100 MiB, plus slack


def _rss_mb(pid, field):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise AssertionError(field)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_mixed_attack_is_refused_in_time_memory_stays_bounded_and_service_continues(huge_png):
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT],
        stdout=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        normal = encode_request(torch.zeros(2, 3, 64, 64, dtype=torch.uint8), ["a", "b"], None)
        assert _post(url, json.dumps(normal).encode())[0] == 200  # warm: the reward's imports are loaded
        baseline = _rss_mb(proc.pid, "VmRSS")
        bomb = _body([huge_png] * 8)  # the 5.4 GB request of issue 18
        prompts = json.dumps({"version": 1, "images": [_png(8, 8)], "prompts": ["p"] * 1_000_000}).encode()
        outcomes, lock = [], threading.Lock()

        def attack(kind):
            start = time.monotonic()
            try:
                if kind == "bomb":
                    result = _post(url, bomb, timeout=15)[0]
                elif kind == "prompts":
                    result = _post(url, prompts, timeout=15)[0]
                else:
                    sock = _half_sent(url) if kind == "half" else _connect(url)
                    sock.settimeout(15)
                    deadline = time.monotonic() + 15
                    data = b""
                    while time.monotonic() < deadline:
                        if kind == "trickle":
                            try:
                                sock.send(b"G")
                            except OSError:
                                break
                        if _readable(sock):
                            with contextlib.suppress(OSError):
                                data = sock.recv(65536)
                            break
                        time.sleep(0.1)
                    sock.close()
                    result = int(data.split()[1]) if data.startswith(b"HTTP/") else "closed"
            except (OSError, http.client.HTTPException) as err:
                # refused before it finished sending: the server answered and closed, the peer saw a reset
                cut = isinstance(err, ConnectionResetError | BrokenPipeError)
                result = "closed" if cut else f"error {err!r}"
            with lock:
                outcomes.append((kind, result, time.monotonic() - start))

        kinds = ["bomb"] * 12 + ["prompts"] * 6 + ["half"] * 15 + ["trickle"] * 15
        threads = [threading.Thread(target=attack, args=(k,)) for k in kinds]
        for t in threads:
            t.start()
        time.sleep(0.5)
        client = build_reward(
            "http", {"url": url, "timeout": 10, "retries": 8, "backoff": 0.25, "max_backoff": 1}
        )
        scores = client(torch.zeros(2, 3, 64, 64, dtype=torch.uint8), ["a", "b"]).scores_B
        assert scores.shape == (2,)
        for t in threads:
            t.join(30)
        assert len(outcomes) == len(kinds)
        for kind, result, seconds in outcomes:
            assert result in (413, 400, 503, 408) or result == "closed", (kind, result)
            assert seconds < 2.0 + 3.0, (kind, seconds)  # the read deadline plus scheduling slack
        peak = _rss_mb(proc.pid, "VmHWM")
        assert peak - baseline < RSS_ALLOWANCE_MB, (baseline, peak)
        assert _post(url, json.dumps(normal).encode())[0] == 200
    finally:
        proc.kill()
        proc.wait(10)
