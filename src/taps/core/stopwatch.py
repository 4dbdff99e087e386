"""Wall-clock timing of work that may run on a GPU: every reading waits for the device first."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def now(device: torch.device) -> float:
    """time.perf_counter() once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Laps on one device's clock. Work run through `aside` (read-only diagnostics) counts in no
    lap and not in `elapsed()`; its total is `aside_s`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.aside_s = 0.0
        self._start = self._mark = now(device)
        self._aside_in_lap = 0.0

    def lap(self) -> float:
        """Seconds since the previous lap (or the start), less the time set aside in between."""
        t = now(self.device)
        seconds = t - self._mark - self._aside_in_lap
        self._mark, self._aside_in_lap = t, 0.0
        return seconds

    def aside(self, fn: Callable[..., T], *args) -> T:
        """fn(*args), its time set aside."""
        t = now(self.device)
        result = fn(*args)
        seconds = now(self.device) - t
        self.aside_s += seconds
        self._aside_in_lap += seconds
        return result

    def elapsed(self) -> float:
        """Seconds since the start, less the time set aside."""
        return now(self.device) - self._start - self.aside_s
