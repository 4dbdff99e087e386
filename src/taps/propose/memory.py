"""What a server's drafters learn about its traffic, kept from one request to the next.

Every conversation builds fresh proposers (propose/factory.HeadPool), so every request used to
start its estimates from their cold priors: `--tree auto`'s calibration of a head's confidence to
the acceptance it gets (drafter/auto_tree.Calibration), the same for a head's nodes that no lookup
member proposed in a budget merge (`AutoTree.alone`), and a lookup member's running acceptance of
prompt-lookup tokens (q) and of the datastore's promises (r). On a server's traffic these are
properties of the workload, not of one request: a JSON-extraction stream's datastore keeps its
promises, request after request, yet each request's first steps priced its nodes at r = 0.5 and cut
them from the tree until the request had learned r again.

So a server (HeadPool(remember=True)) keeps one `Rate` or `CalibrationMemory` per estimate, per
variant and member (a head's per head object: a new version is a new head and learns afresh), and
each new proposer starts from it:
  - warm, not frozen: the remembered counts join the cold prior scaled down to at most `weight`
    observations, so a request unlike the earlier ones overrides them within a few steps;
  - every observation of the request is added to the remembered counts too, which keep at most
    `memory` observations (older ones fade in proportion), so they follow a workload that drifts
    (a growing online datastore, a new head version beside the old).
Estimates only choose what is drafted and how much of it is verified; verification is unchanged,
so decoding stays lossless. Requests are decoded one at a time (serve/admission.Scheduler), so the
shared counts need no lock.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from taps.propose.head_gate import GateState

WARM_NODES = 16.0  # a calibration bin starts from at most this many remembered nodes (its cold prior: 4)
WARM_TRIALS = 8.0  # a lookup rate starts from at most this many remembered trials (its cold prior: 2)
MEMORY = 1000.0  # remembered observations per bin / per rate; older ones fade in proportion


@dataclass
class Rate:
    """Remembered hits / trials of one running estimate (a lookup member's q or r)."""

    hits: float = 0.0
    trials: float = 0.0
    memory: float = MEMORY

    def add(self, hits: float, trials: float) -> None:
        self.hits += hits
        self.trials += trials
        if self.trials > self.memory:
            scale = self.memory / self.trials
            self.hits, self.trials = self.hits * scale, self.memory

    def warm(self, hits: float, trials: float, weight: float = WARM_TRIALS) -> tuple[float, float]:
        """The cold prior (hits, trials) plus what is remembered, scaled to at most `weight` trials."""
        if self.trials <= 0:
            return hits, trials
        scale = min(1.0, weight / self.trials)
        return hits + self.hits * scale, trials + self.trials * scale


@dataclass
class CalibrationMemory:
    """Remembered hits and nodes per confidence bin of one drafter/auto_tree.Calibration."""

    bins: int = 16
    memory: float = MEMORY
    hits: Tensor = field(init=False)  # [bins] float64
    seen: Tensor = field(init=False)  # [bins] float64

    def __post_init__(self) -> None:
        self.hits = torch.zeros(self.bins, dtype=torch.float64)
        self.seen = torch.zeros(self.bins, dtype=torch.float64)

    def add(self, bins: Tensor, accepted: Tensor) -> None:
        """bins [N] long, accepted [N] bool: one verified node each."""
        self.seen.index_add_(0, bins, torch.ones_like(bins, dtype=torch.float64))
        self.hits.index_add_(0, bins, accepted.double())
        scale = (self.memory / self.seen).clamp(max=1.0)  # [bins]: 1 where under the memory
        self.seen.mul_(scale)
        self.hits.mul_(scale)

    def warm(self, hits: Tensor, seen: Tensor, weight: float = WARM_NODES) -> tuple[Tensor, Tensor]:
        """The cold prior per bin plus what is remembered, scaled to at most `weight` nodes a bin."""
        scale = (weight / self.seen.clamp(min=1e-12)).clamp(max=1.0)  # [bins]
        return hits + self.hits * scale, seen + self.seen * scale


@dataclass
class HeadMemory:
    """A head's two `--tree auto` calibrations: its own and its nodes alone in a budget merge."""

    calibration: CalibrationMemory = field(default_factory=CalibrationMemory)
    alone: CalibrationMemory = field(default_factory=CalibrationMemory)


@dataclass
class LookupMemory:
    """A lookup member's rates: prompt lookup's pooled q and its (match n, depth band) cells, and
    the datastore's r."""

    prompt: Rate = field(default_factory=Rate)
    store: Rate = field(default_factory=Rate)
    cells: dict[tuple[int, int], Rate] = field(default_factory=dict)

    def cell(self, key: tuple[int, int]) -> Rate:
        return self.cells.setdefault(key, Rate())


class VariantMemory:
    """What the members of one variant remembered: a lookup member's by its place in the variant
    (the online datastore is replaced by every snapshot and keeps its rates), a head's by its
    place and the head object (a swapped-in version learns afresh; the old one is forgotten with
    it)."""

    def __init__(self) -> None:
        self._lookups: dict[int, LookupMemory] = {}
        self._heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> {index: HeadMemory}
        self._gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first head -> GateState

    def lookup(self, index: int) -> LookupMemory:
        return self._lookups.setdefault(index, LookupMemory())

    def head(self, index: int, head) -> HeadMemory:
        return self._heads.setdefault(head, {}).setdefault(index, HeadMemory())

    def gate(self, head) -> GateState:
        """A budget merge's head gate (propose/head_gate.py), shared by its requests as it is (one
        request decodes at a time): what its heads add over lookup is a property of the workload
        and of the head (`head`, its first: a new version learns afresh)."""
        return self._gates.setdefault(head, GateState())
