"""The `http` reward: score on a remote server (`diffrl serve-reward NAME`), over JSON.

Why: a big reward model (a VLM judge, a private scorer) often lives on other machines or in
another Python environment; the trainer only needs its numbers. The wire format is plain JSON with
PNG images in base64, never pickle, so a server can be written in any language and a malicious
peer cannot run code in the trainer.

Protocol (version 1):

    POST <url>/score
      {"version": 1,
       "images": ["<base64 PNG>", ...]            # B images, or
       "videos": [["<base64 PNG>", ...], ...],    # B videos of T frames (exactly one of the two)
       "prompts": ["...", ...],                   # B strings
       "metadata": [{...}, ...]}                  # B JSON objects
    200 -> {"scores": [float x B], "extras": {"name": [per-sample values, B long]}}
    4xx/5xx -> {"error": "message"}
    GET <url>/health -> {"status": "ok", "reward": "<spec>", "version": 1}

The client (`HttpReward`) retries connection failures, timeouts, and 429/502/503/504 answers with
exponential backoff (`backoff * 2**attempt` seconds, capped at `max_backoff`), `retries` times;
other errors (a 400 for a bad request, a 500 when the remote reward raised) are reported at once
with the server's message. When every attempt fails it raises `ConnectionError` (unreachable) or
`TimeoutError` (no answer within `timeout` seconds), naming the URL and the fix.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from diffrl.rewards.base import RewardOutput, as_reward_output, check_batch
from diffrl.rewards.registry import register_reward

PROTOCOL_VERSION = 1
RETRY_STATUSES = frozenset({429, 502, 503, 504})


# ----------------------------------------------------------------------------------- wire format
def encode_png(frame_3HW: torch.Tensor) -> str:
    """uint8 [3,H,W] -> base64 PNG (lossless, so the server scores exactly the sampled pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(frame_3HW.permute(1, 2, 0).contiguous().numpy(), mode="RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: str) -> torch.Tensor:
    """base64 PNG -> uint8 [3,H,W] RGB."""
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        image.load()
    except Exception as err:
        raise ValueError(f"not a base64-encoded image: {type(err).__name__}: {err}") from err
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()


def encode_request(
    pixels: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The JSON body of POST /score for one batch (checked against the reward contract)."""
    rows = check_batch(pixels, prompts, metadata)
    pixels = pixels.detach().cpu()
    body: dict[str, Any] = {"version": PROTOCOL_VERSION, "prompts": list(prompts), "metadata": rows}
    if pixels.ndim == 4:
        body["images"] = [encode_png(frame) for frame in pixels]
    else:
        body["videos"] = [[encode_png(frame) for frame in video] for video in pixels]
    return body


def decode_request(body: Any) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """(pixels, prompts, metadata) from a POST /score body; ValueError says what is malformed."""
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ValueError(
            f"protocol version {body.get('version')!r} is not supported (this server: {PROTOCOL_VERSION})"
        )
    if ("images" in body) == ("videos" in body):
        raise ValueError("the request needs exactly one of 'images' (B PNGs) or 'videos' (B lists of PNGs)")
    prompts, metadata = body.get("prompts"), body.get("metadata")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list):
        raise ValueError("'metadata' must be a list of objects")
    if "images" in body:
        images = body["images"]
        if not isinstance(images, list) or not images:
            raise ValueError("'images' must be a non-empty list of base64 PNG strings")
        frames = [decode_png(item) for item in images]
        if len({tuple(f.shape) for f in frames}) != 1:
            raise ValueError("all images of a request must have the same size")
        pixels = torch.stack(frames)
    else:
        videos = body["videos"]
        if not isinstance(videos, list) or not videos or not all(isinstance(v, list) and v for v in videos):
            raise ValueError("'videos' must be a non-empty list of non-empty lists of base64 PNG strings")
        clips = [torch.stack([decode_png(item) for item in video]) for video in videos]
        if len({tuple(c.shape) for c in clips}) != 1:
            raise ValueError("all videos of a request must have the same frame count and size")
        pixels = torch.stack(clips)
    rows = check_batch(pixels, prompts, metadata)
    return pixels, prompts, rows


def encode_response(output: RewardOutput) -> dict[str, Any]:
    """The JSON answer to POST /score."""
    return {
        "scores": output.scores_B.tolist(),
        "extras": {key: value.tolist() for key, value in output.extras.items()},
    }


def decode_response(body: Any, batch_size: int, name: str) -> RewardOutput:
    """A checked `RewardOutput` from a POST /score answer."""
    if not isinstance(body, dict) or "scores" not in body:
        raise ValueError(f"reward {name!r}: the server's answer has no 'scores': {str(body)[:200]}")
    extras = body.get("extras") or {}
    if not isinstance(extras, dict):
        raise ValueError(
            f"reward {name!r}: the server's 'extras' must be an object, got {type(extras).__name__}"
        )
    try:
        output = RewardOutput(
            torch.tensor(body["scores"], dtype=torch.float32),
            {key: torch.tensor(value) for key, value in extras.items()},
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward {name!r}: the server's answer is not numeric: {err}") from err
    return as_reward_output(output, batch_size, name)


# ---------------------------------------------------------------------------------------- client
@register_reward("http")
class HttpReward:
    """Client of a remote scorer speaking the protocol above.

    Args:
        url: the server's base URL, e.g. "http://scorer-host:8000" (requests go to <url>/score).
        timeout: socket timeout in seconds: the longest wait to connect, or for the server to start
            answering (its scoring time included).
        retries: extra attempts after the first, for connection errors, timeouts and 429/502/503/504.
        backoff: seconds before the first retry; doubles each retry.
        max_backoff: cap on one wait, in seconds.
    """

    name = "http"

    def __init__(
        self,
        url: str,
        timeout: float = 300.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"http reward: url={url!r} is invalid: use http://HOST:PORT (the address `diffrl serve-reward` prints)"
            )
        if timeout <= 0:
            raise ValueError(f"http reward: timeout={timeout!r} is invalid: must be > 0 seconds")
        if retries < 0:
            raise ValueError(f"http reward: retries={retries!r} is invalid: must be >= 0")
        if backoff < 0 or max_backoff < 0:
            raise ValueError(f"http reward: backoff={backoff!r}, max_backoff={max_backoff!r} must be >= 0")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)

    def _post(self, body: bytes) -> Any:
        """POST to <url>/score with retries; the decoded JSON answer."""
        endpoint = f"{self.url}/score"
        attempts = self.retries + 1
        last: Exception | None = None
        timed_out = False
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            request = urllib.request.Request(
                endpoint, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                message = _error_message(err)
                if err.code in RETRY_STATUSES:
                    last, timed_out = RuntimeError(f"HTTP {err.code}: {message}"), False
                    continue
                raise RuntimeError(f"http reward: {endpoint} answered HTTP {err.code}: {message}") from err
            except TimeoutError as err:
                last, timed_out = err, True
            except urllib.error.URLError as err:
                last = err
                timed_out = isinstance(err.reason, TimeoutError)
            except (ConnectionError, http.client.HTTPException) as err:
                last, timed_out = err, False
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
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
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=self.timeout) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(f"http reward: cannot reach {self.url}/health: {_reason(err)}") from err

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardOutput:
        rows = check_batch(pixels, prompts, metadata)
        try:
            body = json.dumps(encode_request(pixels, prompts, rows)).encode()
        except TypeError as err:
            raise ValueError(f"http reward: metadata must be JSON-serialisable to send it: {err}") from err
        return decode_response(self._post(body), int(pixels.shape[0]), f"http {self.url}")


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        body = err.read()
        return str(json.loads(body).get("error", body[:500]))
    except Exception:
        return str(err.reason)


def _reason(err: BaseException | None) -> str:
    if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
        return str(err.reason)
    return f"{type(err).__name__}: {err}" if err is not None else "unknown"
