"""An edit judge over HTTP: the scorer protocol carries the source images and the instruction with
the result, each source once; only servers whose reward reads sources get them; source images
count toward the server's limits; a judge served by `diffrl serve-reward` answers through the
`http` reward, with its token and deadline."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import reward_test_helpers
import torch
from edit_images import condition_image

import diffrl
from diffrl.rewards import MultiReward, build_reward
from diffrl.rewards import wire as wire_module
from diffrl.rewards.base import call_reward
from diffrl.rewards.server import ServerLimits, start_reward_server
from diffrl.rewards.wire import decode_request, encode_request

HELPERS = Path(reward_test_helpers.__file__).parent
REPO = Path(diffrl.__file__).parent.parent


def _image(seed, width=32, height=24) -> torch.Tensor:
    return torch.from_numpy(np.array(condition_image(seed, width, height))).permute(2, 0, 1).contiguous()


def _batch():
    """Four results of 24x24 from two prompts, each prompt's two samples sharing its 32x24 source."""
    pixels = torch.stack([_image(10 + i, 24, 24) for i in range(4)])
    a, b = _image(1), _image(2)
    prompts = ["make it darker", "make it darker", "make it much brighter", "make it much brighter"]
    return pixels, prompts, [(a,), (a,), (b,), (b,)]


