"""The `http` reward against `diffrl serve-reward`'s server, end to end on loopback."""

import argparse
import contextlib
import json
import socket
import threading
import time
import urllib.request

import pytest
import torch

from diffrl.rewards import build_reward
from diffrl.rewards.serve_cli import limits_from_args, parse_key_values, register_cli
from diffrl.rewards.server import ServerLimits, start_reward_server
from diffrl.rewards.wire import decode_png, decode_request, encode_png, encode_request

FAST = {"retries": 1, "backoff": 0.01}  # keep failing cases quick


def _pixels(batch=3, seed=0, size=24):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_png_wire_format_is_lossless():
    pixels = _pixels()
    for frame in pixels:
        assert torch.equal(decode_png(encode_png(frame)), frame)
    video = _pixels(6).reshape(2, 3, 3, 24, 24)
    decoded, prompts, metadata, sources = decode_request(
        json.loads(json.dumps(encode_request(video, ["a", "b"], None)))
    )
    assert torch.equal(decoded, video) and prompts == ["a", "b"] and metadata == [{}, {}]
    assert sources is None  # a request without source images (every non-edit run)


def test_scores_over_http_equal_the_local_reward():
    pixels, prompts = _pixels(), ["a", "b", "c"]
    local = build_reward("jpeg_incompressibility", {"quality": 80})(pixels, prompts, None)
    with start_reward_server("jpeg_incompressibility", {"quality": 80}) as server:
        client = build_reward("http", {"url": server.url, "timeout": 10})
        remote = client(pixels, prompts, [{}, {}, {}])
        assert client.health() == {
            "status": "ok",
            "reward": "jpeg_incompressibility",
            "version": 1,
            "sources": False,  # it reads no source images: a client never sends it any
        }
        video = pixels.unsqueeze(0)
        remote_video = client(video, ["v"], None).scores_B
    torch.testing.assert_close(remote.scores_B, local.scores_B)
    torch.testing.assert_close(remote.extras["jpeg_kb"], local.extras["jpeg_kb"])
    torch.testing.assert_close(remote_video, local.scores_B.mean().reshape(1))


def test_user_function_served_with_metadata():
    with start_reward_server("reward_test_helpers:async_prompt_length") as server:
        out = build_reward("http", {"url": server.url})(_pixels(2), ["one", "three"], [{"k": [1, 2]}, {}])
    assert out.scores_B.tolist() == [3.0, 5.0]
    assert out.extras["words"].tolist() == [1, 1]


def test_server_down_is_a_clear_connection_error():
    url = f"http://127.0.0.1:{_free_port()}"
    client = build_reward("http", {"url": url, **FAST})
    with pytest.raises(ConnectionError, match=rf"cannot reach {url}/score \(2 attempts.*diffrl serve-reward"):
        client(_pixels(1), ["a"], None)


def test_slow_server_is_a_clear_timeout_error():
    with start_reward_server("reward_test_helpers:slow", {"seconds": 1.0}) as server:
        client = build_reward("http", {"url": server.url, "timeout": 0.2, **FAST})
        start = time.perf_counter()
        with pytest.raises(
            TimeoutError, match=r"did not answer within timeout=0.2 s \(2 attempts\).*args.timeout"
        ):
            client(_pixels(1), ["a"], None)
        assert time.perf_counter() - start < 1.5  # two 0.2 s attempts and a 0.01 s backoff, no more


