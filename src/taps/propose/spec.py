"""The composition grammar: one parser and one name table for every way of naming how to draft.
`taps generate --variant SPEC` (and its sugar, --drafter / --strategy / --signal / --granularity /
--merge-mode / --weight), `taps eval --variant NAME=SPEC` and a study config's `variants:` all
become a VariantSpec here; propose/factory.py maps the names to classes, signals and merges.

SPEC (shell-safe, no quoting needed):
    baseline                               plain decoding of the target
    DIR | single:DIR                       one drafter
    average[-W1-W2...]:A,B,...             weight-averaged heads (default equal weights; with two
                                           drafters a single number l means l*A + (1-l)*B)
    route[-confidence|-entropy|-bandit][-step|-turn]:A,B,...   routing (default confidence, step)
    merge[-disjoint|-trie|-budget]:A,B,...             merged trees (default disjoint)
where each member A is `[name=]DIR` (the name defaults to the directory's name), or a lookup
drafter, model-free (propose/lookup.py; it routes and merges, it cannot be averaged):
    lookup             prompt lookup: continuations of the context's last n-grams in the prompt
                       and the output so far
    lookup+STORE       prompt lookup first, then a datastore (STORE: a directory written by
                       `taps lookup build` from the target's own answers, propose/rest.py)
                       adds its most frequent continuations (REST; up to 8 nodes a tree)
    STORE              a datastore directory as a member (a DIR holding datastore.json): the
                       datastore alone
A directory named `lookup` (or `lookup+...`) still means the directory. `lookup` and
`lookup+STORE` are named lookup unless named (`ds=lookup+STORE`); e.g.
`merge-budget:head=models/d/eagle2-mixed-large,lookup+runs/datastore`.
In a YAML config a variant is either such a string or a mapping with the same fields as VariantSpec.

Every mistake is a VariantSpecError (a ValueError: the CLI exits with code 2) of one line that
names the spec and what was expected. Torch-free: parsing arguments loads no model code.
"""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass, fields
from pathlib import Path

from taps.drafter.mix_weights import check_weights

# ---- the name table: every name, and what it means (the CLI's help reads these) ------------------
STRATEGIES = {
    "baseline": "plain decoding of the target",
    "single": "one drafter",
    "average": "the weighted average of the drafters' heads, drafting as one head",
    "route": "every drafter drafts a tree; the best-scoring one is verified",
    "merge": "every drafter drafts a tree; their merge is verified in one pass",
}
SIGNALS = {"confidence": "mean node confidence, higher wins", "entropy": "mean draft entropy, lower wins",
           "bandit": "learned: UCB over the tokens per verifier call each head earned on similar requests so far, "
                     "the confidence score as its prior (propose/bandit.py)"}
TREE_SIGNALS = ("confidence", "entropy")  # the signals one tree scores (post hoc routing, paper Table 2)
GRANULARITIES = {"step": "decide at every draft/verify step", "turn": "decide once per turn, from the first trees"}
MERGE_MODES = {
    "disjoint": "every tree under one shared root, no cross-tree attention",
    "trie": "identical token paths share one node",
    "budget": "the trie reranked by confidence to the single-tree --total-tokens",
}
LOOKUP = "lookup"  # the member that means prompt lookup instead of a drafter directory
LOOKUP_STORE = LOOKUP + "+"  # `lookup+STORE`: prompt lookup, then the datastore STORE
COMBINING = ("average", "route", "merge")  # strategies of two drafters or more
# each option field: its label in messages, its names, and the strategy whose SPEC words they are
OPTIONS = {"signal": ("routing signal", SIGNALS, "route"), "granularity": ("routing granularity", GRANULARITIES, "route"),
           "merge_mode": ("merge mode", MERGE_MODES, "merge")}
