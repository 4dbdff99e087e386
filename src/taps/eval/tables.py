"""The study's tables, from records and run.json only (`taps report`, `taps demo`'s summary).

Every number comes from taps.eval.metrics (docs/spec.md §5), so the report, the tests and a notebook agree.
Each table is written three ways: Markdown to read, CSV with raw numbers to re-plot elsewhere, and
LaTeX (booktabs) for a paper. A table without rows was skipped, and its notes say why. The
figures (eval/figures.py) read the same `Run`.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from taps.eval import metrics as m
from taps.eval.runner import RUN_INFO
from taps.core.jsonl import read_json

BENCH_ORDER = ("mt_bench", "gsm8k", "math500", "svamp")  # the paper's column order; others follow
BACKBONES = ("eagle2", "hass", "eagle3")  # name prefixes (study.PAPER_VARIANTS) that group the entropy figure
SPEED_NOTE = ("Speedups are ratios measured side by side in one run (each question is decoded by every variant "
              "in turn, the baseline included); absolute tokens/s depend on the machine and are not comparable "
              "across machines.")
REPLAY_NOTE = ("Acceptance was replayed (`--acceptance replay`): every drafted tree was walked along the target's "
               "own greedy answer, none verified, so no speed was measured; `--acceptance verify` verifies every "
               "tree and measures speed.")
SPEED_KEYS = ("tokens_per_second", "speedup")
Cell = str | int | float | None


# ---- tables --------------------------------------------------------------------------------------
def _missing(value: Cell) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    """Variant and bench names (hass_math, 90%) must not break the LaTeX build."""
    return "".join(LATEX_SPECIAL.get(ch, ch) for ch in text)


@dataclass
class Table:
    """A header and rows of raw cells (text, int, float; None or nan = missing), rendered three ways.
    A table without rows was skipped, and its notes say why."""
    name: str
    title: str
    header: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    digits: dict[int, int] = field(default_factory=dict)  # decimals of a float column (default 2)
    bold: set[tuple[int, int]] = field(default_factory=set)  # (row, column) cells to emphasise
    breaks: list[int] = field(default_factory=list)  # rows that start a block (a LaTeX midrule)
    caption: str = ""
    notes: list[str] = field(default_factory=list)

    def _text(self, i: int, j: int, missing: str) -> str:
        value = self.rows[i][j]
        if _missing(value):
            return missing
        return f"{value:.{self.digits.get(j, 2)}f}" if isinstance(value, float) else str(value)

    def _is_text(self, j: int) -> bool:
        return any(isinstance(row[j], str) for row in self.rows)

    def to_markdown(self) -> str:
        def esc(text: str) -> str:
            return text.replace("|", r"\|")
        lines = ["| " + " | ".join(esc(h) for h in self.header) + " |",
                 "| " + " | ".join("---" if self._is_text(j) else "---:" for j in range(len(self.header))) + " |"]
        for i, row in enumerate(self.rows):
            cells = [esc(self._text(i, j, "–")) for j in range(len(row))]
            lines.append("| " + " | ".join(f"**{c}**" if (i, j) in self.bold else c for j, c in enumerate(cells))
                         + " |")
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.header)
        writer.writerows(["" if _missing(v) else v for v in row] for row in self.rows)  # str(float) round-trips
        return buf.getvalue()

    def to_latex(self) -> str:
        align = "".join("l" if self._is_text(j) else "r" for j in range(len(self.header)))
        lines = [rf"\begin{{tabular}}{{{align}}}", r"\toprule", " & ".join(map(latex_escape, self.header)) + r" \\",
                 r"\midrule"]
        for i, row in enumerate(self.rows):
            if i and i in self.breaks:
                lines.append(r"\midrule")
            cells = [latex_escape(self._text(i, j, "--")) for j in range(len(row))]
            lines.append(" & ".join(rf"\textbf{{{c}}}" if (i, j) in self.bold else c for j, c in enumerate(cells))
                         + r" \\")
        return "\n".join(lines + [r"\bottomrule", r"\end{tabular}"]) + "\n"

    def write(self, out_dir: Path) -> None:
        (out_dir / f"{self.name}.md").write_text(f"## {self.title}\n\n{self.to_markdown()}", encoding="utf-8")
        (out_dir / f"{self.name}.csv").write_text(self.to_csv(), encoding="utf-8")
        (out_dir / f"{self.name}.tex").write_text(self.to_latex(), encoding="utf-8")


# ---- the run -------------------------------------------------------------------------------------
class Run:
    """A results directory: run.json (what each variant was) and its records, indexed for the tables."""

    def __init__(self, path: Path, info: dict, records: list[dict]):
        self.path, self.info, self.records = path, info, records
        self._by: dict[tuple[str, str, float], list[dict]] = defaultdict(list)
        for r in records:
            self._by[(r["variant"], r["bench"], float(r["temperature"]))].append(r)
        seen = {r["variant"] for r in records}
        ordered = [v for v in info.get("variants", {}) if v in seen] + sorted(seen - set(info.get("variants", {})))
        self.baselines = [v for v in ordered if self.strategy(v) == "baseline"]
        self.variants = self.baselines + [v for v in ordered if v not in self.baselines]
        self.baseline = self.baselines[0] if self.baselines else None
        self.drafted = [v for v in self.variants if v not in self.baselines]
        benches = {r["bench"] for r in records}
        self.benches = [b for b in BENCH_ORDER if b in benches] + sorted(benches - set(BENCH_ORDER))
        self.temperatures = sorted({float(r["temperature"]) for r in records})
        self.replayed = info.get("acceptance") == "replay"  # no drafted tree was verified: no speed measured
        self.summary = self._summary()

    def spec(self, variant: str) -> dict:
        return self.info.get("variants", {}).get(variant, {})

    def strategy(self, variant: str) -> str:
        return self.spec(variant).get("strategy") or ("baseline" if variant == m.BASELINE else "")

    def select(self, variants: str | list[str], bench: str | None = None,
               temperature: float | None = None) -> list[dict]:
        names = [variants] if isinstance(variants, str) else variants
        return [r for (v, b, t), rs in self._by.items() if v in names and bench in (None, b)
                and temperature in (None, t) for r in rs]

    def _summary(self) -> dict[tuple[str, str, float], dict]:
        """metrics.summarize plus the paper's Average, keyed (variant, bench, temperature)."""
        rows = m.summarize(self.records, baseline=self.baseline or m.BASELINE)
        rows = m.add_benchmark_average(rows, benches=self.benches)
        return {(row["variant"], row["bench"], row["temperature"]): row for row in rows}

    def value(self, variant: str, bench: str, temperature: float, key: str) -> float | None:
        if self.replayed and key in SPEED_KEYS:
            return None
        return self.summary.get((variant, bench, temperature), {}).get(key)


