"""Small file helpers shared by the loops and the CLI.

Reading a file the user names goes through `open_regular` (or `read_json_file`): a FIFO, a socket
or a device (`/dev/zero`, `/dev/stdin`) in place of a file would block forever or never end, so
anything but a regular file is a ValueError naming the path and what it is, raised at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, what: str) -> BinaryIO:
    """`path` opened for reading in binary mode, if it is a regular file (a symlink to one is fine).

    Opened with O_NONBLOCK, so a FIFO does not wait for a writer, then checked with fstat (the
    file opened is the file checked): anything else raises ValueError naming `what` (e.g.
    "data.train_files"), the path and what it is. A missing file is a FileNotFoundError.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what}: {path} is a directory, not a file: give a file") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(
                f"{what}: {path} is {_kind(mode)}, not a regular file: diffrl reads files whole and would "
                "wait forever on it; give a regular file (copy the data into one)"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | os.PathLike, what: str) -> Path:
    """Raise as `open_regular` does unless `path` is a regular file; returns it (for readers that
    take a path, such as safetensors)."""
    open_regular(path, what).close()
    return Path(path)


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Raise ValueError naming `what`, the path and the fix unless a folder can be made (or is) at
    `path` and written in: checked before any work, so a run or an export does not fail at its
    end, minutes later, on a read-only file system, a regular file in the way or a folder of
    another user. The nearest existing folder on the way (`path` itself when it exists) must be a
    folder, and a file is made and removed in it (permissions and read-only mounts alike, for root
    too). Returns `path`."""
    path = Path(path)
    named = f"{what} {str(path)!r}" if what.startswith("--") else f"{what}={str(path)!r}"
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == path else f"lies under {probe}, which is a file"
        raise ValueError(f"{named} {where}, not a folder: give a folder path (new or existing)")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".diffrl-write-check-"):
            pass
    except OSError as err:
        raise ValueError(
            f"{named} cannot be written: making a file in {probe} failed ({err.strerror}): "
            "give a folder on a writable file system that you may write to"
        ) from None
    return path


def read_json_file(path: str | os.PathLike, what: str, fix: str) -> Any:
    """The parsed JSON of the regular file `path`; a file that does not parse is a ValueError naming
    the file, what it is (`what`), the parser's message with its line and column, and `fix`."""
    with open_regular(path, what) as file:
        data = file.read()
    try:
        return json.loads(data)
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text ({err.reason}): {fix}") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{what} {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}: {fix}"
        ) from None


# Rust writers (safetensors, which diffusers' save_pretrained uses) report an OS error in their own
# exception type, its errno only in the text: "I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_errno(error: BaseException) -> int | None:
    """The OS error number `error` reports: an OSError's errno, or the one in the text of a Rust
    writer's error (safetensors); None for anything else."""
    if isinstance(error, OSError):
        return error.errno
    match = _RUST_OS_ERROR.search(str(error))
    return None if match is None else int(match.group(1))


def named_os_error(error: BaseException, path: Path | str) -> OSError | None:
    """`error` as an OSError naming `path`, when it is an OS error that names no file, else None.

    Writes, flushes and fsyncs on an open file (a full disk, say) raise an OSError without a file
    name, and so do the writers of torch.distributed.checkpoint and Pillow; safetensors raises its
    own error type. The OSError returned keeps the errno, so the CLI still recognises a full disk.
    """
    code = os_errno(error)
    if code is None or getattr(error, "filename", None) is not None:
        return None
    return OSError(code, os.strerror(code), str(path))


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """An OS error raised inside that names no file (`named_os_error`) is raised again as an
    OSError naming `path`, from the original, so the message can say where."""
    try:
        yield
    except Exception as err:
        named = named_os_error(err, path)
        if named is None:
            raise
        raise named from err


def _fsync_path(path: Path) -> None:
    """Flush `path` (a file, or a folder's entries: a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write (with any writer: Pillow, json, ...);
    when the block ends it is flushed to the disk and renamed over `path`, and the rename made
    durable, so a crash or a power loss leaves the old file or the new one, never half of one.
    When the block (or the flush) fails, the temporary file is removed and an OS error naming no
    file is raised again naming `path` (`naming`). The temporary name ends with `path`'s suffix,
    for writers that choose the format by it (Pillow)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        with naming(path):
            yield tmp
            _fsync_path(tmp)
            os.replace(tmp, path)
            _fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` atomically (`atomic_file`): the old file or the new one, never half or an empty one."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def umask_mode(path: Path) -> None:
    """Give `path` the mode a plain `open(path, "w")` would (0666 less the umask): some writers
    (safetensors through a temporary file) leave 0600, unreadable to the user's other accounts."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_json(path: Path, payload: dict) -> None:
    """`payload` as indented JSON, written atomically (`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(payload, indent=2))
