"""Every setting of `diffrl serve-reward` (and every numeric argument of the `http` reward) is
checked when it starts: a value that parses but cannot work exits 2 naming the flag and its valid
range, before the reward model loads and before anything listens.

`--read-timeout inf` used to start a server that dropped every request unanswered, with an
OverflowError traceback per request in its log; `--port 70000` was a traceback."""

import math
import socket
import urllib.request

import pytest

from diffrl.cli import main
from diffrl.rewards import build_reward
from diffrl.rewards import registry as registry_module
from diffrl.rewards.server import RewardHTTPServer, ServerLimits, start_reward_server
from diffrl.rewards.server_limits import LIMIT_RANGES

# Values that parse (argparse's int / float accept them) but cannot work, per flag: nothing,
# negative, not finite, or far past what the machine can give (a socket timeout of 1e10 s
# overflows time_t; 10^15 bytes is a petabyte).
UNWORKABLE = {
    "--max-connections": ["0", "-1", "1000000"],
    "--max-connections-per-client": ["0", "-3"],
    "--max-concurrent-requests": ["0", "-1", "100000"],
    "--read-timeout": ["inf", "-inf", "nan", "0", "-1", "1e10"],
    "--max-body-bytes": ["0", "-1", str(10**15)],
    "--max-receiving-bytes": ["0", str(10**15)],
    "--max-receiving-bytes-per-client": ["0", str(10**15)],
    "--max-json-items": ["0", str(10**12)],
    "--max-images": ["0", str(10**9)],
    "--max-image-pixels": ["0", str(10**12)],
    "--max-request-pixels": ["0", str(10**12)],
    "--max-prompt-chars": ["0", str(10**12)],
    "--port": ["-1", "65536", "70000"],
}


@pytest.fixture
def nothing_starts(monkeypatch):
    """A check that let a bad value through would load the reward and serve forever: fail instead."""

    def no_reward(*args, **kwargs):
        raise AssertionError("the reward was built: a bad setting was not refused at start")

    def no_serving(self, *args, **kwargs):
        raise AssertionError("the server started serving with a bad setting")

    monkeypatch.setattr(registry_module, "build_reward", no_reward)
    monkeypatch.setattr(RewardHTTPServer, "serve_forever", no_serving)


def test_every_flag_covered():
    flags = {f"--{name.replace('_', '-')}" for name in LIMIT_RANGES} | {"--port"}
    assert set(UNWORKABLE) == flags


@pytest.mark.parametrize(("flag", "value"), [(f, v) for f, values in UNWORKABLE.items() for v in values])
def test_an_unworkable_numeric_setting_exits_2_naming_the_flag_and_its_range(
    flag, value, capsys, nothing_starts
):
    assert main(["serve-reward", "jpeg_compressibility", f"{flag}={value}"]) == 2  # `=`: -1 is no flag
    err = capsys.readouterr().err
    assert err.startswith("diffrl serve-reward: error: reward server: ") and err.count("\n") == 1, err
    assert f"{flag} " in err, err
    # the fix: the range to use, or the other flag to change
    assert (" from " in err and " to " in err) or " or raise " in err, err


def test_the_overflowing_timeouts_above_are_real():
    """Why 1e10 s is refused: the socket layer cannot take it (the request then died unanswered)."""
    with socket.socket() as sock, pytest.raises(OverflowError):
        sock.settimeout(1e10)
    assert not math.isfinite(float("inf"))  # and inf is what `--read-timeout inf` parses to


@pytest.mark.parametrize("value", ["1.5", "ten", "0x10"])
def test_a_whole_number_flag_refuses_a_non_integer(value, capsys, nothing_starts):
    with pytest.raises(SystemExit) as info:  # argparse: exit 2 naming the flag
        main(["serve-reward", "jpeg_compressibility", "--max-images", value])
    assert info.value.code == 2
    assert "--max-images: invalid int value" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["not a host", "-x", "a" * 300, "host_name!", "192.0.2.1"])