def load_run(results_dir: str | Path) -> Run:
    """run.json says what the records mean; without it the directory was not made by `taps eval`."""
    root = Path(results_dir)
    if not (root / RUN_INFO).is_file():
        raise FileNotFoundError(f"{root / RUN_INFO} is missing: {root} was not made by `taps eval` (run.json "
                                "records the target, tree and variants the records were decoded with)")
    info = read_json(root / RUN_INFO, "the run.json of `taps eval` (target, tree and variants of the records)")
    return Run(root, info, m.load_results(root))


def temperature_label(temperature: float) -> str:
    """A temperature as the tables and figures write it (0, 1, 0.7)."""
    return f"{temperature:g}"


def resolved_dir(path: str) -> str:
    """A drafter directory as one spelling, so two variants of the same head compare equal."""
    return str(Path(path).resolve())


def backbone_of(variant: str) -> str | None:
    """The backbone a variant's name starts with (eagle2-..., hass-...), or None."""
    return next((b for b in BACKBONES if variant.startswith(b + "-")), None)


# ---- the five tables -----------------------------------------------------------------------------
def table1(run: Run) -> Table:
    """Paper Table 1: pooled acceptance length per variant x benchmark, the best of each column (within
    a temperature) in bold."""
    table = Table("table1", "Table 1: acceptance length (pooled new tokens / verifier calls)",
                  ["variant", "T", *run.benches, "Average"],
                  caption="Average: the unweighted mean over benchmarks (each counts once); best per column in bold.")
    for t in run.temperatures:
        block = [[v, temperature_label(t), *(run.value(v, b, t, "acceptance_length") for b in [*run.benches, m.AVERAGE])]
                 for v in run.variants if run.select(v, temperature=t)]
        start = len(table.rows)
        table.breaks.append(start)
        for j in range(2, len(table.header)):
            best = max((row[j] for row in block if not _missing(row[j])), default=None)
            table.bold |= {(start + i, j) for i, row in enumerate(block) if best is not None and row[j] == best}
        table.rows += block
    return table


