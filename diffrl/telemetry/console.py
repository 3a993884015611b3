"""What reaches the terminal: third-party chatter off by default, a line for every long phase.

`configure(verbose)` is called once by the `diffrl` command before any heavy import. Quiet (the
default) means: transformers and diffusers log errors only, no library progress bar (model
loading, shard writing), Ray's driver logs errors only. Everything goes through the libraries' own
switches, mostly environment variables (`QUIET_ENV`), because they are read when each library is
imported, in this process and in every worker process: the local Ray cluster inherits this
process's environment, and `ray_init_kwargs()` also hands it to the workers of a cluster that
was started elsewhere (as the job's runtime_env). A value the user already set wins. `--verbose`
leaves every library at its own defaults.

`progress(label, total)` prints nothing for a phase that ends within `delay` seconds; a longer
one gets a line every `every` seconds with the elapsed time (and, when it counts its work with
`update(done)`, `done/total` and an ETA), then one line when it ends. So a one-minute model load
or validation is visibly alive without short phases adding noise.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

#: Environment variables that quiet third-party libraries, in this process and in worker processes.
QUIET_ENV: dict[str, str] = {
    "TRANSFORMERS_VERBOSITY": "error",  # e.g. "`CLIPImageProcessor` requires torchvision"
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DIFFUSERS_VERBOSITY": "error",  # e.g. "No LoRA keys associated to CLIPTextModelWithProjection"
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's and transformers' bars
    "TQDM_DISABLE": "1",  # diffusers' "Loading pipeline components..." (tqdm's own switch)
}

_verbose: bool | None = None  # None: configure() was not called (library use): leave Ray alone


def configure(verbose: bool = False) -> None:
    """Quiet third-party logging and progress bars (module docstring), or leave it all on."""
    global _verbose
    _verbose = verbose
    if verbose:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # The environment is read at import; a library imported earlier (tests, notebooks) is told directly.
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(_level(os.environ["TRANSFORMERS_VERBOSITY"]))
        transformers_logging.disable_progress_bar()
    if "diffusers" in sys.modules:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity(_level(os.environ["DIFFUSERS_VERBOSITY"]))
        diffusers_logging.disable_progress_bar()


def format_duration(seconds: float) -> str:
    """42s, 40m12s, 3h05m, 2d03h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _level(name: str) -> int:
    return getattr(logging, name.upper(), logging.ERROR)


def is_verbose() -> bool:
    return bool(_verbose)


def worker_env() -> dict[str, str]:
    """This process's quieting variables, for worker processes started elsewhere."""
    return {key: os.environ[key] for key in QUIET_ENV if key in os.environ}


def ray_init_kwargs() -> dict[str, Any]:
    """Extra `ray.init` arguments: the workers' environment, and Ray's own log level when quiet
    (it otherwise warns about its token authentication at every start, which needs no action)."""
    if _verbose is None:
        return {}
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": worker_env()}}
    if not _verbose:
        kwargs["logging_level"] = logging.ERROR
    return kwargs


def run_started(run_dir: Path, resumed_from: Path | None = None, stream: TextIO | None = None) -> None:
    """The first line of a run: where everything it writes goes."""
    line = f"run directory: {run_dir}"
    if resumed_from is not None:
        line += f" (resuming from {resumed_from})"
    print(line, file=stream or sys.stdout, flush=True)


class Progress:
    """A long phase's state, printed by `progress` (module docstring); `update` is thread-safe."""

    def __init__(self, label: str, total: int | None, clock: Callable[[], float], unit: str = "done") -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()

    def update(self, done: int) -> None:
        with self._lock:
            self.done = done

    def elapsed(self) -> float:
        return self._clock() - self._start

    def line(self) -> str:
        with self._lock:
            done = self.done
        elapsed = self.elapsed()
        if not self.total:
            return f"{self.label}: {format_duration(elapsed)} elapsed"
        eta = format_duration(elapsed / done * (self.total - done)) if done else "?"
        return f"{self.label}: {done}/{self.total} {self.unit}, {format_duration(elapsed)} elapsed, ETA {eta}"


@contextmanager
def progress(
    label: str,
    total: int | None = None,
    *,
    unit: str = "done",
    delay: float = 5.0,
    every: float = 15.0,
    stream: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Progress]:
    """Heartbeat lines for a phase that outlasts `delay` seconds (module docstring)."""
    state = Progress(label, total, clock, unit)
    stop = threading.Event()
    printed = threading.Event()

    def say(line: str) -> None:
        print(line, file=stream or sys.stdout, flush=True)

    def beat() -> None:
        wait = delay
        while not stop.wait(wait):
            say(state.line())
            printed.set()
            wait = every

    thread = threading.Thread(target=beat, name=f"progress:{label}", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stop.set()
        thread.join(timeout=5.0)
        if printed.is_set():
            say(f"{label}: done in {format_duration(state.elapsed())}")


CONSOLE_LOG = "console.log"


class _Tee:
    """A text stream that writes to `stream` and to the run's console log."""

    def __init__(self, stream: TextIO, log: ConsoleLog) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._log.write(text)
        return written

    def flush(self) -> None:
        self._stream.flush()
        self._log.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the terminal's
        return getattr(self._stream, name)


class ConsoleLog:
    """RUN/console.log. What is printed before the run has started (`begin`) waits in memory: a
    start that fails before it (a full disk, a bad resume) changes nothing of an existing run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._file: TextIO | None = None
        self._closed = False

    def write(self, text: str) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(text)
            elif not self._closed:
                self._pending.append(text)

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    @property
    def started(self) -> bool:
        with self._lock:
            return self._file is not None

    def begin(self) -> None:
        """The run has started: append what was printed so far, and from now on everything."""
        with self._lock:
            if self._file is None and not self._closed:
                self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
                self._file.write("".join(self._pending))
                self._pending = []

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pending = []
            if self._file is not None:
                self._file.close()
                self._file = None


_active: ConsoleLog | None = None


@contextmanager
def console_log(run_dir: Path) -> Iterator[ConsoleLog]:
    """Copy everything this process prints, stdout and stderr (worker output that Ray forwards
    included), to RUN/console.log while the block runs, from the moment the run has started
    (`begin_console_log`: earlier lines are kept until then); a resumed run appends to it."""
    global _active
    log = ConsoleLog(Path(run_dir) / CONSOLE_LOG)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    _active = log
    try:
        yield log
    except Exception as err:
        # the whole story (a worker's remote traceback, its last log lines) goes to the file; the
        # terminal gets one line of it (diffrl.cli.main, `logged_to`)
        if log.started:
            log.write("".join(traceback.format_exception(err)))
            err.logged_to = log.path
        raise
    finally:
        sys.stdout, sys.stderr = saved
        _active = None
        log.close()


def begin_console_log() -> None:
    """The run has started (its config is recorded): RUN/console.log begins (`ConsoleLog.begin`)."""
    if _active is not None:
        _active.begin()


__all__ = [
    "CONSOLE_LOG",
    "QUIET_ENV",
    "Progress",
    "begin_console_log",
    "configure",
    "console_log",
    "is_verbose",
    "progress",
    "ray_init_kwargs",
    "run_started",
    "worker_env",
]
