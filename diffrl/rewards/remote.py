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
       "prompts": ["...", ...],                   # B strings (in an edit run: the instructions)
       "metadata": [{...}, ...],                  # B JSON objects
       "source_images": ["<base64 PNG>", ...],    # optional (edit runs): the batch's distinct
       "sources": [[0], [0], [1], ...]}           #   source images, each once, and per sample the
                                                  #   indices of its own, in row order
    200 -> {"scores": [float x B], "extras": {"name": [per-sample values, B long]}}
    4xx/5xx -> {"error": "message"}
    GET <url>/health -> {"status": "ok", "reward": "<spec>", "version": 1, "sources": true|false}

The two source fields are additive: a server whose reward reads source images (`takes_sources`)
says `"sources": true` in /health, and the client sends them only to such a server (a server
without the key, an older one, never gets them), so the requests of non-edit scorers are
unchanged. Source images count toward the server's image and pixel limits; they may have another
size than the results (each its own).

The client (`HttpReward`) retries connection failures, timeouts, and 429/502/503/504 answers with
exponential backoff (`backoff * 2**attempt` seconds, capped at `max_backoff`), `retries` times;
other errors (a 400 for a bad request, a 500 when the remote reward raised) are reported at once
with the server's message. When every attempt fails it raises `ConnectionError` (unreachable) or
`TimeoutError` (no complete answer within `timeout` seconds), naming the URL and the fix.

