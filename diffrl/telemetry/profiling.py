"""One training step's worker calls under torch.profiler: where their time goes (`trainer.profile_steps`).

Each worker starts the profiler before a profiled step (`StepProfiler.start`) and stops it after
(`StepProfiler.stop`), which writes the step's Chrome trace (`<name>.trace.json.gz`: open it in
https://ui.perfetto.dev) and returns its summary (`summarise_trace`): for each worker call, the
methods marked `@profiled_call` (`sample_and_score`, `staged_forward_backward`, `optim_step`, ...),
its number of calls, its wall seconds and the device work that ran for it, by kind:

    matmul      GEMMs and convolutions (cuBLAS, CUTLASS, cuDNN convolution kernels)
    attention   attention kernels (flash, cuDNN and memory-efficient SDPA)
    fused       kernels torch.compile generated (Triton): norms, activations, LoRA's small ops
    collective  NCCL's kernels (FSDP2's all-gathers and reduce-scatters, DDP's all-reduces), which
                may run beside the compute on their own streams
    other       every other kernel (torch's eager elementwise ops, reductions, copies)
    memory      memcpy and memset

`busy_fraction` is the share of the call's wall time during which some kernel ran; the rest,
`idle_s`, is split by the length of each gap between kernels: under 50 us (back-to-back launches),
50 us to 1 ms (the host dispatching slower than the GPU runs), over 1 ms (the host waiting:
synchronisation, CPU work, a collective's peers, a reward). A kernel belongs to the call that
started last before it: one worker's calls run one at a time on one thread, and a call's queued
kernels may still run after it returns. On a CPU worker the same table counts the top-level torch
operators' CPU time (a `linear` with the `addmm` inside it counts once).
"""

from __future__ import annotations

import bisect
import functools
import gzip
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

#: Prefix of the profiler ranges `profiled_call` opens; a call's summary name is what follows it.
CALL_PREFIX = "diffrl."

KINDS = ("matmul", "attention", "fused", "collective", "other", "memory")

# Lower-cased substrings of kernel names, tried in this order (attention before matmul: a flash
# kernel's name can also say "mma").
_GPU_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collective", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "conv", "fprop", "dgrad", "wgrad")),
    ("fused", ("triton",)),
)
_CPU_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "sdpa", "flash")),
    ("matmul", ("linear", "addmm", "matmul", "::mm", "bmm", "conv")),
)
# CPU ranges that wrap operators rather than being one (torch.compile's): their insides count.
_CPU_WRAPPERS = ("Torch-Compiled Region", "TorchDynamo Cache Lookup", "CompiledFunction", "## ")
# How many of a call's longest kernels (or operators) its summary lists.
TOP_KERNELS = 8
_NAME_CHARS = 120

F = TypeVar("F", bound=Callable[..., Any])


def profiled_call(fn: F) -> F:
    """Mark a worker method as a call of its own in step profiles (`diffrl.<name>` ranges).

    A fresh range per call: one decorated method may run in several worker threads of a process."""
    name = CALL_PREFIX + fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def kernel_kind(name: str, table: Sequence[tuple[str, tuple[str, ...]]] = _GPU_KINDS) -> str:
    lowered = name.lower()
    for kind, needles in table:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