def test_a_host_it_cannot_listen_on_exits_2_before_the_reward_loads(host, capsys, nothing_starts):
    """Malformed, unknown, or an address of another machine (192.0.2.1 is TEST-NET-1)."""
    assert main(["serve-reward", "jpeg_compressibility", f"--host={host}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on --host {host!r}" in err, err
    assert "--host must be" in err or "--host is not an address of this machine" in err, err


def test_a_port_in_use_exits_2_before_the_reward_loads(capsys, nothing_starts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve-reward", "jpeg_compressibility", f"--port={port}"]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: Address already in use" in err and "pick another --port" in err, err


@pytest.mark.parametrize("token", ["has space", "t\u00f6k\u00e9n", "line\nbreak"])
def test_a_token_no_client_could_send_exits_2_naming_its_variable(token, capsys, monkeypatch, nothing_starts):
    monkeypatch.setenv("MY_SCORER_TOKEN", token)
    assert main(["serve-reward", "jpeg_compressibility", "--token-env", "MY_SCORER_TOKEN"]) == 2
    err = capsys.readouterr().err
    assert "the token in MY_SCORER_TOKEN is unusable" in err and token not in err  # never echo a secret


def test_limits_given_in_python_are_checked_too():
    """The same checks for `ServerLimits(...)` and `start_reward_server(...)` (tests, notebooks)."""
    for kwargs in (
        {"read_timeout": float("inf")},
        {"read_timeout": float("nan")},
        {"max_images": 2.5},
        {"max_images": True},
        {"max_connections": 8, "max_connections_per_client": 9},
        {"max_connections": 2, "max_concurrent_requests": 3},
    ):
        with pytest.raises(ValueError, match=r"reward server: --"):
            ServerLimits(**kwargs)
    with pytest.raises(ValueError, match=r"--port 65536 is invalid"):
        start_reward_server("jpeg_compressibility", port=65536)


def test_the_per_client_shares_follow_their_totals():
    assert ServerLimits().max_connections_per_client == 16  # a quarter of 64
    assert ServerLimits(max_connections=6).max_connections_per_client == 1
    assert ServerLimits().max_receiving_bytes_per_client == 128 << 20  # half of 256 MiB
    # at least one whole body, or a client could never send one
    limits = ServerLimits(max_body_bytes=100 << 20)
    assert limits.max_receiving_bytes_per_client == 128 << 20
    limits = ServerLimits(max_body_bytes=200 << 20)
    assert limits.max_receiving_bytes_per_client == 200 << 20


def test_a_server_at_the_top_of_the_timeout_range_answers():
    """The largest accepted `--read-timeout` is one the socket layer takes: a request is answered."""
    top = LIMIT_RANGES["read_timeout"].high
    with (
        start_reward_server("jpeg_compressibility", limits=ServerLimits(read_timeout=top)) as server,
        urllib.request.urlopen(f"{server.url}/health", timeout=10) as response,
    ):
        assert response.status == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"timeout": float("inf")}, r"timeout=inf is invalid: use a finite number of seconds above 0"),
        ({"timeout": float("nan")}, r"timeout=nan is invalid"),
        ({"timeout": 1e10}, r"timeout=10000000000.0 is invalid"),
        ({"retries": 1.5}, r"retries=1.5 is invalid: use a whole number from 0 to 100"),
        ({"retries": True}, r"retries=True is invalid"),
        ({"retries": 10**6}, r"retries=1000000 is invalid"),
        ({"backoff": float("inf")}, r"backoff=inf is invalid"),
        ({"backoff": -1}, r"backoff=-1 is invalid"),
        ({"max_backoff": float("nan")}, r"max_backoff=nan is invalid"),
        ({"url": "http://127.0.0.1:99999"}, r"url='http://127.0.0.1:99999' is invalid"),
        ({"url": "http://127.0.0.1:0"}, r"port from 1 to 65535"),
    ],
)
def test_the_http_rewards_numeric_arguments_are_checked(args, message):
    """Each of these used to be accepted and fail at the first batch (an OverflowError from the
    socket or the retry sleep, a TypeError from range(1.5)), after the model had loaded."""
    with pytest.raises(ValueError, match=message):
        build_reward("http", {"url": "http://127.0.0.1:1", **args})
