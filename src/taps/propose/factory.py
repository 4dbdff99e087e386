"""The one place that maps a strategy spec (names, as the CLI and study configs spell them) to a
Proposer. Algorithms never see these strings: each name maps to a class, a signal or a function.

    single   one drafter                                  SingleProposer
    average  the weighted average of the drafters' heads  SingleProposer(average_heads(...))
    route    per-step or per-turn routing                 RoutedProposer(signal, granularity)
    merge    one verification of the merged trees         MergedProposer(merge mode)

A member is an EAGLE head, or a `LookupSpec` (prompt lookup, propose/lookup.py): a model-free
drafter that routes and merges like any head (it cannot be weight-averaged).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from taps.config import TreeConfig
from taps.drafter.average import average_heads
from taps.drafter.head import EagleHead
from taps.propose.base import Proposer
from taps.propose.lookup import LookupProposer
from taps.propose.merged import MergedProposer
from taps.propose.routed import CONFIDENCE, ENTROPY, RoutedProposer, RoutingSignal
from taps.propose.single import SingleProposer
from taps.tree import DraftTree, merge_budget, merge_disjoint, merge_trie

Merge = Callable[[Sequence[DraftTree]], DraftTree]

SIGNALS: dict[str, RoutingSignal] = {"confidence": CONFIDENCE, "entropy": ENTROPY}
GRANULARITIES: dict[str, bool] = {"step": False, "turn": True}  # name -> per_turn
MERGE_MODES: dict[str, Callable[[TreeConfig], Merge]] = {
    "disjoint": lambda tree: merge_disjoint,
    "trie": lambda tree: merge_trie,
    "budget": lambda tree: partial(merge_budget, total_tokens=tree.total_tokens),
}
STRATEGIES = ("single", "average", "route", "merge")
LOOKUP = "lookup"  # the member name / path that means prompt lookup instead of a head directory


@dataclass(frozen=True)
class LookupSpec:
    """A prompt-lookup member: n-gram sizes tried, longest first."""

    max_ngram: int = 3
    min_ngram: int = 1


def load_member(path: str, target, **head_options) -> "EagleHead | LookupSpec":
    """A member named on a command line or in a config: `lookup` (unless a directory of that name
    exists) is prompt lookup; anything else is a drafter directory, loaded strictly for the target."""
    from pathlib import Path

    from taps.drafter.checkpoint import load_head

    if path == LOOKUP and not Path(path).is_dir():
        return LookupSpec()
    return load_head(path, target, **head_options)[0]


def _member(member: "EagleHead | LookupSpec", tree: TreeConfig, source: int, policy=None) -> Proposer:
    if isinstance(member, LookupSpec):
        return LookupProposer(tree, member.max_ngram, member.min_ngram, source=source)
    return SingleProposer(member, tree, source=source, policy=policy() if policy is not None else None)


def _pick(kind: str, value: str, table) -> object:
    if value not in table:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(table)}")
    return table[value] if isinstance(table, dict) else value


def build_proposer(strategy: str, heads: Mapping[str, "EagleHead | LookupSpec"], tree: TreeConfig = TreeConfig(),
                   signal: str = "confidence", granularity: str = "step", merge_mode: str = "disjoint",
                   weights: Sequence[float] | None = None, policy: Callable[[], object] | None = None) -> Proposer:
    """A proposer for `strategy` over the named heads (each bound to the target; dict order is the
    drafter index recorded in tree.source and in routing / merge logs). `policy`: a factory of
    cost-aware tree policies (drafter/auto_tree.py), one per head; None drafts fixed trees."""
    _pick("strategy", strategy, STRATEGIES)
    routing_signal = _pick("routing signal", signal, SIGNALS)
    per_turn = _pick("routing granularity", granularity, GRANULARITIES)
    merge_for = _pick("merge mode", merge_mode, MERGE_MODES)
    names = list(heads)
    if not names:
        raise ValueError("no drafter given: every strategy needs at least one --drafter")
    if weights is not None and strategy != "average":
        raise ValueError(f"weights are for --strategy average only (got --strategy {strategy})")
    if strategy == "single":
        if len(names) != 1:
            raise ValueError(f"--strategy single takes exactly one drafter, got {len(names)} ({', '.join(names)}); "
                             "use --strategy average, route or merge to combine several")
        return _member(heads[names[0]], tree, 0, policy)
    if strategy == "average":
        lookups = [n for n in names if isinstance(heads[n], LookupSpec)]
        if lookups:
            raise ValueError(f"--strategy average averages head weights; {', '.join(lookups)} is prompt lookup, "
                             "which has none (route or merge it instead)")
        return SingleProposer(average_heads([heads[n] for n in names], weights), tree,
                              policy=policy() if policy is not None else None)
    singles = [_member(heads[n], tree, i, policy) for i, n in enumerate(names)]
    if strategy == "route":
        return RoutedProposer(singles, signal=routing_signal, per_turn=per_turn, names=names)
    return MergedProposer(singles, merge=merge_for(tree), names=names)