MAPPING_KEYS = ("strategy", "drafters", "signal", "granularity", "merge_mode", "weights")
SPEC_HELP = ("baseline | DIR | average[-W...]:A,B | route[-" + "|-".join(SIGNALS) + "][-" + "|-".join(GRANULARITIES)
             + "]:A,B | merge[-" + "|-".join(MERGE_MODES) + "]:A,B, where A, B are [name=]DIR, " + LOOKUP
             + " (prompt lookup) or " + LOOKUP_STORE + "STORE (prompt lookup, then a datastore); a datastore directory "
             "as DIR drafts from it alone")


class VariantSpecError(ValueError):
    pass


@dataclass(frozen=True)
class VariantSpec:
    """One composition, checked when made: a name, a strategy and its members and options."""

    name: str
    strategy: str  # one of STRATEGIES
    drafters: tuple[tuple[str, str], ...] = ()  # (member name, drafter directory), in drafter-index order
    signal: str = "confidence"  # route
    granularity: str = "step"  # route
    merge_mode: str = "disjoint"  # merge
    weights: tuple[float, ...] | None = None  # average
    where: InitVar[str | None] = None  # how errors name the spec (default: variant 'NAME'); not stored

    def __post_init__(self, where: str | None) -> None:
        check_spec(self, where or f"variant {self.name!r}")

    @property
    def member_names(self) -> list[str]:
        return [n for n, _ in self.drafters]

    def describe(self) -> dict:
        """JSON-able form (run.json, the report's lambda sweep)."""
        d = asdict(self)
        d["drafters"] = [list(m) for m in self.drafters]
        d["weights"] = list(self.weights) if self.weights is not None else None
        return d


DEFAULTS = {f.name: f.default for f in fields(VariantSpec) if f.name in OPTIONS}


def check_spec(spec: VariantSpec, where: str) -> None:
    """Every rule of the grammar that is not syntax, with `where` naming the spec."""
    def fail(message: str):
        raise VariantSpecError(f"{where}: {message}")

    if spec.strategy not in STRATEGIES:
        fail(f"unknown strategy {spec.strategy!r}; expected one of {', '.join(STRATEGIES)}")
    for option, (label, names, _) in OPTIONS.items():
        if getattr(spec, option) not in names:
            fail(f"unknown {label} {getattr(spec, option)!r}; expected one of {', '.join(names)}")
    n, names = len(spec.drafters), spec.member_names
    if len(set(names)) != len(names):
        fail(f"drafter names must be distinct, got {', '.join(names)} (name them NAME=DIR)")
    if spec.strategy == "baseline" and n:
        fail("baseline takes no drafters")
    if spec.strategy == "single" and n != 1:
        fail(f"single takes exactly one drafter, got {n}"
             + (f" ({', '.join(names)}); use average, route or merge to combine several" if n else ""))
    if spec.strategy in COMBINING and n < 2:
        fail(f"{spec.strategy} combines at least two drafters, got {n}")
    if spec.weights is not None:
        if spec.strategy != "average":
            fail(f"weights are for --strategy average only (got {spec.strategy})")
        try:
            check_weights(list(spec.weights), n)
        except ValueError as err:
            fail(str(err))


def is_lookup(path: str) -> bool:
    """`lookup` or `lookup+STORE` (unless a directory of that name exists)."""
    return (path == LOOKUP or (path.startswith(LOOKUP_STORE) and len(path) > len(LOOKUP_STORE))) \
        and not Path(path).is_dir()


def parse_member(text: str, where: str) -> tuple[str, str]:
    """'[name=]DIR' -> (name, DIR): a bare DIR, or a path that exists even if it holds '=', is named
    after its last component; `lookup` and `lookup+STORE` are named lookup."""
    name, sep, path = text.partition("=")
    if not sep or "/" in name or Path(text).exists():
        name, path = (LOOKUP if is_lookup(text) else Path(text.rstrip("/")).name), text
    if not name or not path:
        raise VariantSpecError(f"{where}: drafter {text!r} is not [name=]DIR")
    return name, path


