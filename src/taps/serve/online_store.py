"""DIR/store/ of `taps serve --learn DIR`: a retrieval datastore (propose/rest.py) of the
answers the server has returned, which the `lookup` member drafts from while it grows.

Why snapshots: a request's lookup drafter holds the Datastore it started with; every update builds
a new, complete Datastore (tokens and index) off the decode thread and only then publishes it (one
reference assignment), so a request never sees a half-written index and a running one keeps its
own. Drafting from it changes what is proposed, never what is emitted: verification is the
target's (docs/spec.md §3).

Bounded: at most `max_tokens` corpus tokens; the oldest answers go first. Persisted: DIR/store/
is an ordinary datastore directory (`lookup+DIR/store` reads it in `taps generate` and `taps
eval`), written at most every `persist_every_s` seconds and when the server stops; each file is
replaced by a rename. A store that cannot be read at startup (a crash between its two files, a
store of another target) is rebuilt from DIR/log/ with one log line.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import numpy as np

from taps.propose.rest import SEP, Datastore, DatastoreError, is_datastore, write_datastore
from taps.propose.factory import load_datastore

STORE_DIR = "store"
LOG = logging.getLogger("taps.serve")


def answer_segment(prompt: list[int], answer: list[int], special: set[int]) -> list[int]:
    """The corpus segment of one answer: its role header (the prompt's tokens after its last special
    token: ChatML's `assistant\\n`, as `taps lookup build` stores it) and the answer's tokens."""
    head = len(prompt)
    while head > 0 and prompt[head - 1] not in special:
        head -= 1
    return [*prompt[head:], *answer] if head > 0 else list(answer)


def split_segments(tokens: np.ndarray) -> list[list[int]]:
    """The segments of a corpus array (SEP-separated), in order."""
    cuts = np.flatnonzero(tokens == SEP)
    return [tokens[a + 1:b].tolist() for a, b in zip(cuts[:-1], cuts[1:]) if b > a + 1]


class OnlineStore:
    """The growing datastore: segments in arrival order, the published snapshot, its persistence."""

    def __init__(self, root: str | Path, target, max_tokens: int = 2_000_000, persist_every_s: float = 30.0,
                 meta: dict | None = None):
        if max_tokens < 1:
            raise ValueError(f"--learn-store-tokens must be >= 1, got {max_tokens}")
        self.path = Path(root) / STORE_DIR
        self.target, self.max_tokens, self.persist_every_s = target, max_tokens, persist_every_s
        self.meta = meta or {}
        self.segments: deque[list[int]] = deque()
        self.tokens = 0
        self.dirty, self.persisted_at = False, time.monotonic()
        self.snapshot = Datastore.of_segments([])

    def load(self, fallback_segments=()) -> str:
        """Read DIR/store/ (or, when it is missing or unreadable, take `fallback_segments`: the
        log's answers, oldest first). Returns where the segments came from."""
        source = "empty"
        if is_datastore(self.path):
            try:
                for segment in split_segments(np.asarray(load_datastore(self.path, self.target).tokens)):
                    self._push(segment)
                source = str(self.path)
            except (DatastoreError, OSError, ValueError) as err:
                LOG.warning(f"taps serve --learn: {self.path} cannot be read ({err}); rebuilding it from the log")
        if source == "empty":
            for segment in fallback_segments:
                self._push(segment)
            if self.segments:
                source, self.dirty = "the log", True
        self.publish()
        return source

    def _push(self, segment: list[int]) -> None:
        if not segment:
            return
        self.segments.append(segment)
        self.tokens += len(segment)
        while self.tokens > self.max_tokens and len(self.segments) > 1:
            self.tokens -= len(self.segments.popleft())
        if self.tokens > self.max_tokens:  # one answer longer than the whole bound: keep its end
            only = self.segments.pop()[-self.max_tokens:]
            self.segments.append(only)
            self.tokens = len(only)

    def add(self, segments: list[list[int]]) -> None:
        """New answers' segments; publish() makes them visible."""
        for segment in segments:
            self._push(segment)
        self.dirty = self.dirty or bool(segments)

    def publish(self) -> Datastore:
        """Build the new snapshot completely, then hand it out (module docstring)."""
        self.snapshot = Datastore.of_segments(list(self.segments))
        return self.snapshot

    def persist(self, force: bool = False) -> bool:
        """Write DIR/store/ if it changed and (unless forced) `persist_every_s` has passed."""
        if not self.dirty or (not force and time.monotonic() - self.persisted_at < self.persist_every_s):
            return False
        write_datastore(self.path, list(self.segments), {**self.meta, "source": "taps serve --learn"})
        self.dirty, self.persisted_at = False, time.monotonic()
        return True
