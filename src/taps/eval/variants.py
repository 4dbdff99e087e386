"""Variants of a study: what `taps eval --variant NAME=SPEC` and a study config's `variants:` name.

SPEC (shell-safe, no quoting needed):
    baseline                               plain decoding of the target
    DIR | single:DIR                       one drafter
    average[-W1-W2...]:A,B,...             weight-averaged heads (default equal weights; with two
                                           drafters a single number l means l*A + (1-l)*B)
    route[-confidence|-entropy][-step|-turn]:A,B,...   routing (default confidence, step)
    merge[-disjoint|-trie|-budget]:A,B,...             merged trees (default disjoint)
where each member A is `[name=]DIR` (the name defaults to the directory's name), or `lookup`:
prompt lookup, the model-free drafter (propose/lookup.py; it routes and merges, it cannot be
averaged; a directory named `lookup` still means the directory). In a YAML
config a variant is either such a string or a mapping with the same fields as VariantSpec.

The proposer for a conversation is built fresh (compositions keep per-turn state), from heads
loaded once per directory and averaged once per variant.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from taps.config import TreeConfig
from taps.drafter.average import average_heads, check_weights
from taps.propose.base import Proposer
from taps.propose.factory import GRANULARITIES, MERGE_MODES, SIGNALS, LookupSpec, build_proposer, load_member

KINDS = ("baseline", "single", "average", "route", "merge")


class VariantSpecError(ValueError):
    pass


@dataclass(frozen=True)
class VariantSpec:
    name: str
    strategy: str  # one of KINDS
    drafters: tuple[tuple[str, str], ...] = ()  # (member name, drafter directory), in drafter-index order
    signal: str = "confidence"  # route
    granularity: str = "step"  # route
    merge_mode: str = "disjoint"  # merge
    weights: tuple[float, ...] | None = None  # average

    def __post_init__(self) -> None:
        where = f"variant {self.name!r}"
        if self.strategy not in KINDS:
            raise VariantSpecError(f"{where}: unknown strategy {self.strategy!r}; expected one of {', '.join(KINDS)}")
        if self.strategy == "baseline" and self.drafters:
            raise VariantSpecError(f"{where}: baseline takes no drafters")
        if self.strategy == "single" and len(self.drafters) != 1:
            raise VariantSpecError(f"{where}: single takes exactly one drafter, got {len(self.drafters)}")
        if self.strategy in ("average", "route", "merge") and len(self.drafters) < 2:
            raise VariantSpecError(f"{where}: {self.strategy} combines at least two drafters, got {len(self.drafters)}")
        names = [n for n, _ in self.drafters]
        if len(set(names)) != len(names):
            raise VariantSpecError(f"{where}: member names must differ, got {', '.join(names)} (name them NAME=DIR)")
        for option, table in (("signal", SIGNALS), ("granularity", GRANULARITIES), ("merge_mode", MERGE_MODES)):
            if getattr(self, option) not in table:
                raise VariantSpecError(f"{where}: unknown {option} {getattr(self, option)!r}; expected one of "
                                       f"{', '.join(table)}")
        if self.weights is not None:
            if self.strategy != "average":
                raise VariantSpecError(f"{where}: weights are for average variants only")
            try:
                check_weights(list(self.weights), len(self.drafters))
            except ValueError as err:
                raise VariantSpecError(f"{where}: {err}") from None

    @property
    def member_names(self) -> list[str]:
        return [n for n, _ in self.drafters]

    def describe(self) -> dict:
        """JSON-able form (run.json, the report's lambda sweep)."""
        d = asdict(self)
        d["drafters"] = [list(m) for m in self.drafters]
        d["weights"] = list(self.weights) if self.weights is not None else None
        return d


def _member(text: str, where: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or "/" in name or Path(text).exists():
        name, path = Path(text.rstrip("/")).name, text
    if not name or not path:
        raise VariantSpecError(f"{where}: drafter {text!r} is not [name=]DIR")
    return name, path


def parse_spec(name: str, spec: str) -> VariantSpec:
    """One variant from its SPEC string (see the module docstring)."""
    where = f"variant {name}={spec}"
    spec = spec.strip()
    if spec == "baseline":
        return VariantSpec(name, "baseline")
    head, sep, rest = spec.partition(":")
    kind, *options = head.split("-")
    if not sep or kind not in KINDS:  # a bare directory
        return VariantSpec(name, "single", (_member(spec, where),))
    members = tuple(_member(m.strip(), where) for m in rest.split(",") if m.strip())
    fields: dict = {}
    for option in options:
        if kind == "route" and option in SIGNALS:
            fields["signal"] = option
        elif kind == "route" and option in GRANULARITIES:
            fields["granularity"] = option
        elif kind == "merge" and option in MERGE_MODES:
            fields["merge_mode"] = option
        elif kind == "average":
            try:
                fields.setdefault("weights", []).append(float(option))
            except ValueError:
                raise VariantSpecError(f"{where}: average options are weights (numbers), got {option!r}") from None
        else:
            allowed = {"route": [*SIGNALS, *GRANULARITIES], "merge": list(MERGE_MODES)}.get(kind, [])
            raise VariantSpecError(f"{where}: unknown option {option!r} for {kind}"
                                   + (f"; expected one of {', '.join(allowed)}" if allowed else " (it takes none)"))
    if "weights" in fields:
        w = fields["weights"]
        if len(w) == 1 and len(members) == 2:  # a lambda: l*A + (1-l)*B
            w = [w[0], 1.0 - w[0]]
        fields["weights"] = tuple(w)
    return VariantSpec(name, kind, members, **fields)


def parse_variant(text: str) -> VariantSpec:
    """'NAME=SPEC' (the CLI form)."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec or "/" in name or ":" in name:
        raise VariantSpecError(f"--variant {text!r}: expected NAME=SPEC, e.g. math=models/d/hass-math, "
                               "base=baseline, routed=route-confidence:math=DIR_A,chat=DIR_B")
    return parse_spec(name, spec)


def variant_from_config(name: str, entry, where: str) -> VariantSpec:
    """A variant from a study config: a SPEC string or a mapping of VariantSpec fields."""
    if isinstance(entry, str):
        return parse_spec(name, entry)
    if not isinstance(entry, dict):
        raise VariantSpecError(f"{where}: variant {name!r} must be a SPEC string or a mapping, got "
                               f"{type(entry).__name__}")
    unknown = set(entry) - {"strategy", "drafters", "signal", "granularity", "merge_mode", "weights"}
    if unknown:
        raise VariantSpecError(f"{where}: variant {name!r} has unknown keys {', '.join(sorted(unknown))}")
    drafters = entry.get("drafters") or {}
    if isinstance(drafters, dict):
        members = tuple((str(k), str(v)) for k, v in drafters.items())
    else:
        members = tuple(_member(str(d), where) for d in drafters)
    weights = entry.get("weights")
    return VariantSpec(name, entry.get("strategy", "single"), members,
                       signal=entry.get("signal", "confidence"), granularity=entry.get("granularity", "step"),
                       merge_mode=entry.get("merge_mode", "disjoint"),
                       weights=tuple(float(w) for w in weights) if weights is not None else None)


class HeadPool:
    """Loads each drafter directory once (strictly, for this target) and each average once."""

    def __init__(self, target, attn_implementation: str = "sdpa"):
        self.target, self.attn = target, attn_implementation
        self._heads: dict[str, object] = {}
        self._averages: dict[tuple, object] = {}

    def head(self, path: str):
        key = str(Path(path).resolve())
        if key not in self._heads:
            self._heads[key] = load_member(path, self.target, attn_implementation=self.attn)
        return self._heads[key]

    def proposer(self, spec: VariantSpec, tree: TreeConfig, policy=None) -> Proposer | None:
        """A fresh proposer for one conversation (None for the baseline); `policy`: a factory of
        cost-aware tree policies, or None for fixed trees."""
        if spec.strategy == "baseline":
            return None
        heads = {n: self.head(d) for n, d in spec.drafters}
        if spec.strategy == "average":
            lookups = [n for n, h in heads.items() if isinstance(h, LookupSpec)]
            if lookups:
                raise VariantSpecError(f"variant {spec.name!r}: average combines head weights; {', '.join(lookups)} "
                                       "is prompt lookup, which has none (route or merge it instead)")
            key = (tuple(str(Path(d).resolve()) for _, d in spec.drafters), spec.weights)
            if key not in self._averages:
                self._averages[key] = average_heads(list(heads.values()), spec.weights)
            return build_proposer("single", {spec.name: self._averages[key]}, tree, policy=policy)
        return build_proposer(spec.strategy, heads, tree, signal=spec.signal, granularity=spec.granularity,
                              merge_mode=spec.merge_mode, policy=policy)