def parse_spec(name: str, spec: str, where: str | None = None) -> VariantSpec:
    """One variant from its SPEC string (see the module docstring)."""
    where = where or f"variant {name}={spec}"
    spec = spec.strip()
    if spec == "baseline":
        return VariantSpec(name, "baseline", where=where)
    head, sep, rest = spec.partition(":")
    kind, *words = head.split("-")
    if not sep or kind not in STRATEGIES:  # a bare directory
        return VariantSpec(name, "single", (parse_member(spec, where),), where=where)
    parts = [m.strip() for m in rest.split(",")]
    if len(parts) > 1 and not all(parts):  # `route:a,,b` or `route:a,b,`: a drafter left out by mistake
        raise VariantSpecError(f"{where}: an empty drafter between commas in {rest!r}; expected "
                               "NAME=DIR or DIR, separated by single commas")
    members = tuple(parse_member(m, where) for m in parts if m)
    options: dict = {}
    for word in words:
        option = next((o for o, (_, names, owner) in OPTIONS.items() if owner == kind and word in names), None)
        if option is not None:
            options[option] = word
        elif kind == "average":
            try:
                options.setdefault("weights", []).append(float(word))
            except ValueError:
                raise VariantSpecError(f"{where}: average options are weights (numbers), got {word!r}") from None
        else:
            allowed = [w for _, names, owner in OPTIONS.values() if owner == kind for w in names]
            raise VariantSpecError(f"{where}: unknown option {word!r} for {kind}"
                                   + (f"; expected one of {', '.join(allowed)}" if allowed else " (it takes none)"))
    if "weights" in options:
        w = options["weights"]
        if len(w) == 1 and len(members) == 2:  # a lambda: l*A + (1-l)*B
            w = [w[0], 1.0 - w[0]]
        options["weights"] = tuple(w)
    return VariantSpec(name, kind, members, **options, where=where)


def parse_variant(text: str) -> VariantSpec:
    """'NAME=SPEC' (taps eval's form)."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec or "/" in name or ":" in name:
        raise VariantSpecError(f"--variant {text!r}: expected NAME=SPEC, e.g. math=models/d/hass-math, "
                               "base=baseline, routed=route-confidence:math=DIR_A,chat=DIR_B")
    return parse_spec(name, spec)


def variant_from_config(name: str, entry, where: str) -> VariantSpec:
    """A variant from a study config (`where` names the file and section): a SPEC string or a
    mapping of VariantSpec fields."""
    if isinstance(entry, str):
        return parse_spec(name, entry, where=f"{where}: variant {name}={entry}")
    if not isinstance(entry, dict):
        raise VariantSpecError(f"{where}: variant {name!r} must be a SPEC string or a mapping, got "
                               f"{type(entry).__name__}")
    unknown = set(entry) - set(MAPPING_KEYS)
    if unknown:
        raise VariantSpecError(f"{where}: variant {name!r} has unknown keys {', '.join(sorted(unknown))}")
    drafters = entry.get("drafters") or {}
    if isinstance(drafters, dict):
        members = tuple((str(k), str(v)) for k, v in drafters.items())
    else:
        members = tuple(parse_member(str(d), where) for d in drafters)
    weights = entry.get("weights")
    return VariantSpec(name, entry.get("strategy", "single"), members,
                       **{o: entry.get(o, DEFAULTS[o]) for o in OPTIONS},
                       weights=tuple(float(w) for w in weights) if weights is not None else None,
                       where=f"{where}: variant {name!r}")


def spec_from_options(drafters: list[tuple[str, str]], strategy: str = "single", weights=None,
                      **options: str) -> VariantSpec:
    """`taps generate`'s sugar: --drafter [NAME=]DIR (repeated) and --strategy / --signal /
    --granularity / --merge-mode / --weight build the spec their SPEC would. No drafter: plain
    decoding (baseline)."""
    if not drafters:
        if strategy != "single":
            raise VariantSpecError(f"--strategy {strategy} needs --drafter")
        return VariantSpec("generate", "baseline")
    return VariantSpec("generate", strategy, tuple(drafters), weights=None if weights is None else tuple(weights),
                       **options, where=f"--strategy {strategy}")
