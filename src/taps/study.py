"""A whole study as one config: target -> drafters -> evaluation -> report (`taps reproduce`).

The pipeline, and the only module that knows every layer below it (data, training, evaluation);
only the CLI sits above it (tests/test_import_graph.py, docs/architecture.md).

    name: smollm2
    out: runs/study-smollm2            # results/, report/ and work/ go here
    data_dir: null                     # else --data-dir / $TAPS_DATA_DIR
    target: {path: T}                  # a model directory, a .gguf file or a known name (taps.core.targets)
    drafters: {out: DIR, recipe: {...}}  # recipe: DrafterRecipe fields; without it DIR must hold the heads
    backbones: [eagle2, hass]          # expands "{backbone}" in variant names and specs
    lambdas: [0.1, 0.5, 0.9]           # expands "{lambda}" (the averaging sweep)
    variants: {NAME: SPEC, ...}        # taps.propose.spec SPEC strings; "{drafters}" = drafters.out
    eval: {bench: [...], temperatures: [0, 1], limit: N, max_new_tokens: 512, seed: 0,
           tree: {total_tokens: 60, depth: 5, top_k: 10, mode: fixed | auto}, device: auto, dtype: auto,
           categories: [...], jobs: 1}      # jobs: worker processes on this machine

Every stage is resumable and skips what is already done, so rerunning a study continues it.
Unknown keys are errors naming the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from taps.core.config import DEMO_OUT, SEED_LIMIT, STUDY_STAGES, SpeculationConfig
from taps.eval import report
from taps.eval.benchmarks import load_questions
from taps.eval.runner import EvalSettings, ResultsMismatchError, eval_benchmarks
from taps.core.jsonl import decode_utf8
from taps.propose.spec import VariantSpec, VariantSpecError, variant_from_config
from taps.core.target import TargetRef
from taps.core.targets import KNOWN_TARGETS, find_gguf, resolve_target
from taps.train.family import BACKBONES, DOMAINS, DrafterRecipe, XlRecipe, build_drafters

STAGES = STUDY_STAGES
# what changes when a new embedded default ships (target or drafter weights) or the demo's default
# measurement changed (acceptance: verify before session 39): `taps demo` in its default directory
# moves such results aside; other mismatches (tree, settings, variants) are the user's choices and
# keep the usual refusal
NEW_DEFAULT_KEYS = ("target_fingerprint", "target_weights", "drafter_weights", "acceptance")

# The paper's seven variants per backbone (docs/spec.md §1), plus the baseline and this project's merges.
PAPER_VARIANTS = {
    "baseline": "baseline",
    "{backbone}-math": "{drafters}/{backbone}-math",
    "{backbone}-chat": "{drafters}/{backbone}-chat",
    "{backbone}-mixed-small": "{drafters}/{backbone}-mixed-small",
    "{backbone}-mixed-large": "{drafters}/{backbone}-mixed-large",
    "{backbone}-averaged": "average-0.5:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
    "{backbone}-routed": "route-confidence-step:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
    "{backbone}-merged": "merge-disjoint:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
}
EXTRA_VARIANTS = {
    "{backbone}-routed-entropy": "route-entropy-turn:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
    # learned routing (propose/bandit.py): per turn, about one head's cost; it learns across the run's questions
    "{backbone}-routed-bandit": "route-bandit-turn:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
    "{backbone}-merged-trie": "merge-trie:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
    "{backbone}-merged-budget": "merge-budget:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
}

SWEEP_VARIANTS = {
    "{backbone}-average-{lambda}": "average-{lambda}:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat",
}


class StudyConfigError(ValueError):
    pass


@dataclass
class Study:
    name: str
    out: Path
    target: Path
    drafters: Path
    variants: list[VariantSpec]
    benches: list[str]
    settings: EvalSettings
    data_dir: str | None = None
    drafter_recipe: dict | None = None  # DrafterRecipe fields
    drafter_jobs: int = 1  # heads trained at once, one process each
    limit: int | None = None
    categories: list[str] | None = None
    device: str = "auto"
    dtype: str = "auto"
    eval_jobs: int = 1  # evaluation worker processes on this machine (runner.run_eval_jobs)
    source: str = "<dict>"  # where the config came from, for messages

    @property
    def results(self) -> Path:
        return self.out / "results"

    @property
    def report(self) -> Path:
        return self.out / "report"

    @property
    def work(self) -> Path:
        return self.out / "work"


def _check_keys(where: str, mapping, allowed: set[str]) -> dict:
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise StudyConfigError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise StudyConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(allowed))}")
    return mapping


def _integer(source: str, key: str, value, low: int, high: int | None = None) -> int:
    """A config integer in [low, high), or an error naming the key (YAML reads 1e23 and "abc" as
    strings, 1.5 as a float: none is silently converted)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise StudyConfigError(f"{source}: {key} must be an integer {bound}, got {value!r}")
    return value


