"""Worker processes on this machine, for `--jobs N`: fresh interpreters (spawned, so no forked
torch thread pools), each with its share of the cores. Work is either split by rank (taps eval:
every N-th question) or handed out one item at a time from a shared counter (head families, the
drafter table: the next head or drafter to whichever process is free)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

SPAWN = multiprocessing.get_context("spawn")


def cores_each(jobs: int) -> int:
    """Threads for each of `jobs` processes: an equal share of this machine's cores, at least one."""
    return max(1, (os.cpu_count() or 1) // jobs)


def start(worker: Callable[..., None], args: Iterable[tuple]) -> list:
    """One started process running worker(*a) for each argument tuple `a`."""
    procs = [SPAWN.Process(target=worker, args=a) for a in args]
    for proc in procs:
        proc.start()
    return procs


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