`timeout` is a deadline for the whole attempt (connect, send, scoring, reading every byte of the
answer), not a per-read socket timeout: a server that trickles one byte a second, or accepts and
never answers, is cut off at the deadline. An answer that is not JSON, has the wrong number of
scores, or non-finite scores is a ValueError naming the server. With `token_env`, the client sends
`Authorization: Bearer <the value of that environment variable>` (the server's `--token`).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from diffrl.lazy import lazy_import
from diffrl.rewards.base import RewardOutput, as_reward_output, check_batch, decode_sources
from diffrl.rewards.registry import register_reward

torch = lazy_import("torch")  # deferred: see diffrl.lazy

PROTOCOL_VERSION = 1
RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_RESPONSE_BYTES = 64 << 20  # scores and extras of one batch; anything larger is a broken server
IMAGE_FORMATS = ("PNG", "JPEG")  # the only decoders a request may reach (PNG is what clients send)


class LimitExceeded(ValueError):
    """A request is over one of the server's limits: `limit` names it (the CLI flag), `value` is its value."""

    def __init__(self, limit: str, value: int | float, message: str, status: int = 413) -> None:
        super().__init__(f"{message} (limit {limit}={value})")
        self.limit, self.value, self.status = limit, value, status


# ----------------------------------------------------------------------------------- wire format
def encode_png(frame_3HW: torch.Tensor) -> str:
    """uint8 [3,H,W] -> base64 PNG (lossless, so the server scores exactly the sampled pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(frame_3HW.permute(1, 2, 0).contiguous().numpy(), mode="RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: str) -> torch.Tensor:
    """base64 PNG -> uint8 [3,H,W] RGB."""
    image = _open_image(data)
    return _to_chw(image)


def pillow_pixel_cap() -> int:
    """The most pixels `Image.open` accepts: above it Pillow raises DecompressionBombError itself
    (twice `Image.MAX_IMAGE_PIXELS`, which only warns); None there disables its check."""
    cap = Image.MAX_IMAGE_PIXELS
    return 2 * int(cap) if cap is not None else 1 << 62


def _open_image(data: Any, index: int = 0, max_image_pixels: int | None = None) -> Image.Image:
    """A PIL image from base64 with only its header read (the size is known, no pixel decoded yet).

    Pillow's own decompression-bomb check runs in `Image.open`, before the caller can compare the
    size with its limit: an image it refuses is over `max_image_pixels` too (a server refuses a
    larger limit when it starts), so the answer names the caller's limit, never Pillow's number."""
    if not isinstance(data, str):
        raise ValueError(f"an image must be a base64 string, got {type(data).__name__}")
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True)), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as err:
        if max_image_pixels is None:
            raise ValueError(f"image {index} is too large to decode: {err}") from err
        raise LimitExceeded(
            "max_image_pixels", max_image_pixels, f"image {index} has more than {pillow_pixel_cap()} pixels"
        ) from err
    except Exception as err:
        raise ValueError(f"not a base64-encoded PNG or JPEG: {type(err).__name__}: {err}") from err


def _to_chw(image: Image.Image, out_3HW: torch.Tensor | None = None) -> torch.Tensor:
    """Decode the pixels (RGB) into `out_3HW` (or a new tensor)."""
    try:
        array_HW3 = np.asarray(image.convert("RGB"))
    except Exception as err:
        raise ValueError(f"image data is corrupt: {type(err).__name__}: {err}") from err
    if out_3HW is None:
        return torch.from_numpy(array_HW3.transpose(2, 0, 1).copy())
    out_3HW.numpy()[...] = array_HW3.transpose(2, 0, 1)  # through a view: no intermediate tensor
    return out_3HW


def encode_request(
    pixels: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    sources: Sequence[Sequence[torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The JSON body of POST /score for one batch (checked against the reward contract).

    `sources`: each sample's source images (uint8 [3, H, W]); each distinct tensor is encoded
    once into "source_images", and "sources" holds each sample's indices into it."""
    rows = check_batch(pixels, prompts, metadata)
    pixels = pixels.detach().cpu()
    body: dict[str, Any] = {"version": PROTOCOL_VERSION, "prompts": list(prompts), "metadata": rows}
    if pixels.ndim == 4:
        body["images"] = [encode_png(frame) for frame in pixels]
    else:
        body["videos"] = [[encode_png(frame) for frame in video] for video in pixels]
    if sources is not None:
        index: dict[int, int] = {}  # id(tensor) -> its place in source_images
        images: list[str] = []
        sample_rows = []
        for row in decode_sources(sources, int(pixels.shape[0])):
            for image in row:
                if id(image) not in index:
                    index[id(image)] = len(images)
                    images.append(encode_png(image.detach().cpu()))
            sample_rows.append([index[id(image)] for image in row])
        body["source_images"], body["sources"] = images, sample_rows
    return body


def _source_indices(body: dict[str, Any], batch: int) -> tuple[list[Any], list[list[int]]] | None:
    """("source_images", "sources") of a request, checked; None when it has neither."""
    if "sources" not in body and "source_images" not in body:
        return None
    images, rows = body.get("source_images"), body.get("sources")
    if not isinstance(images, list) or not isinstance(rows, list):
        raise ValueError(
            "'source_images' (a list of base64 PNGs) and 'sources' (one list of indices per sample) "
            "go together"
        )
    if len(rows) != batch:
        raise ValueError(
            f"'sources' has {len(rows)} rows for {batch} samples; one list of indices per sample"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(images) for k in row
        ):
            raise ValueError(
                f"'sources'[{i}] must be a list of indices into 'source_images' (0..{len(images) - 1}), "
                f"got {str(row)[:100]}"
            )
    return images, rows


def decode_request(
    body: Any,
    *,
    max_images: int | None = None,
    max_image_pixels: int | None = None,
    max_request_pixels: int | None = None,
    max_prompt_chars: int | None = None,
    with_sources: bool = True,
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]], list[tuple[torch.Tensor, ...]] | None]:
    """(pixels, prompts, metadata, sources) from a POST /score body; ValueError says what is malformed.

    `sources` is None when the body has none, or when `with_sources` is False (a server whose
    reward reads no source images ignores them: not one is opened). Otherwise B tuples of uint8
    [3, H, W] tensors, the samples that name the same source image sharing its tensor.

    The limits (None = unbounded) are checked before any pixel is decoded: counts first, then each
    image's header (width x height), so a small PNG that claims 8000x8000 costs a few bytes, not
    192 MB; source images count like the results. `LimitExceeded` (a ValueError) names the limit;
    the server answers 413 with it. Frames are decoded one by one straight into the batch tensor
    (no per-frame copies kept).
    """
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
        items = body["images"]
        if not isinstance(items, list) or not items:
            raise ValueError("'images' must be a non-empty list of base64 PNG strings")
        frames, lead = items, (len(items),)
    else:
        items = body["videos"]
        if not isinstance(items, list) or not items or not all(isinstance(v, list) and v for v in items):
            raise ValueError("'videos' must be a non-empty list of non-empty lists of base64 PNG strings")
        if len({len(v) for v in items}) != 1:
            raise ValueError("all videos of a request must have the same frame count and size")
        frames, lead = [frame for video in items for frame in video], (len(items), len(items[0]))
    if len(prompts) != lead[0] or len(metadata) != lead[0]:
        raise ValueError(
            f"{lead[0]} samples but {len(prompts)} prompts and {len(metadata)} metadata rows; one of each per sample"
        )
    given = _source_indices(body, lead[0]) if with_sources else None
    source_data = given[0] if given is not None else []
    if max_images is not None and len(frames) + len(source_data) > max_images:
        raise LimitExceeded(
            "max_images",
            max_images,
            f"{len(frames) + len(source_data)} images (video frames and source images count) in one request",
        )
    if max_prompt_chars is not None:
        longest = max((len(p) for p in prompts), default=0)
        if longest > max_prompt_chars:
            raise LimitExceeded("max_prompt_chars", max_prompt_chars, f"a prompt of {longest} characters")
    # Every header first (results, then source images), so the limits hold before any pixel decodes.
    opened = []
    total_pixels = 0
    for index, data in enumerate([*frames, *source_data]):
        what = f"image {index}" if index < len(frames) else f"source image {index - len(frames)}"
        image = _open_image(data, index, max_image_pixels)
        width, height = image.size
        if max_image_pixels is not None and width * height > max_image_pixels:
            raise LimitExceeded(
                "max_image_pixels", max_image_pixels, f"{what} is {width}x{height} = {width * height} pixels"
            )
        total_pixels += width * height
        if max_request_pixels is not None and total_pixels > max_request_pixels:
            raise LimitExceeded(
                "max_request_pixels",
                max_request_pixels,
                f"the images up to {what} hold {total_pixels} pixels (source images count)",
            )
        if index < len(frames) and opened and image.size != opened[0].size:
            raise ValueError(
                f"all images of a request must have the same size: image {index} is {width}x{height}, "
                f"image 0 is {opened[0].size[0]}x{opened[0].size[1]}"
            )
        opened.append(image)
    images, source_images = opened[: len(frames)], opened[len(frames) :]
    width, height = images[0].size
    pixels = torch.empty((len(images), 3, height, width), dtype=torch.uint8)
    for index, image in enumerate(images):
        _to_chw(image, pixels[index])
        images[index] = None  # type: ignore[call-overload]  # free the compressed bytes as we go
    pixels = pixels.reshape(*lead, 3, height, width)
    rows = check_batch(pixels, prompts, metadata)
    if given is None:
        return pixels, prompts, rows, None
    decoded = [_to_chw(image) for image in source_images]
    return pixels, prompts, rows, [tuple(decoded[k] for k in row) for row in given[1]]


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
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                f"http reward: url={url!r} is invalid: use http://HOST:PORT (the address `diffrl serve-reward` prints)"
            )
        if timeout <= 0:
            raise ValueError(f"http reward: timeout={timeout!r} is invalid: must be > 0 seconds")
        if retries < 0:
            raise ValueError(f"http reward: retries={retries!r} is invalid: must be >= 0")
        if backoff < 0 or max_backoff < 0:
            raise ValueError(f"http reward: backoff={backoff!r}, max_backoff={max_backoff!r} must be >= 0")
        self.token: str | None = None
        if token_env is not None:
            self.token = os.environ.get(token_env)
            if not self.token:
                raise ValueError(
                    f"http reward: token_env={token_env!r} names an environment variable that is not set "
                    f"(or empty): export {token_env}=<the token the server was started with>"
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
            conn.request(method, f"{self._parsed.path}{path}", body=body, headers=headers)
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
            message = _error_message(data)
            if status in RETRY_STATUSES:
                last, timed_out = RuntimeError(f"HTTP {status}: {message}"), False
                continue
            hint = " (set args.token_env to the variable holding the server's token)" if status == 401 else ""
            raise RuntimeError(f"http reward: {endpoint} answered HTTP {status}: {message}{hint}")
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
        endpoint = f"{self.url}/health"
        try:
            status, data = self._request("GET", "/health", None)
        except (OSError, http.client.HTTPException) as err:
            raise ConnectionError(f"http reward: cannot reach {endpoint}: {_reason(err)}") from err
        if status != 200:
            raise RuntimeError(f"http reward: {endpoint} answered HTTP {status}: {_error_message(data)}")
        answer = _parse_json(data, endpoint)
        if isinstance(answer, dict):  # the start-up probe answers `server_takes_sources` too
            self._server_takes_sources = answer.get("sources") is True
        return answer

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
