"""The one place that maps a composition (a VariantSpec, propose/spec.py: the names the CLI and
study configs spell) to a Proposer. Algorithms never see these strings: each name maps to a class,
a signal or a function.

    baseline plain decoding                               PlainProposer
    single   one drafter                                  SingleProposer
    average  the weighted average of the drafters' heads  SingleProposer(average_heads(...))
    route    per-step or per-turn routing                 RoutedProposer(signal, granularity);
                                                          signal bandit: BanditRouter(granularity, learned state)
    merge    one verification of the merged trees         MergedProposer(merge mode)

A member is an EAGLE head, or a `LookupSpec` (propose/lookup.py: prompt lookup, a datastore of
the target's own answers (propose/rest.py), or both): a model-free drafter that routes and
merges like any head (it cannot be weight-averaged). HeadPool loads each
drafter directory once and builds a fresh proposer per conversation (compositions keep per-turn
state), averaging each set of heads once; it keeps each route-bandit variant's learned state
(propose/bandit.BanditState) for the proposers of that variant, so learning outlives a
conversation: `taps serve` (one pool per server) learns across requests, `taps eval` (one pool
per run, per worker process) across questions. A server's pool also remembers its drafters'
running estimates (propose/memory.py), so each request starts them warm; a study's questions
start them cold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from taps.core.config import TreeConfig
from taps.drafter.auto_tree import brief_sized_members, merge_budget_by_cost, observe_budget_merge
from taps.drafter.average import average_heads
from taps.drafter.checkpoint import load_head
from taps.drafter.head import EagleHead
from taps.propose.bandit import BANDIT, BanditRouter, BanditState
from taps.core.proposer import PlainProposer, Proposer
from taps.propose.rest import Datastore, DatastoreError, is_datastore
from taps.propose.head_gate import HeadGate
from taps.propose.lookup import LookupProposer, LookupSpec  # noqa: F401 (LookupSpec: re-exported)
from taps.propose.memory import VariantMemory
from taps.propose.merged import MergedProposer
from taps.propose.routed import CONFIDENCE, ENTROPY, RoutedProposer, RoutingSignal
from taps.propose.single import SingleProposer
from taps.propose.spec import LOOKUP_STORE, VariantSpec, VariantSpecError, is_lookup
from taps.core.target import tokenizer_fingerprint
from taps.core.tree import DraftTree, merge_budget, merge_disjoint, merge_trie

Merge = Callable[[Sequence[DraftTree]], DraftTree]

# the implementation of each name of spec.SIGNALS and spec.MERGE_MODES
ROUTING_SIGNALS: dict[str, RoutingSignal] = {signal.name: signal for signal in (CONFIDENCE, ENTROPY, BANDIT)}
MERGES: dict[str, Callable[[TreeConfig], Merge]] = {
    "disjoint": lambda tree: merge_disjoint,
    "trie": lambda tree: merge_trie,
    "budget": lambda tree: partial(merge_budget, total_tokens=tree.total_tokens),
}


def load_datastore(path: str | Path, target=None) -> Datastore:
    """A datastore directory, checked against the target: built with its tokenizer (when both say
    which), no token id past its vocabulary."""
    path = Path(path)
    if not is_datastore(path):
        raise DatastoreError(f"{path}: not a datastore (no datastore.json); build one with "
                             "`taps lookup build --records FILE.jsonl --target T --out DIR`")
    store = Datastore.load(path)
    tokenizer = getattr(target, "tokenizer", None)
    built_for = store.manifest.get("tokenizer_fingerprint")
    if tokenizer is not None and built_for is not None:
        if tokenizer_fingerprint(tokenizer) != built_for:
            raise DatastoreError(f"{path}: built with the tokenizer of {store.manifest.get('target')!r}, which is not "
                                 f"this target's; rebuild it with `taps lookup build --target ...` for this target")
    vocab = getattr(getattr(target, "config", None), "vocab_size", None)
    if vocab is not None and store.manifest.get("max_token", -1) >= vocab:
        raise DatastoreError(f"{path}: holds token id {store.manifest['max_token']}, past this target's vocabulary "
                             f"of {vocab}")
    return store


def load_member(path: str, target, **head_options) -> "EagleHead | LookupSpec":
    """A member named on a command line or in a config: `lookup` is prompt lookup, `lookup+STORE`
    prompt lookup with the datastore STORE (unless a directory of that name exists); a datastore
    directory is the datastore alone; anything else is a drafter directory, loaded strictly for the
    target."""
    if is_lookup(path):
        return LookupSpec() if not path.startswith(LOOKUP_STORE) else \
            LookupSpec(datastore=load_datastore(path[len(LOOKUP_STORE):], target))
    if is_datastore(path):
        return LookupSpec(datastore=load_datastore(path, target), prompt=False)
    return load_head(path, target, **head_options)


# In a budget merge under --tree auto a lookup member drafts continuations up to this deep, and
# up to this many datastore nodes, past the caps of a tree verified whole (the heads' depth 8, 8
# datastore nodes): its drafts cost no forward, and merge_budget_by_cost keeps only the nodes that
# pay for their verify slot. A repeated format runs past 8 tokens: on 12 JSON-extraction requests
# with a server's online datastore one step in five accepted a whole 8-token chain, and 24 / 24
# raised the acceptance length 4.79 -> 5.83, with GSM8K and MT-Bench within 1 % (docs/learn.md).
# Since the lookup tree keeps its best-scored nodes (not the first continuation's levels), a loop
# drafts deeper at no cost to the others: 48 levels 7.39 -> 7.57 on those requests (docs/learn.md).
AUTO_LOOKUP_DEPTH = 48
AUTO_STORE_NODES = 24


def _member(member: "EagleHead | LookupSpec", tree: TreeConfig, drafter: int, policy=None,
            priced: bool = False, memory: VariantMemory | None = None, alone: bool = False) -> Proposer:
    """The proposer of one member, at place `drafter` of its variant; with `memory`, its running
    estimates start from what the variant's earlier conversations taught them (propose/memory.py).
    `priced`: a budget merge by cost prices its nodes; `alone`: a single drafter, whose tree is
    verified by itself (a route's members keep their caps: the router compares whole trees)."""
    if isinstance(member, LookupSpec):
        # --tree auto: a budget merge prices this member's nodes (merge_budget_by_cost), and a tree
        # verified alone is cut by the measured costs (size_by_cost). Either way its chains may run
        # deep and its datastore share be large: a node joins only where it pays
        sizer = policy() if policy is not None and alone else None
        if priced or sizer is not None:
            tree = replace(tree, depth=max(tree.depth, min(AUTO_LOOKUP_DEPTH, tree.total_tokens - 1)))
            if member.store_nodes is not None:
                member = replace(member, store_nodes=max(member.store_nodes, AUTO_STORE_NODES))
        return LookupProposer(tree, member, drafter=drafter,
                              memory=memory.lookup(drafter) if memory is not None else None, policy=sizer)
    sized = policy() if policy is not None else None
    if sized is not None and memory is not None:
        sized.remember(memory.head(drafter, member))
    return SingleProposer(member, tree, drafter=drafter, policy=sized)


def build_proposer(strategy: str, heads: Mapping[str, "EagleHead | LookupSpec"], tree: TreeConfig = TreeConfig(),
                   signal: str = "confidence", granularity: str = "step", merge_mode: str = "disjoint",
                   weights: Sequence[float] | None = None, policy: Callable[[], object] | None = None) -> Proposer:
    """A proposer for `strategy` over the named heads (each bound to the target; dict order is the
    drafter index: bit h of tree.drafters, and the index in routing / merge logs), checked by the grammar's
    rules. `policy`: a factory of cost-aware tree policies (drafter/auto_tree.py), one per head (a
    budget merge then sizes its lookup members' share by cost too: merge_budget_by_cost); None
    drafts fixed trees."""
    where = f"--strategy {strategy}"
    spec = VariantSpec(strategy, strategy, tuple((name, name) for name in heads), signal, granularity, merge_mode,
                       None if weights is None else tuple(weights), where=where)
    return compose(spec, heads, tree, policy, where=where)


def compose(spec: VariantSpec, heads: Mapping[str, "EagleHead | LookupSpec"], tree: TreeConfig, policy=None,
            average: Callable[[], EagleHead] | None = None, where: str | None = None,
            learned: BanditState | None = None, memory: VariantMemory | None = None) -> Proposer:
    """The proposer of a checked spec over its loaded members (`heads`, in spec.drafters order);
    `average`: the averaged head, if the caller keeps one (HeadPool); `learned`: a route-bandit's
    state, if the caller keeps one (HeadPool; default: a fresh one, learning within this proposer);
    `memory`: the variant's remembered estimates, if the caller keeps them (HeadPool(remember=True);
    default: every estimate from its cold prior)."""
    if spec.strategy == "baseline":
        return PlainProposer()
    names = list(heads)
    if spec.strategy == "average":
        lookups = [n for n in names if isinstance(heads[n], LookupSpec)]
        if lookups:
            raise VariantSpecError(f"{where or f'variant {spec.name!r}'}: average combines head weights; "
                                   f"{', '.join(lookups)} is prompt lookup or a datastore, which has none "
                                   "(route or merge it instead)")
        head = average() if average is not None else average_heads(list(heads.values()), spec.weights)
        return _member(head, tree, 0, policy, memory=memory)
    if spec.strategy == "single":
        return _member(heads[names[0]], tree, 0, policy, memory=memory, alone=True)
    priced = policy is not None and spec.strategy == "merge" and spec.merge_mode == "budget"
    singles = [_member(heads[n], tree, i, policy, priced, memory) for i, n in enumerate(names)]
    if spec.strategy == "route" and spec.signal == BANDIT.name:
        return BanditRouter(singles, learned or BanditState(names, tree.depth), per_turn=spec.granularity == "turn",
                            names=names)
    if spec.strategy == "route":
        return RoutedProposer(singles, signal=ROUTING_SIGNALS[spec.signal], per_turn=spec.granularity == "turn",
                              names=names)
    merge = MERGES[spec.merge_mode](tree)
    sized = {i: s.policy for i, s in enumerate(singles) if getattr(s, "policy", None) is not None}
    observe, first, brief, gate = None, (), None, None
    # --tree auto with lookup members: every node joins only where it pays (heads alone keep the
    # budget merge of their policy-sized trees)
    if spec.merge_mode == "budget" and sized and len(sized) < len(singles):
        priced = dict(policy=next(iter(sized.values())), sized=sum(1 << i for i in sized))
        merge = partial(merge_budget_by_cost, total_tokens=tree.total_tokens, **priced)
        observe = partial(observe_budget_merge, **priced)
        # the model-free members draft first, and the heads size their trees over what they offer
        first = tuple(i for i in range(len(singles)) if i not in sized)
        brief = partial(brief_sized_members, policies=list(sized.values()))
        # and the heads draft only where what they add over lookup pays for their drafting
        head = heads[names[min(sized)]]
        gate = HeadGate(state=memory.gate(head) if memory is not None else None, **priced)
    return MergedProposer(singles, merge=merge, names=names, observe_merge=observe, first=first, brief=brief,
                          gate=gate)


class HeadPool:
    """Loads each drafter directory once (strictly, for this target) and each average once.
    `remember`: conversations start their running estimates (`--tree auto`'s calibrations, lookup's
    q and r) from what the same variant's earlier conversations taught them (propose/memory.py; a
    server's); otherwise each starts cold (a study's questions, decoded independently)."""

    def __init__(self, target, attn_implementation: str = "sdpa", remember: bool = False):
        self.target, self.attn = target, attn_implementation
        self._heads: dict[str, object] = {}
        self._averages: dict[tuple, object] = {}
        self.learned: dict[tuple, BanditState] = {}  # route-bandit states, by variant (learned_key)
        self.remember = remember
        self.memory: dict[tuple, VariantMemory] = {}  # remembered estimates, by variant (learned_key)

    def head(self, path: str):
        key = str(Path(path).resolve())
        if key not in self._heads:
            self._heads[key] = load_member(path, self.target, attn_implementation=self.attn)
        return self._heads[key]

    def replace(self, path: str, member: "EagleHead | LookupSpec") -> None:
        """Serve `member` wherever `path` is named from now on (`taps serve --learn`: a new head
        version, the online datastore's new snapshot); proposers built before keep the old one,
        and averages over it are computed again."""
        key = str(Path(path).resolve())
        self._heads[key] = member
        self._averages = {k: v for k, v in self._averages.items() if key not in k[0]}

    def heads(self, spec: VariantSpec) -> dict[str, "EagleHead | LookupSpec"]:
        return {name: self.head(path) for name, path in spec.drafters}

    def proposer(self, spec: VariantSpec, tree: TreeConfig, policy=None, remember: bool = True) -> Proposer:
        """A fresh proposer for one conversation; `policy`: a factory of cost-aware tree policies,
        or None for fixed trees; `remember`: false for a conversation that neither starts from
        the pool's remembered estimates nor adds to them (a request that opted out of learning)."""
        heads = self.heads(spec)
        key = (tuple(str(Path(d).resolve()) for _, d in spec.drafters), spec.weights)

        def average():
            if key not in self._averages:
                self._averages[key] = average_heads(list(heads.values()), spec.weights)
            return self._averages[key]

        memory = None
        if self.remember and remember:
            memory = self.memory.setdefault(self.learned_key(spec), VariantMemory())
        return compose(spec, heads, tree, policy, average=average, learned=self.bandit(spec, tree), memory=memory)

    @staticmethod
    def learned_key(spec: VariantSpec) -> tuple:
        return (spec.name, spec.granularity, tuple(str(Path(d).resolve()) for _, d in spec.drafters))

    def bandit(self, spec: VariantSpec, tree: TreeConfig) -> BanditState | None:
        """The learned state of a route-bandit variant (made on first use), None for any other."""
        if spec.strategy != "route" or spec.signal != BANDIT.name:
            return None
        key = self.learned_key(spec)
        if key not in self.learned:
            self.learned[key] = BanditState(spec.member_names, tree.depth)
        return self.learned[key]

    def forget(self, spec: VariantSpec | None = None) -> None:
        """Drop what a variant learned: its route-bandit state and remembered estimates (every
        variant's: None)."""
        if spec is None:
            self.learned.clear()
            self.memory.clear()
        else:
            self.learned.pop(self.learned_key(spec), None)
            self.memory.pop(self.learned_key(spec), None)
