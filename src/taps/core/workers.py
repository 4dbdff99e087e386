"""Worker processes on this machine, for `--jobs N`: fresh interpreters (spawned, so no forked
torch thread pools), each with its share of the cores. Work is either split by rank (taps eval:
every N-th question) or handed out one item at a time from a shared counter (head families, the
drafter table: the next head or drafter to whichever process is free)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

SPAWN = multiprocessing.get_context("spawn")


def cores_each(jobs: int) -> int:
    """Threads for each of `jobs` processes: an equal share of this machine's cores, at least one."""
    return max(1, (os.cpu_count() or 1) // jobs)


def start(worker: Callable[..., None], args: Iterable[tuple]) -> list:
    """One started process running worker(*a) for each argument tuple `a`; each dies with this
    process (die_with_parent), so no orphan writes on after its parent and the parent's output
    lock are gone."""
    procs = [SPAWN.Process(target=_child, args=(os.getpid(), worker, *a)) for a in args]
    for proc in procs:
        proc.start()
    return procs


def _child(parent: int, worker: Callable[..., None], *args) -> None:
    die_with_parent(parent)
    worker(*args)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread ends


def die_with_parent(parent: int) -> None:
    """End this process when `parent` ends, however it ends (kill -9 included): on Linux the
    kernel sends SIGKILL (prctl PR_SET_PDEATHSIG; it watches the thread that started the worker,
    so start workers from a thread that waits for them, as join does); elsewhere a thread watches
    the parent id. A parent already gone by now ends it at once."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def join(procs: Sequence) -> list[int]:
    """Waits for every process; the indices of those that failed (a non-zero exit code)."""
    for proc in procs:
        proc.join()
    return [i for i, proc in enumerate(procs) if proc.exitcode != 0]


def counter():
    """A counter shared by the processes (pass it in their arguments): how much of a queue is taken."""
    return SPAWN.Value("i", 0)


def untaken(order: Sequence[Any], taken) -> Iterator[Any]:
    """The items of `order` this process takes, one at a time, from `taken` (a counter()): worker
    processes split a queue without fixed shares."""
    while True:
        with taken.get_lock():
            i = taken.value
            taken.value += 1
        if i >= len(order):
            return
        yield order[i]