def _numbers(source: str, key: str, value, one: bool = False) -> list[float]:
    """A config list of finite numbers (one: a single number, as a list of one), or an error
    naming the key."""
    values = [value] if one else value
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               and math.isfinite(v) for v in values):
        raise StudyConfigError(f"{source}: {key} must be {'a finite number' if one else 'a list of finite numbers'}, "
                               f"got {value!r}")
    return [float(v) for v in values]


def _strings(source: str, key: str, value) -> list[str]:
    """A config list of non-empty strings, or an error naming the key (a bare string would be
    taken letter by letter)."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise StudyConfigError(f"{source}: {key} must be a list of names, e.g. [a, b], got {value!r}")
    return value


def _recipe_fields(where: str, mapping, recipe_cls) -> dict | None:
    if mapping is None:
        return None
    names = {f.name for f in fields(recipe_cls)} - {"data_dir"}
    return dict(_check_keys(where, mapping, names))


def target_exists(study: "Study") -> bool:
    """The study's target is there to use: a model directory, or a GGUF file or known name
    (taps.core.targets) that loads without building anything."""
    if (study.target / "config.json").is_file():
        return True
    return find_gguf(str(study.target)) is not None  # a known name whose package is missing says how to install it


def _fill(text: str, values: dict[str, str | None]) -> str:
    for key, value in values.items():
        if value is not None:
            text = text.replace("{" + key + "}", value)
    return text


def expand_variants(templates: dict, backbones: list[str], lambdas: list[float], drafters: Path,
                    where: str) -> list[VariantSpec]:
    """Variant templates -> specs: "{backbone}" and "{lambda}" expand over their lists."""
    plain = [(str(n), s, None) for n, s in templates.items() if "{backbone}" not in str(n)]
    per_backbone = [(str(n), s) for n, s in templates.items() if "{backbone}" in str(n)]
    # the variants of one backbone stay together (the paper's tables have a column per backbone)
    order = plain + [(n, s, b) for b in backbones for n, s in per_backbone]
    out: list[VariantSpec] = []
    for name, spec, backbone in order:
        for lam in (lambdas if "{lambda}" in name else [None]):
            values = {"backbone": backbone, "lambda": f"{lam:g}" if lam is not None else None,
                      "drafters": str(drafters)}
            full = _fill(name, values)
            if isinstance(spec, str):
                entry = _fill(spec, values)
            elif isinstance(spec, dict):
                entry = {k: ({m: _fill(str(d), values) for m, d in v.items()}
                             if k == "drafters" and isinstance(v, dict) else v) for k, v in spec.items()}
            else:
                entry = spec
            if "{" in full or (isinstance(entry, str) and "{" in entry):
                raise StudyConfigError(f"{where}: variant {name!r} has a placeholder that is not "
                                       "{backbone}, {lambda} or {drafters}")
            try:
                out.append(variant_from_config(full, entry, where))
            except VariantSpecError as err:
                raise StudyConfigError(str(err)) from None
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise StudyConfigError(f"{where}: variant names repeat after expansion: {', '.join(dup)}")
    return out


def study_from_dict(config: dict, source: str = "<dict>", data_dir: str | None = None) -> Study:
    top = _check_keys(source, config, {"name", "out", "data_dir", "target", "drafters", "backbones", "lambdas",
                                       "variants", "eval"})
    for key in ("name", "out", "target", "drafters", "variants"):
        if key not in top:
            raise StudyConfigError(f"{source}: missing key {key!r}")
    target = _check_keys(f"{source}: target", top["target"], {"path"})
    drafters = _check_keys(f"{source}: drafters", top["drafters"], {"out", "recipe", "jobs"})
    jobs = _integer(source, "drafters.jobs", drafters.get("jobs", 1), 1)
    if "path" not in target or "out" not in drafters:
        raise StudyConfigError(f"{source}: target.path and drafters.out are required")
    ev = _check_keys(f"{source}: eval", top.get("eval"), {"bench", "temperatures", "limit", "max_new_tokens", "seed",
                                                          "tree", "top_p", "device", "dtype", "categories", "jobs",
                                                          "acceptance"})
    eval_jobs = _integer(source, "eval.jobs", ev.get("jobs", 1), 1)
    tree = _check_keys(f"{source}: eval.tree", ev.get("tree"), {"total_tokens", "depth", "top_k", "mode"})
    try:  # the same defaults (mode auto: the caps) and checks as --tree, --total-tokens, --depth, --top-k
        speculation = SpeculationConfig.of(**tree)
    except ValueError as err:
        raise StudyConfigError(f"{source}: eval.tree.{err}") from None
    temperatures = _numbers(source, "eval.temperatures", ev.get("temperatures", [0.0]))
    max_new_tokens = _integer(source, "eval.max_new_tokens", ev.get("max_new_tokens", 512), 1)
    seed = _integer(source, "eval.seed", ev.get("seed", 0), 0, SEED_LIMIT)
    top_p = _numbers(source, "eval.top_p", ev.get("top_p", 1.0), one=True)[0]
    try:
        acceptance = ev.get("acceptance", "verify")
        settings = EvalSettings(temperatures=tuple(temperatures), max_new_tokens=max_new_tokens, seed=seed,
                                speculation=speculation, top_p=top_p, acceptance=acceptance)
    except (TypeError, ValueError) as err:
        raise StudyConfigError(f"{source}: eval: {err}") from None
    benches = ev.get("bench", ["mt_bench", "gsm8k", "math500", "svamp"])
    if isinstance(benches, str):
        benches = [b.strip() for b in benches.split(",") if b.strip()]
    benches = _strings(source, "eval.bench", benches)
    limit = None if ev.get("limit") is None else _integer(source, "eval.limit", ev["limit"], 1)
    categories = None if ev.get("categories") is None else _strings(source, "eval.categories", ev["categories"])
    variants_cfg = top["variants"]
    if not isinstance(variants_cfg, dict) or not variants_cfg:
        raise StudyConfigError(f"{source}: variants must be a non-empty mapping NAME: SPEC")
    drafters_dir = Path(drafters["out"])
    lambdas = _numbers(source, "lambdas", top.get("lambdas", []))
    if not all(0.0 <= lam <= 1.0 for lam in lambdas):
        raise StudyConfigError(f"{source}: lambdas must be numbers in [0, 1], got {top['lambdas']!r}")
    backbones = _strings(source, "backbones", top.get("backbones", ["eagle2", "hass"]))
    variants = expand_variants(variants_cfg, backbones, lambdas, drafters_dir, f"{source}: variants")
    recipe = _recipe_fields(f"{source}: drafters.recipe", drafters.get("recipe"), DrafterRecipe)
    if recipe is not None:  # the heads trained are those the variants name, unless the recipe says otherwise
        recipe.setdefault("backbones", list(backbones))
        if recipe.get("xl") is not None:
            xl = _check_keys(f"{source}: drafters.recipe.xl", recipe["xl"], set(XlRecipe.__dataclass_fields__))
            recipe["xl"] = dict(xl)
    return Study(name=str(top["name"]), out=Path(top["out"]), target=Path(target["path"]), drafters=drafters_dir,
                 variants=variants, benches=list(benches), settings=settings,
                 data_dir=data_dir or top.get("data_dir") or os.environ.get("TAPS_DATA_DIR"),
                 drafter_recipe=recipe,
                 drafter_jobs=jobs,
                 limit=limit, categories=categories, device=str(ev.get("device", "auto")),
                 dtype=str(ev.get("dtype", "auto")), eval_jobs=eval_jobs, source=source)


def load_study(path: str | Path, data_dir: str | None = None) -> Study:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"study config {path} does not exist")
    text = decode_utf8(path.read_bytes(), path, StudyConfigError)
    if "\x00" in text:
        raise StudyConfigError(f"{path}: a binary file (NUL bytes); expected a YAML study config")
    try:
        loader = UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            config = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise StudyConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    return study_from_dict(config, str(path), data_dir)


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error naming it and its line
    (PyYAML keeps the last silently: a study would run with half of what its author wrote)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: PyYAML's own error names it
            if key in seen:
                raise StudyConfigError(f"{self.name}: line {line}: key {key!r} given twice (first at line "
                                       f"{seen[key]}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def plan(study: Study, stages: tuple[str, ...] = STAGES) -> list[str]:
    """What run_study would do, stage by stage, and what it would skip (the dry run)."""
    lines = [f"study {study.name} ({study.source}) -> {study.out}"]
    if "target" in stages:
        if target_exists(study):
            lines.append(f"target: {study.target} exists, used as is")
        else:
            lines.append(f"target: {study.target} is MISSING (a model directory, a .gguf file or a known name)")
    if "drafters" in stages:
        if study.drafter_recipe is not None:
            lines.append(f"drafters: train into {study.drafters} (resumable; finished heads skipped): "
                         f"{study.drafter_recipe}")
        else:
            lines.append(f"drafters: use the heads in {study.drafters}")
    if "eval" in stages:
        lines.append(f"eval: {len(study.variants)} variants x {', '.join(study.benches)} x temperatures "
                     f"{', '.join(f'{t:g}' for t in study.settings.temperatures)}"
                     f" (limit {study.limit or 'none'}, max_new_tokens {study.settings.max_new_tokens}, tree "
                     f"{study.settings.speculation.describe()})"
                     f" -> {study.results}")
        for v in study.variants:
            members = ", ".join(f"{n}={d}" for n, d in v.drafters)
            lines.append(f"  {v.name}: {v.strategy}" + (f" [{members}]" if members else ""))
    if "report" in stages:
        lines.append(f"report: tables and figures -> {study.report}")
    return lines


def run_study(study: Study, stages: tuple[str, ...] = STAGES, progress: bool = True) -> Path:
    """Run the requested stages in order; returns the report directory."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}; expected {', '.join(STAGES)}")
    if "target" in stages:
        if not target_exists(study):
            raise FileNotFoundError(f"{study.source}: target {study.target} does not exist: name a model directory, "
                                    "a .gguf file or a known name")
        resolve_target(str(study.target))  # a GGUF target is converted into the cache once, here
    if "drafters" in stages and study.drafter_recipe is not None:
        recipe = DrafterRecipe(data_dir=study.data_dir, **{k: tuple(v) if isinstance(v, list) else v
                                                         for k, v in study.drafter_recipe.items()})
        build_drafters(recipe, study.target, study.drafters, study.work / "drafters", jobs=study.drafter_jobs)
    if "eval" in stages:
        questions = load_questions(study.benches, study.data_dir, study.limit, study.categories)
        eval_benchmarks(TargetRef(str(study.target), study.device, study.dtype), study.variants, questions,
                        study.results, study.settings, study.eval_jobs, progress)
    if "report" in stages:
        report.write_report(study.results, study.report)
    return study.report


