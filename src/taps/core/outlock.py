"""One writer per output directory: an exclusive `flock` on DIR/.taps.lock, held while a command
writes there. The kernel drops the lock when its process ends, however it ends (kill -9 included),
so a crashed run never leaves the directory stuck; a second writer is refused, not queued."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".taps.lock"


class OutputBusyError(RuntimeError):
    """Another process is writing the same output directory."""


def acquire(directory: str | Path, what: str = "output") -> int:
    """Create `directory` if needed and lock it; returns the lock's file descriptor (see release)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = (directory / LOCK_NAME).read_text().strip() or "another process"
        raise OutputBusyError(f"{directory}: another taps process ({holder}) is writing this {what} directory; "
                              "wait for it to finish or use another --out") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}\n".encode())
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing the descriptor drops the flock


@contextmanager
def output_lock(directory: str | Path, what: str = "output"):
    fd = acquire(directory, what)
    try:
        yield
    finally:
        release(fd)
