"""Hot swaps of adapted heads: `taps serve --drafter NAME=DIR --learn ROOT` serves the newest good
version in ROOT/heads/NAME/vN/ (N = 1, 2, ...; the --drafter directory itself is version 0).

Why between requests: one request decodes at a time, and the swap is applied by the decode thread
just before a request's proposer is built (HeadSwapper.apply), so a request drafts with one version
from its first step to its last, and no request waits for a checkpoint to load: a watcher thread
loads and checks a new version beforehand (HeadSwapper.scan, every `poll_s` seconds).

Refused, with one log line, and never tried again by this server: a version that does not load
for this target (a corrupt or missing file, another target's head: drafter/checkpoint.load_head's
checks) or of another kind than the served head (EAGLE-2 vs EAGLE-3). The served version goes on.

Rollback, by a trial on the same traffic: a version picked up while the server runs does not
replace its predecessor outright. For its first 2 x `check_after` requests the two are served
alternately, request by request (the new one first), so both see the same stretch of the stream;
a comparison with the requests served *before* the swap would be decided by how the stream's
difficulty drifts (issue 31's first runs rolled back a version for exactly that). When each has
served `check_after` requests, the one with the lower mean live acceptance length (generated
tokens / verifier calls, per request of a variant that has the head as a member) loses: the new
version stays, or the server goes back to the old one for good, logs one line and writes
`rolled_back.json` into the new version's directory, so no server picks it up again (delete the
file to allow it again). A newer version staged during a trial takes the trial's place, against
the same predecessor. A version served from startup has nothing to be compared with. Only the
drafted tokens change: verification is the target's, so answers do not.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from taps.drafter.checkpoint import load_head
from taps.core.jsonl import write_json_atomic

HEADS_DIR = "heads"
ROLLED_BACK = "rolled_back.json"
_VERSION = re.compile(r"v(\d+)")
LOG = logging.getLogger("taps.serve")


def head_versions(root: str | Path, name: str) -> list[tuple[int, Path]]:
    """(N, ROOT/heads/NAME/vN) of every version directory, oldest first (rolled-back ones included)."""
    folder = Path(root) / HEADS_DIR / name
    found = [(int(m.group(1)), p) for p in folder.glob("v*") if (m := _VERSION.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


@dataclass
class VersionStats:
    window: int
    requests: int = 0
    tokens: int = 0
    verifier_calls: int = 0
    seconds: float = 0.0
    recent: deque = field(default_factory=deque)  # acceptance lengths of the last `window` requests

    def add(self, tokens: int, calls: int, seconds: float) -> None:
        self.requests += 1
        self.tokens, self.verifier_calls, self.seconds = self.tokens + tokens, self.verifier_calls + calls, \
            self.seconds + seconds
        self.recent.append(tokens / calls if calls else 0.0)
        while len(self.recent) > self.window:
            self.recent.popleft()

    @property
    def recent_mean(self) -> float:
        return sum(self.recent) / len(self.recent)


@dataclass
class Trial:
    """A new version and the one it replaces, served alternately until each has `window` requests."""

    new: tuple[int, object]  # (version number, head)
    old: tuple[int, object]
    new_stats: VersionStats
    old_stats: VersionStats

    def next(self) -> tuple[int, object]:
        """The version for the next request: the one that has served fewer (the new one on ties)."""
        return self.new if self.new_stats.requests <= self.old_stats.requests else self.old

    def stats_of(self, number: int) -> VersionStats | None:
        return {self.new[0]: self.new_stats, self.old[0]: self.old_stats}.get(number)

    @property
    def done(self) -> bool:
        return min(self.new_stats.requests, self.old_stats.requests) >= self.new_stats.window


class HeadSwapper:
    """The versions of each served head: what is served, what is staged, refused, and how each did."""

    def __init__(self, root: str | Path, engine, check_after: int = 20, poll_s: float | None = 2.0):
        if check_after < 1:
            raise ValueError(f"--learn-check-after must be >= 1, got {check_after}")
        self.root, self.engine, self.check_after = Path(root), engine, check_after
        self.served = {name: 0 for name in engine.drafters}
        self.heads = {name: engine.pool.head(path) for name, path in engine.drafters.items()}
        self.trials: dict[str, Trial] = {}  # head -> its new version's trial against the one it replaces
        self.refused: set[tuple[str, int]] = set()
        self.staged: dict[str, tuple[int, object]] = {}
        self.stats: dict[tuple[str, int], VersionStats] = {}
        self.events: dict[tuple[str, str], int] = {}  # (head, swap | rollback | refused) -> count
        self.lock = threading.Lock()
        self.scan()
        self.apply(trial=False)  # the newest good version from startup: nothing to compare it with
        self._stop = threading.Event()
        self.thread = None
        if poll_s is not None:
            self.thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="taps-swap")
            self.thread.start()

    def close(self) -> None:
        self._stop.set()

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.scan()
            except Exception:  # the served versions go on
                LOG.exception("taps serve --learn: looking for new head versions failed")

    def _count(self, name: str, event: str) -> None:
        self.events[(name, event)] = self.events.get((name, event), 0) + 1

    # ---- the watcher thread: load and check the newest version ---------------------------------
    def scan(self) -> None:
        for name, path in self.engine.drafters.items():
            with self.lock:
                known = max(self.served[name], self.staged.get(name, (0, None))[0])
            fresh = [(n, p) for n, p in head_versions(self.root, name)
                     if n > known and (name, n) not in self.refused and not (p / ROLLED_BACK).exists()]
            if not fresh:
                continue
            number, folder = fresh[-1]
            try:
                head = load_head(folder, self.engine.target, attn_implementation=self.engine.pool.attn)
                if type(head) is not type(self.heads[name]):
                    raise ValueError(f"a {type(head).__name__}, the served head is a {type(self.heads[name]).__name__}")
            except Exception as err:  # corrupt, another target's, another kind: refused, once
                with self.lock:
                    self.refused.add((name, number))
                    self._count(name, "refused")
                LOG.warning(f"taps serve --learn: refusing {folder} ({' '.join(str(err).split())}); still serving "
                            f"{name} v{self.served[name]}")
                continue
            with self.lock:
                self.staged[name] = (number, head)

    # ---- the decode thread, between requests ---------------------------------------------------
    def apply(self, trial: bool = True) -> dict[str, int]:
        """Serve the staged versions from the next proposer on (each on trial against the version it
        replaces), and pick each trial's version for this request; returns the versions this
        request drafts with."""
        with self.lock:
            for name, (number, head) in self.staged.items():
                old = self.trials.pop(name).old if name in self.trials else (self.served[name], self.heads[name])
                if trial:
                    self.trials[name] = Trial((number, head), old, VersionStats(self.check_after),
                                              VersionStats(self.check_after))
                self.served[name] = number  # the version /metrics reports: the one on trial
                self._count(name, "swap")
                LOG.info(f"taps serve --learn: serving {name} v{number}"
                         + (f" on trial, alternately with v{old[0]}" if trial else f" (was v{old[0]})"))
                if not trial:
                    self._use(name, head)
            self.staged.clear()
            versions = dict(self.served)
            for name, running in self.trials.items():
                number, head = running.next()
                self._use(name, head)
                versions[name] = number
            return versions

    def _use(self, name: str, head) -> None:
        if self.heads[name] is not head:
            self.engine.pool.replace(self.engine.drafters[name], head)
            self.heads[name] = head

    def finished(self, versions: dict[str, int], members, tokens: int, calls: int, seconds: float) -> None:
        """A request decoded with `versions`, by a variant of these members: its figures, then the
        trial's verdict once both versions have served their requests (module docstring)."""
        with self.lock:
            for name in members:
                if name not in versions:
                    continue
                number = versions[name]
                self.stats.setdefault((name, number), VersionStats(self.check_after)).add(tokens, calls, seconds)
                running = self.trials.get(name)
                stats = running.stats_of(number) if running is not None else None
                if stats is not None:
                    stats.add(tokens, calls, seconds)
                    if running.done:
                        self._judge(name, self.trials.pop(name))

    def _judge(self, name: str, trial: Trial) -> None:
        (number, head), (before, old_head) = trial.new, trial.old
        new_mean, old_mean = trial.new_stats.recent_mean, trial.old_stats.recent_mean
        if new_mean >= old_mean:
            self._use(name, head)
            LOG.info(f"taps serve --learn: keeping {name} v{number}: acceptance length {new_mean:.3f} against "
                     f"v{before}'s {old_mean:.3f} over {trial.new_stats.requests} requests each, alternately")
            return
        folder = self.root / HEADS_DIR / name / f"v{number}"
        self._use(name, old_head)
        self.served[name] = before
        self.refused.add((name, number))
        self._count(name, "rollback")
        try:
            write_json_atomic(folder / ROLLED_BACK, {"time": round(time.time(), 3), "acceptance_length": round(
                new_mean, 4), "previous": f"v{before}", "previous_acceptance_length": round(old_mean, 4),
                "requests": trial.new_stats.requests, "previous_requests": trial.old_stats.requests})
        except OSError:
            pass  # this server never serves it again anyway
        LOG.warning(f"taps serve --learn: rolled {name} back to v{before}: v{number}'s acceptance length was "
                    f"{new_mean:.3f} against v{before}'s {old_mean:.3f}, over {trial.new_stats.requests} requests "
                    "each, served alternately")

    # ---- /metrics ------------------------------------------------------------------------------
    def rows(self) -> list[tuple[str, dict, float]]:
        """(metric family, labels, value) for Metrics.render."""
        with self.lock:
            out = [("head_version", {"head": name}, float(n)) for name, n in self.served.items()]
            for (name, number), s in sorted(self.stats.items()):
                labels = {"head": name, "version": f"v{number}"}
                out.append(("version_requests", labels, float(s.requests)))
                if s.verifier_calls:
                    out.append(("version_acceptance_length", labels, s.tokens / s.verifier_calls))
                if s.seconds > 0:
                    out.append(("version_tokens_per_second", labels, s.tokens / s.seconds))
            out += [("head_version_events", {"head": name, "event": event}, float(count))
                    for (name, event), count in sorted(self.events.items())]
            return out