def singles_by_dir(run: Run) -> dict[str, str]:
    """Resolved drafter dir -> the first single-head variant (with records) that decodes it."""
    singles: dict[str, str] = {}
    for v in run.drafted:
        if run.strategy(v) == "single" and run.select(v):
            singles.setdefault(resolved_dir(run.spec(v)["drafters"][0][1]), v)
    return singles


def table2(run: Run) -> Table:
    """Paper Table 2: which member each selector picks, per benchmark. Post hoc (per question, over the
    members' own single-head generations, as the paper counts) and causal (what the routed variant did)."""
    table = Table("table2", "Table 2: routing shares per benchmark", [])
    routed = [v for v in run.drafted if run.strategy(v) == "route"]
    if not routed:
        table.notes.append("Table 2 skipped: the run has no routed variant.")
        return table
    singles = singles_by_dir(run)
    groups: dict[tuple, list[str]] = defaultdict(list)  # members (name, dir) -> their routed variants
    for v in routed:
        groups[tuple((n, resolved_dir(d)) for n, d in run.spec(v)["drafters"])].append(v)
    members = list(dict.fromkeys(n for key in groups for n, _ in key))
    table.header = ["heads", "T", "bench", "selector", "n", *members]
    table.digits = {5 + j: 3 for j in range(len(members))}
    table.caption = ("Shares of the decisions per head. Post hoc: per question, the head whose whole single-head "
                     "generation scores best (n = questions); causal: the routed variant's own decisions "
                     "(n = steps, or turns for per-turn routing).")

    def add(label: str, t: float, bench: str, selector: str, n: int, shares: dict[str, float]) -> None:
        table.rows.append([label, temperature_label(t), bench, selector, n, *(shares.get(k) for k in members)])

    for key, variants in groups.items():
        names = [n for n, _ in key]
        heads = {n: singles.get(d) for n, d in key}
        # members by their single variants' names when known: "eagle2-math vs eagle2-chat" tells the
        # backbones apart, where the member names ("math vs chat") repeat across them
        label = " vs ".join(heads[n] or n for n in names)
        lacking = [n for n, s in heads.items() if s is None]
        if lacking:
            table.notes.append(f"Table 2: no single-head records of {', '.join(lacking)} (members of "
                               f"{', '.join(variants)}), so no post hoc shares for them.")
        for t in run.temperatures:
            for bench in run.benches:
                for signal in m.TREE_SIGNALS if not lacking else ():
                    by_head = {n: run.select(heads[n], bench, t) for n in names}
                    try:
                        n = len(m.posthoc_decisions(by_head, signal))
                        add(label, t, bench, f"{signal} (post hoc)", n, m.posthoc_routing(by_head, signal))
                    except ValueError as err:
                        table.notes.append(f"Table 2 ({label}, {bench}, T={temperature_label(t)}, {signal}): {err}")
                for v in (v for v in variants if run.select(v, bench, t)):
                    records, per_turn = run.select(v, bench, t), run.spec(v).get("granularity") == "turn"
                    try:
                        counts = (m.turn_routing_counts if per_turn else m.routing_counts)(records)
                        shares = (m.turn_routing_shares if per_turn else m.routing_shares)(records, names)
                    except ValueError as err:
                        table.notes.append(f"Table 2 ({v}, {bench}, T={temperature_label(t)}): {err}")
                        continue
                    add(label, t, bench, f"{v} (causal, per {'turn' if per_turn else 'step'})",
                        sum(counts.values()), shares)
    if not table.rows:
        table.notes.append("Table 2 skipped: no routing decisions or single-head records of the routed members.")
    return table


ENTROPY_KEYS = ("draft_entropy_accepted", "draft_entropy_rejected", "verifier_entropy_accepted",
                "verifier_entropy_rejected", "n_draft_accepted", "n_draft_rejected", "n_verifier_accepted",
                "n_verifier_rejected")