def _embedded(models: str | Path) -> Path:
    """The embedded default: as given, else (for the default relative path) beside the package's repo."""
    models = Path(models)
    if models.is_dir() or models.is_absolute():
        return models
    beside_repo = Path(__file__).resolve().parents[2] / models
    return beside_repo if beside_repo.is_dir() else models


@dataclass(frozen=True)
class DemoSettings:
    """What `taps demo` may change about the study it runs, in one object because it passes
    unchanged from the command line through run_demo into demo_study's config."""

    per_bench: int = 1  # questions per benchmark
    max_new_tokens: int = 96  # answer length cap per turn
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)  # the tree mode and shape
    dtype: str = "auto"  # the target's and heads' dtype
    jobs: int = 1  # evaluation worker processes
    # Table 1 read along the target's own greedy answers, no tree verified (core/replay.py): on a CPU the
    # paper's 60-node trees are most of a verified demo (16.4 against 3.2 min on an AMD EPYC without AMX)
    acceptance: str = "replay"


def demo_study(models: str | Path, out: str | Path, data_dir: str | None, settings: DemoSettings = DemoSettings(),
               lambdas: tuple[float, ...] = (0.25, 0.75)) -> Study:
    """`taps demo`: every variant of every backbone whose math and chat drafters are shipped (those
    naming a head not shipped left out), plus the baseline,
    the extra merges and a small averaging sweep (with "averaged" at 0.5, three points of Figure 6),
    on a few questions of each benchmark at temperature 0."""
    models = _embedded(models)
    target, drafters = models / "target", models / "drafters"
    if not (target / "config.json").is_file():
        if models.name not in KNOWN_TARGETS:
            raise FileNotFoundError(f"{target}: no embedded target here; pass --models DIR (with drafters/, and "
                                    f"target/ unless DIR is named after a known target: {', '.join(KNOWN_TARGETS)})")
        target = Path(models.name)  # e.g. models/smollm2-135m-instruct: the installed package's GGUF file
    missing = {b: [d for d in DOMAINS if not (drafters / f"{b}-{d}" / "model.safetensors").is_file()] for b in BACKBONES}
    # a backbone takes part once its two specialists are shipped (every composition pairs them);
    # variants naming one of its heads that is not shipped yet are left out and said so
    backbones = [b for b in BACKBONES if not {"math", "chat"} & set(missing[b])]
    for b in BACKBONES:
        if missing[b] and (backbones or b in backbones):
            kept = "its variants without them kept" if b in backbones else "left out"
            print(f"taps demo: {b}: {drafters} lacks {', '.join(f'{b}-{d}' for d in missing[b])}; {kept}")
    if not backbones:
        raise FileNotFoundError(f"{drafters}: no backbone with both specialists (math and chat); "
                                f"train them with `taps reproduce` (a config with drafters.recipe, e.g. "
                                f"configs/smollm2.yaml)")
    config = {"name": "demo", "out": str(out), "target": {"path": str(target)}, "drafters": {"out": str(drafters)},
              "backbones": backbones, "lambdas": list(lambdas),
              "variants": {**PAPER_VARIANTS, **EXTRA_VARIANTS, **SWEEP_VARIANTS},
              "eval": {"bench": ["mt_bench", "gsm8k", "math500", "svamp"], "temperatures": [0.0],
                       "limit": settings.per_bench, "max_new_tokens": settings.max_new_tokens, "dtype": settings.dtype,
                       "jobs": settings.jobs, "tree": settings.speculation.as_config(),
                       "acceptance": settings.acceptance}}
    study = study_from_dict(config, "taps demo", data_dir)
    absent = {str(drafters / f"{b}-{d}") for b in backbones for d in missing[b]}
    study.variants = [v for v in study.variants if not absent & {path for _, path in v.drafters}]
    return study


