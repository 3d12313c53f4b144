"""What Triton's compiler prints while a search compiles its candidates: kept off the terminal, in a log file.

Triton's C++ side writes straight to file descriptors 1 and 2 (an MLIR pass that fails prints
"... reproducer generated" and dumps its IR there), past any redirection of sys.stdout and
sys.stderr: `captured` points the two descriptors at a temporary file around a compile. A
candidate that fails leaves one line on the terminal, naming the search's log; what every
candidate's compile printed goes to that log ($FATUNE_LOG_DIR, default ~/.cache/fatune/logs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Iterator

from fatune.settings import user_path

LOG_ENV = "FATUNE_LOG_DIR"
# descriptors are the whole process's: one capture at a time, whichever thread compiles
_capture_lock = threading.RLock()
_path: Path | None = None  # this process's search log (start)


class Captured:
    """The text written to fds 1 and 2 inside a `captured` block, once the block has ended."""

    text: str = ""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _flush() -> None:
    """Push what Python's and C's stdio buffers hold to the descriptors they write to now."""
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s}.values():
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # no C library to ask (e.g. Windows): its buffers stay
        _libc().fflush(None)


@contextlib.contextmanager
def captured() -> Iterator[Captured]:
    """Point fds 1 and 2 of this process at a temporary file for the block, and restore them however it
    ends; the yielded Captured holds what was written there once the block is over (an exception included)."""
    result = Captured()
    with _capture_lock, tempfile.TemporaryFile() as sink:
        _flush()
        saved: list[tuple[int, int]] = []
        try:
            for fd in (1, 2):
                with contextlib.suppress(OSError):  # a closed descriptor has nothing to keep off the terminal
                    saved.append((fd, os.dup(fd)))
            for fd, _ in saved:
                os.dup2(sink.fileno(), fd)
            yield result
        finally:
            _flush()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            result.text = sink.read().decode("utf-8", "replace")


def error_line(error: BaseException) -> str:
    """An error as one short line: its type and the first line of its message (200 characters at most)."""
    message = str(error)
    return f"{type(error).__name__}: {message.splitlines()[0][:200] if message.strip() else ''}".rstrip()


def details(error: BaseException) -> str:
    """An error's full traceback, for the log."""
    return "".join(traceback.format_exception(error))


def log_dir() -> Path:
    """Where searches keep their logs: $FATUNE_LOG_DIR, else ~/.cache/fatune/logs."""

    try:
        return user_path(LOG_ENV, "logs")
    except RuntimeError:  # '~user' of no user: the temporary folder write() falls back to anyway
        return _fallback_dir()


def _fallback_dir() -> Path:
    """Where logs go when their folder cannot be made or written."""
    return Path(tempfile.gettempdir()) / "fatune-logs"


def start(path: str | Path | None = None) -> Path:
    """Make `path` (default: a new search-<time>-<pid>.log in log_dir()) this process's search log; written
    only when there is something to keep. A search's helper processes are given its path: one log per search."""
    global _path
    _path = Path(path) if path else log_dir() / f"search-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    return _path


def path() -> Path:
    """This process's search log (started on first use)."""
    return _path or start()


def write(title: str, text: str) -> Path | None:
    """Append `text` under a `title` line to the search log, in one write (other processes of the search
    append to it too); the log's path, or None when the text is empty or no log could be written."""
    if not text.strip():
        return None
    record = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {socket.gethostname()}:{os.getpid()} {title}\n" \
             f"{text.rstrip()}\n\n".encode("utf-8", "replace")
    global _path
    for attempt in (path(), _fallback_dir() / path().name):
        try:
            attempt.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(attempt, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, record)
            finally:
                os.close(fd)
            _path = attempt  # where the unwritable one fell back to, for the rest of the search
            return attempt
        except OSError:
            continue
    return None


def failed(what: str, error: str, text: str) -> str:
    """A candidate that failed to compile or launch: everything about it (`text`) to the log, and one line
    on the terminal (`what` failed, the first line of `error`, the log's path); that line."""
    where = write(f"{what}: {error}", text)
    line = f"fatune search: {what} failed: {error.splitlines()[0] if error else 'unknown error'}"
    line += f" (compiler output in {where})" if where else ""
    stream = sys.stderr
    erase = "\r\x1b[K" if getattr(stream, "isatty", lambda: False)() else ""  # a progress bar's line
    print(erase + line, file=stream, flush=True)
    return line


@contextlib.contextmanager
def logged(what: str) -> Iterator[None]:
    """Run a block that may compile (a candidate's first launch) with its output captured: written to the
    log when there is any; when the block raises, `failed` reports it (one line) and the error goes on."""
    with captured() as output:
        try:
            yield
        except Exception as error:
            caught = error
        else:
            caught = None
    if caught is not None:
        failed(what, error_line(caught), output.text + details(caught))
        raise caught
    write(what, output.text)