def entropy_table(run: Run) -> Table:
    """Rejected tokens should carry higher entropy (paper Figure 7), for the drafter and the target."""
    table = Table("entropy", "Accepted vs rejected entropy (nats), pooled over benchmarks",
                  ["variant", "T", "draft acc", "draft rej", "verifier acc", "verifier rej", "n draft acc",
                   "n draft rej", "n verifier acc", "n verifier rej"],
                  caption="Draft: the head's entropy at accepted-path nodes vs every other node; verifier: the "
                          "target's entropy on the accepted path vs the first rejected position; n: counts.")
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.drafted:
            if records := run.select(v, temperature=t):
                summary = m.entropy_summary(records)
                table.rows.append([v, temperature_label(t), *(summary[k] for k in ENTROPY_KEYS)])
    if not table.rows:
        table.notes.append("Entropy table skipped: the run has no drafted variant.")
    return table


def tree_depth(run: Run) -> int:
    """The run's tree depth (run.json), the last alpha_d a table or figure shows."""
    return int(run.info.get("tree", {}).get("depth", 5))


def depth_table(run: Run) -> Table:
    """Acceptance falls with depth (paper Figure 8): alpha_d, the conditional rate of the d-th token."""
    depth = tree_depth(run)
    table = Table("depth", "Acceptance by depth (alpha_d, pooled over benchmarks)",
                  ["variant", "T", *(f"alpha_{d}" for d in range(1, depth + 1))],
                  digits={2 + d: 3 for d in range(depth)},
                  caption="alpha_d = steps accepting >= d draft tokens / steps accepting >= d-1.")
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.drafted:
            if records := run.select(v, temperature=t):
                table.rows.append([v, temperature_label(t), *m.acceptance_by_depth(records, depth)])
    if not table.rows:
        table.notes.append("Depth table skipped: the run has no drafted variant.")
    return table


def speed_caption(run: Run) -> str:
    """SPEED_NOTE, and how the run's trees were sized: with the paper's fixed trees a CPU can decode
    slower than plain decoding (a 60-node tree forward costs 3.4x a one-token one on an AMD EPYC
    without AMX, docs/long-context.md), and a reader of the table should know the speed TAPS gives
    there comes from cost-sized trees."""
    if run.replayed:
        return ""
    if run.info.get("tree_mode") == "auto":
        return (f"{SPEED_NOTE} Each step's tree was sized from this machine's measured costs "
                f"(`--tree auto`).")
    tree = run.info.get("tree") or {}
    if not tree:
        return SPEED_NOTE
    return (f"{SPEED_NOTE} Every drafted step verified the same fixed tree ({tree.get('total_tokens')} tokens, "
            f"{tree.get('depth')} levels, {tree.get('top_k')} wide: the paper's shape for Table 1); where such a "
            f"forward costs several one-token forwards (a 60-node tree on a CPU without AMX) it can cost more than "
            f"its accepted tokens save. `--tree auto` sizes each step from this machine's measured costs "
            f"(`taps profile`, docs/benchmarks.md).")


def speedup_table(run: Run) -> Table:
    """Wall-clock throughput and speedup over plain decoding (the paper measured none)."""
    table = Table("speedup", "Throughput and speedup over the baseline",
                  ["variant", "T", "bench", "questions", "tokens/s", "speedup"], caption=speed_caption(run))
    if run.replayed:
        table.notes.append(REPLAY_NOTE)
        return table
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.variants:
            for bench in [*run.benches, m.AVERAGE]:
                row = run.summary.get((v, bench, t))
                if row:
                    table.rows.append([v, temperature_label(t), "Average" if bench == m.AVERAGE else bench, row["questions"],
                                       row["tokens_per_second"], row["speedup"]])
    if run.baseline is None:
        table.notes.append("No baseline variant in this run: speedups are missing (add NAME=baseline).")
    return table


def speedup_overview(run: Run) -> Table:
    """The speedup table pivoted to one row per variant (speedup per benchmark, their mean, and
    tokens/s averaged over benchmarks): what a terminal has room for."""
    table = Table("speedup_overview", "Speedup over the baseline (wall clock, same run)",
                  ["variant", "T", *run.benches, "Average", "tokens/s"], caption=speed_caption(run))
    if run.replayed:
        table.notes.append(REPLAY_NOTE)
        return table
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.variants:
            cells = [run.value(v, b, t, "speedup") for b in [*run.benches, m.AVERAGE]]
            if any(c is not None for c in cells):
                table.rows.append([v, temperature_label(t), *cells, run.value(v, m.AVERAGE, t, "tokens_per_second")])
    if run.baseline is None:
        table.notes.append("No baseline variant in this run: speedups are missing (add NAME=baseline).")
    return table
