"""Admission to the one decoder of `taps serve`: a bounded queue, fair between clients, that a
shutdown can empty (all calls on the event loop's thread).

Fair: clients are told apart by their address. When the queue is full, a request from a client
holding at least two requests fewer than another takes that client's newest waiting place (that
request is answered 429 with Retry-After, as if it had come last), and the decoder goes next to the
waiting client it served least recently. So a client that honours Retry-After finds room when it
comes back, instead of losing every freed place to clients that retry at once.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from taps.serve.protocol import RequestError


@dataclass(eq=False)
class _Waiter:
    client: str
    future: asyncio.Future
    granted: bool = False


@dataclass
class Scheduler:
    """The decoder's lock and its bounded, fair queue (see the module's docstring); `jobs`: the
    running decodes (objects with `cut` and `cancel`, a threading.Event), which cut() stops."""

    max_queue: int
    running: int = 0
    closing: bool = False  # shutdown began: new requests get 503
    jobs: set = field(default_factory=set)  # the running Jobs
    _queue: list = field(default_factory=list)  # _Waiter, in arrival order
    _running_client: str | None = None  # one decode at a time
    _served: dict = field(default_factory=dict)  # client -> tick of its last start
    _tick: int = 0
    _durations: deque = field(default_factory=lambda: deque(maxlen=20))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def retry_after(self) -> str:
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return str(max(1, math.ceil(mean * (self.waiting + 1))))

    def busy(self) -> RequestError:
        return RequestError(f"the server is busy: one request decodes at a time and {self.waiting} are waiting "
                            f"(the limit is {self.max_queue}); retry later", status=429, kind="rate_limit_error",
                            code="queue_full", headers={"Retry-After": self.retry_after()})

    def shutting_down(self, message: str = "the server is shutting down") -> RequestError:
        return RequestError(message, status=503, kind="server_error", code="shutting_down",
                            headers={"Retry-After": self.retry_after()})

    def _held(self, client: str) -> int:
        return (self._running_client == client) + sum(w.client == client for w in self._queue)

    async def acquire(self, client: str = "?") -> None:
        if self.closing:
            raise self.shutting_down()
        if self.running + self.waiting > self.max_queue:
            crowded = max((w.client for w in self._queue), key=self._held, default=None)
            if crowded is None or self._held(crowded) < self._held(client) + 2:
                raise self.busy()
            evicted = next(w for w in reversed(self._queue) if w.client == crowded)
            self._queue.remove(evicted)
            evicted.future.set_exception(self.busy())
        waiter = _Waiter(client, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._next()
        try:
            await waiter.future
        except asyncio.CancelledError:  # the request's task was cancelled while it waited
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif waiter.granted:
                self.release(0.0)
            raise

    def _next(self) -> None:
        """Start the waiting client served least recently, if the decoder is free."""
        if self.running or not self._queue:
            return
        waiter = min(self._queue, key=lambda w: self._served.get(w.client, -1))  # FIFO among equals
        self._queue.remove(waiter)
        self.running += 1
        self._running_client = waiter.client
        self._tick += 1
        self._served[waiter.client] = self._tick
        if len(self._served) > 4 * (self.max_queue + 1) + 64:  # bounded: forget clients not here now
            here = {w.client for w in self._queue} | {self._running_client}
            self._served = {c: t for c, t in self._served.items() if c in here}
        waiter.granted = True
        waiter.future.set_result(None)

    def release(self, seconds: float) -> None:
        self._durations.append(seconds)
        self.running -= 1
        self._running_client = None
        self._next()

    def cut(self) -> int:
        """Shutdown's deadline: cut every running decode (at its next step) and refuse every waiting
        request with 503; returns how many decodes were cut."""
        self.closing = True
        for waiter in self._queue:
            waiter.future.set_exception(self.shutting_down("the server shut down before this request's turn came; "
                                                           "retry"))
        self._queue.clear()
        for job in list(self.jobs):
            job.cut = True
            job.cancel.set()
        return len(self.jobs)
