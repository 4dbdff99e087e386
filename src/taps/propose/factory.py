"""The one place that maps a strategy spec (names, as the CLI and study configs spell them) to a
Proposer. Algorithms never see these strings: each name maps to a class, a signal or a function.

    single   one drafter                                  SingleProposer
    average  the weighted average of the drafters' heads  SingleProposer(average_heads(...))
    route    per-step or per-turn routing                 RoutedProposer(signal, granularity)
    merge    one verification of the merged trees         MergedProposer(merge mode)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

from taps.config import TreeConfig
from taps.drafter.average import average_heads
from taps.drafter.head import EagleHead
from taps.propose.base import Proposer
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


def _pick(kind: str, value: str, table) -> object:
    if value not in table:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(table)}")
    return table[value] if isinstance(table, dict) else value


def build_proposer(strategy: str, heads: Mapping[str, EagleHead], tree: TreeConfig = TreeConfig(),
                   signal: str = "confidence", granularity: str = "step", merge_mode: str = "disjoint",
                   weights: Sequence[float] | None = None) -> Proposer:
    """A proposer for `strategy` over the named heads (each bound to the target; dict order is the
    drafter index recorded in tree.source and in routing / merge logs)."""
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
        return SingleProposer(heads[names[0]], tree)
    if strategy == "average":
        return SingleProposer(average_heads([heads[n] for n in names], weights), tree)
    singles = [SingleProposer(heads[n], tree, source=i) for i, n in enumerate(names)]
    if strategy == "route":
        return RoutedProposer(singles, signal=routing_signal, per_turn=per_turn, names=names)
    return MergedProposer(singles, merge=merge_for(tree), names=names)