def _post(url, body: dict):
    request = urllib.request.Request(
        f"{url}/score",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_wire_format_sends_each_source_once_and_decodes_them_shared():
    pixels, prompts, sources = _batch()
    body = json.loads(json.dumps(encode_request(pixels, prompts, None, sources)))
    assert len(body["source_images"]) == 2 and body["sources"] == [[0], [0], [1], [1]]
    decoded, got_prompts, metadata, got_sources = decode_request(body)
    assert torch.equal(decoded, pixels) and got_prompts == prompts and metadata == [{}] * 4
    assert got_sources[0][0] is got_sources[1][0]  # one tensor per distinct source image
    for got, sent in zip(got_sources, sources, strict=True):
        assert torch.equal(got[0], sent[0])  # lossless, each at its own size (32x24, not 24x24)
    # a server whose reward reads no sources does not open them
    assert decode_request(body, with_sources=False)[3] is None
    # malformed source fields are a 400's message
    without_images = {k: v for k, v in body.items() if k != "source_images"}
    with pytest.raises(ValueError, match=r"'source_images' .* and 'sources' .* go together"):
        decode_request(without_images)
    for bad, message in [
        ({"sources": [[0], [0], [1]]}, r"'sources' has 3 rows for 4 samples"),
        (
            {"sources": [[0], [0], [2], [1]]},
            r"'sources'\[2\] must be a list of indices into 'source_images' \(0\.\.1\)",
        ),
        ({"sources": [[0], [0], [True], [1]]}, r"'sources'\[2\] must be a list of indices"),
    ]:
        with pytest.raises(ValueError, match=message):
            decode_request({**body, **bad})


def test_served_edit_rewards_score_as_they_do_locally():
    pixels, prompts, sources = _batch()
    local_preservation = call_reward(
        build_reward("edit_preservation"), pixels, prompts, [{}] * 4, "e", sources=sources
    )
    local_judge = call_reward(
        build_reward("reward_test_helpers:instruction_judge"), pixels, prompts, [{}] * 4, "j", sources=sources
    )
    with (
        start_reward_server("edit_preservation") as preservation,
        start_reward_server("reward_test_helpers:instruction_judge") as judge,
    ):
        client = build_reward("http", {"url": preservation.url, "timeout": 10})
        assert client.health()["sources"] is True
        remote = client(pixels, prompts, None, sources=sources)
        torch.testing.assert_close(remote.scores_B, local_preservation.scores_B)
        torch.testing.assert_close(remote.extras["kept_fraction"], local_preservation.extras["kept_fraction"])
        # the judge, through MultiReward as a run calls it: the instruction and the source arrive
        rewards = MultiReward({"http@judge": {"args": {"url": judge.url, "timeout": 10}}})
        out = rewards(pixels, prompts, None, sources)
        torch.testing.assert_close(out.scores["http@judge"], local_judge.scores_B)
        assert out.extras["http@judge/source_sum"].tolist() == local_judge.extras["source_sum"].tolist()
        assert out.extras["http@judge/source_height"].tolist() == [24] * 4
        # a judge that needs sources, called without (a text-to-image run): the server says why
        with pytest.raises(RuntimeError, match=r"answered HTTP 400.*edit_preservation compares each result"):
            client(pixels, prompts, None)


def test_sources_go_only_to_servers_whose_reward_reads_them(monkeypatch):
    bodies = []
    original = wire_module.decode_request

    def recording(body, **kwargs):
        bodies.append(sorted(body))
        return original(body, **kwargs)

    monkeypatch.setattr(wire_module, "decode_request", recording)
    pixels, prompts, sources = _batch()
    with start_reward_server("jpeg_compressibility") as server:
        client = build_reward("http", {"url": server.url, "timeout": 10})
        local = build_reward("jpeg_compressibility")(pixels, prompts, None)
        torch.testing.assert_close(client(pixels, prompts, None, sources=sources).scores_B, local.scores_B)
        assert client.server_takes_sources() is False  # asked once, remembered
    with start_reward_server("edit_preservation") as server:
        build_reward("http", {"url": server.url, "timeout": 10})(pixels, prompts, None, sources=sources)
    assert bodies[0] == ["images", "metadata", "prompts", "version"]  # unchanged for non-edit scorers
    assert bodies[1] == ["images", "metadata", "prompts", "source_images", "sources", "version"]


def test_source_images_count_toward_the_servers_limits():
    pixels, prompts, sources = _batch()  # 4 results of 24x24 and 2 sources of 32x24
    body = encode_request(pixels, prompts, None, sources)
    cases = [
        (ServerLimits(max_images=5), "max_images", r"6 images \(video frames and source images count\)"),
        (ServerLimits(max_request_pixels=4 * 576 + 768), "max_request_pixels", r"up to source image 1 hold"),
        (ServerLimits(max_image_pixels=700), "max_image_pixels", r"source image 0 is 32x24 = 768 pixels"),
    ]
    for limits, name, message in cases:
        with start_reward_server("edit_preservation", limits=limits) as server:
            status, answer = _post(server.url, body)
            assert (status, answer["limit"]) == (413, name), answer
            assert answer["value"] == getattr(limits, name)
            assert re.search(message, answer["error"]), answer["error"]
            # the same request to a reward that reads no sources: they are not opened or counted
        with start_reward_server("jpeg_compressibility", limits=limits) as server:
            assert _post(server.url, body)[0] == 200
    with start_reward_server("edit_preservation") as server:
        status, answer = _post(server.url, {**body, "sources": [[0], [0], [5], [1]]})
        assert status == 400 and "'sources'[2] must be a list of indices" in answer["error"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_judge_served_by_the_cli_answers_through_the_http_reward(monkeypatch):
    """`diffrl serve-reward module:judge` in its own process, with a token: the trainer's `http`
    reward sends the instruction, the result and the source, and gets the judge's scores within
    its deadline."""
    port = _free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(HELPERS)]),
        DIFFRL_REWARD_TOKEN="judge-token-for-the-test",
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable,
        "-m",
        "diffrl.cli",
        "serve-reward",
        "reward_test_helpers:instruction_judge",
        "bonus=0.5",
    ]
    proc = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        monkeypatch.setenv("JUDGE_TOKEN", "judge-token-for-the-test")
        client = build_reward(
            "http",
            {"url": f"http://127.0.0.1:{port}", "timeout": 10, "token_env": "JUDGE_TOKEN", "retries": 0},
        )
        deadline = time.monotonic() + 30
        while True:  # the server imports torch first: wait for it, within a deadline
            try:
                assert client.health()["sources"] is True
                break
            except ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(
                        f"the judge server did not start: {proc.stdout.read() if proc.poll() is not None else ''}"
                    ) from None
                time.sleep(0.2)
        pixels, prompts, sources = _batch()
        start = time.perf_counter()
        out = client(pixels, prompts, [{"id": i} for i in range(4)], sources=sources)
        assert time.perf_counter() - start < 10
        local = build_reward("reward_test_helpers:instruction_judge", {"bonus": 0.5})
        expected = call_reward(local, pixels, prompts, [{}] * 4, "j", sources=sources)
        torch.testing.assert_close(out.scores_B, expected.scores_B)
        assert out.extras["source_sum"].tolist() == expected.extras["source_sum"].tolist()
        # without the token: refused
        anonymous = build_reward("http", {"url": f"http://127.0.0.1:{port}", "timeout": 10, "retries": 0})
        with pytest.raises(RuntimeError, match=r"HTTP 401"):
            anonymous(pixels, prompts, None, sources=sources)
    finally:
        proc.terminate()
        proc.wait(10)