#: Idle gaps by length (microseconds): back-to-back launches, host-bound dispatch, host waits.
GAP_BUCKETS = (("under_50us", 50.0), ("50us_to_1ms", 1000.0), ("over_1ms", float("inf")))


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) intervals with overlapping ones joined, in order."""
    out: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _idle_gaps(busy: list[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    """Seconds of [start, end) with no kernel running, by gap length (`GAP_BUCKETS`)."""
    out = dict.fromkeys((gap for gap, _ in GAP_BUCKETS), 0.0)
    edges = [start, *(t for interval in busy for t in interval), end]
    for gap_start, gap_end in zip(edges[::2], edges[1::2], strict=True):
        gap = gap_end - gap_start
        if gap > 0:
            name = next(name for name, limit in GAP_BUCKETS if gap < limit)
            out[name] += gap / 1e6
    return out


def _outermost(events: list[dict]) -> list[dict]:
    """The events not inside an earlier one of the same thread (nested ranges count once)."""
    kept: list[dict] = []
    ends: dict[Any, float] = {}
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        thread = (event.get("pid"), event.get("tid"))
        if event["ts"] < ends.get(thread, float("-inf")):
            continue
        kept.append(event)
        ends[thread] = event["ts"] + event["dur"]
    return kept


def summarise_trace(trace: dict) -> dict[str, Any]:
    """The module docstring's summary of a Chrome trace (`torch.profiler`'s export)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    for event in events:
        event["ts"], event["dur"] = float(event["ts"]), float(event["dur"])
    calls = [
        e
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(CALL_PREFIX)
    ]
    # a decorated method calling another (a hybrid worker's `sample` calling its sampler's) is one call
    calls = sorted(_outermost(calls), key=lambda e: e["ts"])
    work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    device = "cuda" if work else "cpu"
    if work:
        kinds = {
            id(e): "memory" if e["cat"] != "kernel" else kernel_kind(e["name"], _GPU_KINDS) for e in work
        }
    else:
        work = _outermost(
            [e for e in events if e.get("cat") == "cpu_op" and not str(e["name"]).startswith(_CPU_WRAPPERS)]
        )
        kinds = {id(e): kernel_kind(e["name"], _CPU_KINDS) for e in work}
    starts = [c["ts"] for c in calls]
    owned: list[list[dict]] = [[] for _ in calls]
    unattributed = 0.0
    for event in work:
        index = _last_at_or_before(starts, event["ts"])
        if index is None:
            unattributed += event["dur"] / 1e6
        else:
            owned[index].append(event)
    summary: dict[str, dict[str, Any]] = {}
    for call, mine in zip(calls, owned, strict=True):
        name = call["name"][len(CALL_PREFIX) :]
        entry = summary.setdefault(
            name,
            {
                "calls": 0,
                "wall_s": 0.0,
                "busy_s": 0.0,
                "idle_s": dict.fromkeys((gap for gap, _ in GAP_BUCKETS), 0.0),
                "kinds_s": dict.fromkeys(KINDS, 0.0),
                "_top": {},
            },
        )
        end = max([call["ts"] + call["dur"], *(e["ts"] + e["dur"] for e in mine)])
        busy = _merged((e["ts"], e["ts"] + e["dur"]) for e in mine)
        entry["calls"] += 1
        entry["wall_s"] += (end - call["ts"]) / 1e6
        entry["busy_s"] += sum(stop - start for start, stop in busy) / 1e6
        for gap, seconds in _idle_gaps(busy, call["ts"], end).items():
            entry["idle_s"][gap] += seconds
        for event in mine:
            entry["kinds_s"][kinds[id(event)]] += event["dur"] / 1e6
            top = entry["_top"].setdefault(event["name"][:_NAME_CHARS], [0.0, 0])
            top[0] += event["dur"] / 1e6
            top[1] += 1
    for entry in summary.values():
        top = sorted(entry.pop("_top").items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
        entry["top"] = [{"name": name, "s": round(s, 6), "count": count} for name, (s, count) in top]
        entry["busy_fraction"] = round(entry["busy_s"] / entry["wall_s"], 4) if entry["wall_s"] > 0 else None
        entry["wall_s"], entry["busy_s"] = round(entry["wall_s"], 6), round(entry["busy_s"], 6)
        entry["kinds_s"] = {kind: round(s, 6) for kind, s in entry["kinds_s"].items()}
        entry["idle_s"] = {name: round(s, 6) for name, s in entry["idle_s"].items()}
    return {"device": device, "calls": summary, "unattributed_s": round(unattributed, 6)}


def _last_at_or_before(starts: Sequence[float], ts: float) -> int | None:
    index = bisect.bisect_right(starts, ts) - 1
    return index if index >= 0 else None


def format_summary(summary: dict[str, Any]) -> list[str]:
    """One console line per call: wall time, busy share, and the kinds' shares of the busy time."""
    lines = []
    for name, entry in sorted(summary["calls"].items(), key=lambda item: -item[1]["wall_s"]):
        work = sum(entry["kinds_s"].values())
        shares = ", ".join(
            f"{kind} {entry['kinds_s'][kind] / work:.0%}"
            for kind in KINDS
            if work and entry["kinds_s"][kind] > 0
        )
        busy = f"{entry['busy_fraction']:.0%} busy" if entry["busy_fraction"] is not None else "-"
        idle = entry["idle_s"]
        gaps = f"idle {idle['under_50us']:.3f} / {idle['50us_to_1ms']:.3f} / {idle['over_1ms']:.3f} s in gaps <50us / <1ms / longer"
        lines.append(
            f"  {name}: {entry['calls']} call(s), {entry['wall_s']:.3f} s, {busy} ({shares or 'no work'}); {gaps}"
        )
    return lines


class StepProfiler:
    """torch.profiler around one step in this process (CPU operators, and CUDA kernels on a GPU)."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError("this worker is already profiling a step: stop_profile first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities)
        profile.start()
        self._profile = profile

    def stop(self, out_dir: str | os.PathLike, name: str) -> dict[str, Any]:
        """Stop; write `out_dir/<name>.trace.json.gz`; return its summary (`summarise_trace`)."""
        if self._profile is None:
            raise RuntimeError("this worker is not profiling: start_profile first")
        profile, self._profile = self._profile, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profile.stop()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        raw = out / f".{name}.trace.json"
        profile.export_chrome_trace(str(raw))
        try:
            with raw.open() as f:
                summary = summarise_trace(json.load(f))
            partial = out / f".{name}.trace.json.gz.partial"
            with raw.open("rb") as src, gzip.open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, out / f"{name}.trace.json.gz")
        finally:
            raw.unlink(missing_ok=True)
        return {**summary, "trace": f"{name}.trace.json.gz"}


class ProfiledWorker:
    """The worker verbs `start_profile` / `stop_profile` (one `StepProfiler` per worker)."""

    _step_profiler: StepProfiler | None = None

    def start_profile(self) -> None:
        if self._step_profiler is None:
            self._step_profiler = StepProfiler()
        self._step_profiler.start()

    def stop_profile(self, name: str, *, out_dir: str) -> dict[str, Any]:
        if self._step_profiler is None:
            raise RuntimeError("this worker is not profiling: start_profile first")
        return self._step_profiler.stop(out_dir, name)


__all__ = [
    "CALL_PREFIX",
    "KINDS",
    "ProfiledWorker",
    "StepProfiler",
    "format_summary",
    "kernel_kind",
    "profiled_call",
    "summarise_trace",
]