def test_remote_errors_are_reported_with_the_servers_message():
    with (
        start_reward_server("reward_test_helpers:rejects") as server,
        pytest.raises(RuntimeError, match=r"answered HTTP 400: ValueError: metadata lacks 'target'"),
    ):
        build_reward("http", {"url": server.url, **FAST})(_pixels(1), ["a"], None)
    with start_reward_server("reward_test_helpers:always_fails") as server:
        with pytest.raises(RuntimeError, match=r"answered HTTP 500: RuntimeError: scorer exploded"):
            build_reward("http", {"url": server.url, **FAST})(_pixels(1), ["a"], None)
        request = urllib.request.Request(
            f"{server.url}/score",
            data=b"not json",
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        assert info.value.code == 400 and "bad request" in json.loads(info.value.read())["error"]


def test_client_argument_errors():
    for args, message in [
        ({"url": "localhost:8000"}, "use http://HOST:PORT"),
        ({"url": "http://h:1", "timeout": 0}, "timeout=0 is invalid"),
        ({"url": "http://h:1", "retries": -1}, "retries=-1 is invalid"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_reward("http", args)


def test_cli_parses_name_args_host_and_port():
    parser = argparse.ArgumentParser(prog="diffrl")
    register_cli(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(
        ["serve-reward", "ocr", "lang=eng", "psm=7", "--host", "0.0.0.0", "--port", "9000"]
    )
    assert (ns.command, ns.name, ns.host, ns.port) == ("serve-reward", "ocr", "0.0.0.0", 9000)
    assert parse_key_values(ns.args) == {"lang": "eng", "psm": 7}
    assert callable(ns.func)
    assert limits_from_args(ns) == ServerLimits() and ns.token_env == "DIFFRL_REWARD_TOKEN"
    ns = parser.parse_args(["serve-reward", "ocr", "--max-images", "8", "--read-timeout", "2.5"])
    assert limits_from_args(ns) == ServerLimits(max_images=8, read_timeout=2.5)
    with pytest.raises(ValueError, match=r"--max-images 0 is out of range"):
        ServerLimits(max_images=0)
    with pytest.raises(ValueError, match=r"is not key=value"):
        parse_key_values(["model"])


def test_busy_port_is_a_clear_error():
    with start_reward_server("jpeg_compressibility") as server:
        port = int(server.url.rsplit(":", 1)[1])
        with pytest.raises(
            ValueError, match=rf"cannot listen on --host .127.0.0.1. --port {port}.*pick another --port"
        ):
            start_reward_server("jpeg_compressibility", port=port)


@contextlib.contextmanager
def _raw_server(behaviour):
    """A TCP server on loopback whose every connection is handled by `behaviour(conn)` on a thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_run, args=(behaviour, conn), daemon=True).start()

    def _run(fn, conn):
        with contextlib.suppress(OSError), conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            fn(conn, stop)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _trickle(conn, stop):
    """A valid answer, one byte every 0.05 s: a per-read timeout of 0.3 s would never fire."""
    body = json.dumps({"scores": [1.0]}).encode()
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    for byte in answer:
        if stop.wait(0.05):
            return
        conn.sendall(bytes([byte]))


def _hang(conn, stop):
    stop.wait(30)


def _answer_with(body: bytes):
    def fn(conn, stop):
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    return fn


@pytest.mark.parametrize("behaviour", [_trickle, _hang], ids=["trickling", "hanging"])
def test_slow_or_silent_server_fails_at_the_total_deadline(behaviour):
    with _raw_server(behaviour) as url:
        client = build_reward("http", {"url": url, "timeout": 0.3, "retries": 1, "backoff": 0.01})
        start = time.perf_counter()
        with pytest.raises(
            TimeoutError, match=rf"{url}/score did not answer within timeout=0.3 s \(2 attempts\)"
        ):
            client(_pixels(1), ["a"], None)
        # the trickled answer would take ~3 s per attempt; two 0.3 s attempts are all we wait
        assert time.perf_counter() - start < 1.5


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>hello</html>", r"answered HTTP 200 with a body that is not JSON"),
        (json.dumps({"scores": [1.0, 2.0]}).encode(), r"scores of shape \(2,\); expected \(1,\)"),
        (b'{"scores": [NaN]}', r"non-finite scores for samples \[0\]"),
        (b'{"nothing": 1}', r"answer has no 'scores'"),
    ],
    ids=["not-json", "wrong-count", "nan", "no-scores"],
)
def test_lying_server_is_a_clear_value_error(body, message):
    with _raw_server(_answer_with(body)) as url:
        client = build_reward("http", {"url": url, "timeout": 5, **FAST})
        start = time.perf_counter()
        with pytest.raises(ValueError, match=message) as info:
            client(_pixels(1), ["a"], None)
        assert url in str(info.value) and time.perf_counter() - start < 2


def test_server_modules_import_only_the_standard_library():
    """`diffrl --help` builds the serve-reward parser from these modules; the reward stack (torch,
    PIL, the models) must load only when a server is made, so their top-level imports are the
    standard library's and each other's."""
    import ast
    import sys
    from pathlib import Path

    import diffrl.rewards.server as server
    import diffrl.rewards.server_admission as server_admission
    import diffrl.rewards.server_handler as server_handler
    import diffrl.rewards.server_limits as server_limits

    ours = {
        "diffrl.rewards.server_limits",
        "diffrl.rewards.server_admission",
        "diffrl.rewards.server_handler",
    }
    for module in (server, server_limits, server_admission, server_handler):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in tree.body:  # top level only: imports inside functions run when a server is made
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:  # `if TYPE_CHECKING:` blocks import nothing at run time
                continue
            for name in names:
                assert name in ours or name.split(".")[0] in sys.stdlib_module_names, (module.__name__, name)