def parse_stages(text: str) -> tuple[str, ...]:
    """`--stages`: a comma-separated subset of STAGES."""
    stages = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise ValueError(f"--stages {text!r}: unknown stage(s) {', '.join(unknown) or '(none given)'}; "
                         f"expected a comma-separated subset of {', '.join(STAGES)}")
    return stages


def reproduce(config: str | Path, stages: str = ",".join(STAGES), data_dir: str | None = None,
              dry_run: bool = False, progress: bool = True, echo: Callable[[str], None] = print) -> None:
    """`taps reproduce`: the plan of a study config (echoed first), then its stages."""
    chosen = parse_stages(stages)
    study = load_study(config, data_dir)
    echo("\n".join(plan(study, chosen)))
    if not dry_run:
        echo(f"taps reproduce: report in {run_study(study, chosen, progress=progress) / 'report.md'}")


def run_demo(models: str | Path, out: str | Path = DEMO_OUT, data_dir: str | None = None,
             settings: DemoSettings = DemoSettings(), progress: bool = True,
             echo: Callable[[str], None] = print) -> None:
    """`taps demo`: demo_study, evaluated and reported, then the terminal summary. In the default
    directory, results of an earlier embedded default (other target or drafter weights) or of the
    other acceptance measurement are moved aside, kept, and the demo starts afresh: `make demo` after
    a new default shipped still just works."""
    study = demo_study(models, out, data_dir, settings)
    echo(f"taps demo: {len(study.variants)} variants x {', '.join(study.benches)} ({settings.per_bench} questions "
         f"each, temperature 0, tree {settings.speculation.describe()}) on {study.target}")
    try:
        report_dir = run_study(study, ("eval", "report"), progress=progress)
    except ResultsMismatchError as e:
        if str(out) != DEMO_OUT or e.key not in NEW_DEFAULT_KEYS:
            raise
        aside = Path(f"{out}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(out, aside)
        echo(f"taps demo: {out} holds results of another embedded default or measurement ({e.key} differs); moved "
             f"them to {aside}, starting afresh")
        report_dir = run_study(study, ("eval", "report"), progress=progress)
    echo(report.terminal_summary(study.results))
    echo(f"\nfull report: {report_dir / 'report.md'}")
