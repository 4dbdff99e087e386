"""`taps report RESULTS_DIR --out DIR`: the study's tables and figures, from records and run.json only.

Every number comes from taps.eval.metrics (docs/spec.md §5), so the report, the tests and a notebook agree.
Each table is written three ways: Markdown to read, CSV with raw numbers to re-plot elsewhere, and
LaTeX (booktabs) for a paper. report.md puts them together with the figures and says what was
skipped and why, so a gap is never silent.
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
from taps.core.outputs import check_output_dir

BENCH_ORDER = ("mt_bench", "gsm8k", "math500", "svamp")  # the paper's column order; others follow
BACKBONES = ("eagle2", "hass")  # name prefixes (study.PAPER_VARIANTS) that group the entropy figure
SPEED_NOTE = ("Speedups are ratios measured side by side in one run (each question is decoded by every variant "
              "in turn, the baseline included); absolute tokens/s depend on the machine and are not comparable "
              "across machines.")
Cell = str | int | float | None


class ReportError(ValueError):
    pass


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
        return self.summary.get((variant, bench, temperature), {}).get(key)


def load_run(results_dir: str | Path) -> Run:
    """run.json says what the records mean; without it the directory was not made by `taps eval`."""
    root = Path(results_dir)
    if not (root / RUN_INFO).is_file():
        raise FileNotFoundError(f"{root / RUN_INFO} is missing: {root} was not made by `taps eval` (run.json "
                                "records the target, tree and variants the records were decoded with)")
    info = read_json(root / RUN_INFO, "the run.json of `taps eval` (target, tree and variants of the records)")
    return Run(root, info, m.load_results(root))


def _t(temperature: float) -> str:
    return f"{temperature:g}"


def _resolve(path: str) -> str:
    return str(Path(path).resolve())


def _backbone(variant: str) -> str | None:
    return next((b for b in BACKBONES if variant.startswith(b + "-")), None)


# ---- the five tables -----------------------------------------------------------------------------
def table1(run: Run) -> Table:
    """Paper Table 1: pooled acceptance length per variant x benchmark, the best of each column (within
    a temperature) in bold."""
    table = Table("table1", "Table 1: acceptance length (pooled new tokens / verifier calls)",
                  ["variant", "T", *run.benches, "Average"],
                  caption="Average: the unweighted mean over benchmarks (each counts once); best per column in bold.")
    for t in run.temperatures:
        block = [[v, _t(t), *(run.value(v, b, t, "acceptance_length") for b in [*run.benches, m.AVERAGE])]
                 for v in run.variants if run.select(v, temperature=t)]
        start = len(table.rows)
        table.breaks.append(start)
        for j in range(2, len(table.header)):
            best = max((row[j] for row in block if not _missing(row[j])), default=None)
            table.bold |= {(start + i, j) for i, row in enumerate(block) if best is not None and row[j] == best}
        table.rows += block
    return table


def _singles_by_dir(run: Run) -> dict[str, str]:
    """Resolved drafter dir -> the first single-head variant (with records) that decodes it."""
    singles: dict[str, str] = {}
    for v in run.drafted:
        if run.strategy(v) == "single" and run.select(v):
            singles.setdefault(_resolve(run.spec(v)["drafters"][0][1]), v)
    return singles


def table2(run: Run) -> Table:
    """Paper Table 2: which member each selector picks, per benchmark. Post hoc (per question, over the
    members' own single-head generations, as the paper counts) and causal (what the routed variant did)."""
    table = Table("table2", "Table 2: routing shares per benchmark", [])
    routed = [v for v in run.drafted if run.strategy(v) == "route"]
    if not routed:
        table.notes.append("Table 2 skipped: the run has no routed variant.")
        return table
    singles = _singles_by_dir(run)
    groups: dict[tuple, list[str]] = defaultdict(list)  # members (name, dir) -> their routed variants
    for v in routed:
        groups[tuple((n, _resolve(d)) for n, d in run.spec(v)["drafters"])].append(v)
    members = list(dict.fromkeys(n for key in groups for n, _ in key))
    table.header = ["heads", "T", "bench", "selector", "n", *members]
    table.digits = {5 + j: 3 for j in range(len(members))}
    table.caption = ("Shares of the decisions per head. Post hoc: per question, the head whose whole single-head "
                     "generation scores best (n = questions); causal: the routed variant's own decisions "
                     "(n = steps, or turns for per-turn routing).")

    def add(label: str, t: float, bench: str, selector: str, n: int, shares: dict[str, float]) -> None:
        table.rows.append([label, _t(t), bench, selector, n, *(shares.get(k) for k in members)])

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
                        table.notes.append(f"Table 2 ({label}, {bench}, T={_t(t)}, {signal}): {err}")
                for v in (v for v in variants if run.select(v, bench, t)):
                    records, per_turn = run.select(v, bench, t), run.spec(v).get("granularity") == "turn"
                    try:
                        counts = (m.turn_routing_counts if per_turn else m.routing_counts)(records)
                        shares = (m.turn_routing_shares if per_turn else m.routing_shares)(records, names)
                    except ValueError as err:
                        table.notes.append(f"Table 2 ({v}, {bench}, T={_t(t)}): {err}")
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
                table.rows.append([v, _t(t), *(summary[k] for k in ENTROPY_KEYS)])
    if not table.rows:
        table.notes.append("Entropy table skipped: the run has no drafted variant.")
    return table


def _depth(run: Run) -> int:
    return int(run.info.get("tree", {}).get("depth", 5))


def depth_table(run: Run) -> Table:
    """Acceptance falls with depth (paper Figure 8): alpha_d, the conditional rate of the d-th token."""
    depth = _depth(run)
    table = Table("depth", "Acceptance by depth (alpha_d, pooled over benchmarks)",
                  ["variant", "T", *(f"alpha_{d}" for d in range(1, depth + 1))],
                  digits={2 + d: 3 for d in range(depth)},
                  caption="alpha_d = steps accepting >= d draft tokens / steps accepting >= d-1.")
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.drafted:
            if records := run.select(v, temperature=t):
                table.rows.append([v, _t(t), *m.acceptance_by_depth(records, depth)])
    if not table.rows:
        table.notes.append("Depth table skipped: the run has no drafted variant.")
    return table


def speedup_table(run: Run) -> Table:
    """Wall-clock throughput and speedup over plain decoding (the paper measured none)."""
    table = Table("speedup", "Throughput and speedup over the baseline",
                  ["variant", "T", "bench", "questions", "tokens/s", "speedup"], caption=SPEED_NOTE)
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.variants:
            for bench in [*run.benches, m.AVERAGE]:
                row = run.summary.get((v, bench, t))
                if row:
                    table.rows.append([v, _t(t), "Average" if bench == m.AVERAGE else bench, row["questions"],
                                       row["tokens_per_second"], row["speedup"]])
    if run.baseline is None:
        table.notes.append("No baseline variant in this run: speedups are missing (add NAME=baseline).")
    return table


def speedup_overview(run: Run) -> Table:
    """The speedup table pivoted to one row per variant (speedup per benchmark, their mean, and
    tokens/s averaged over benchmarks): what a terminal has room for."""
    table = Table("speedup_overview", "Speedup over the baseline (wall clock, same run)",
                  ["variant", "T", *run.benches, "Average", "tokens/s"], caption=SPEED_NOTE)
    for t in run.temperatures:
        table.breaks.append(len(table.rows))
        for v in run.variants:
            cells = [run.value(v, b, t, "speedup") for b in [*run.benches, m.AVERAGE]]
            if any(c is not None for c in cells):
                table.rows.append([v, _t(t), *cells, run.value(v, m.AVERAGE, t, "tokens_per_second")])
    if run.baseline is None:
        table.notes.append("No baseline variant in this run: speedups are missing (add NAME=baseline).")
    return table


# ---- figures -------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("the report's figures need matplotlib: pip install 'taps[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, run: Run, ylabel: str, xlabel: str):
    fig, axes = plt.subplots(1, len(run.temperatures), figsize=(5.2 * len(run.temperatures), 3.8), squeeze=False)
    for ax, t in zip(axes[0], run.temperatures):
        ax.set(title=f"T = {_t(t)}", xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    return fig, list(zip(axes[0], run.temperatures))


def _save(plt, fig, path: Path) -> None:
    for ax in fig.axes:
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def lambda_sweeps(run: Run) -> list[list[tuple[float, str]]]:
    """Paper Figure 6's lines: per pair of members, (lambda, variant) sorted by lambda over every
    average of that pair. The members' own single-head variants, when the run has them, are the end
    points (lambda 1: the first member, 0: the second), so the line shows whether any average beats
    the heads it mixes. Pairs with fewer than two distinct lambdas are left out."""
    sweeps: dict[tuple, list[tuple[float, str]]] = defaultdict(list)
    for v in run.drafted:
        spec = run.spec(v)
        if spec.get("strategy") == "average" and len(spec.get("drafters", [])) == 2:
            lam = spec["weights"][0] if spec.get("weights") else 0.5
            sweeps[tuple(_resolve(d) for _, d in spec["drafters"])].append((lam, v))
    singles = _singles_by_dir(run)
    for (first, second), sweep in sweeps.items():
        sweep += [(lam, singles[d]) for lam, d in ((1.0, first), (0.0, second)) if d in singles]
    return [sorted(s) for s in sweeps.values() if len({lam for lam, _ in s}) >= 2]


def fig_lambda_sweep(run: Run, path: Path) -> str | None:
    """Paper Figure 6: acceptance length vs lambda (lambda_sweeps), a panel per temperature."""
    sweeps = lambda_sweeps(run)
    if not sweeps:
        return ("Figure 6 (lambda sweep) skipped: no two members averaged at two or more lambdas (counting "
                "their single-head variants as lambda 1 and 0).")
    plt = _pyplot()
    fig, panels = _panels(plt, run, "acceptance length", "λ (weight of the first member; 0, 1: a member alone)")
    for ax, t in panels:
        for i, sweep in enumerate(sweeps):  # a line style per sweep, a colour per benchmark
            names = [v for _, v in sweep if run.strategy(v) == "average"]
            prefixes = {_backbone(v) for v in names}
            label = prefixes.pop() if len(prefixes) == 1 and None not in prefixes else \
                "+".join(n for n, _ in run.spec(names[0])["drafters"])
            for j, bench in enumerate(run.benches):
                points = [(lam, run.value(v, bench, t, "acceptance_length")) for lam, v in sweep]
                points = [(x, y) for x, y in points if y is not None]
                if points:
                    ax.plot(*zip(*points), marker="os^Dv"[i % 5], linestyle=("-", "--", ":", "-.")[i % 4],
                            color=f"C{j % 10}", label=f"{label} {bench}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    _save(plt, fig, path)
    return None


def fig_entropy(run: Run, path: Path) -> str | None:
    """Paper Figure 7: draft-entropy densities of accepted vs rejected nodes."""
    groups: dict[str, list[str]] = defaultdict(list)
    for v in run.drafted:
        groups[_backbone(v) or "drafted variants"].append(v)
    summaries = {(g, t): m.entropy_summary(run.select(vs, temperature=t)) for g, vs in groups.items()
                 for t in run.temperatures}
    if not any(sum(s["hist_accepted"]) + sum(s["hist_rejected"]) for s in summaries.values()):
        return "Figure 7 (entropy histograms) skipped: no traced draft nodes in the records."
    plt = _pyplot()
    fig, panels = _panels(plt, run, "density", "draft entropy (nats)")
    top = 1
    for ax, t in panels:
        for i, g in enumerate(groups):
            s = summaries[(g, t)]
            edges = s["bin_edges"]
            for side, style in (("accepted", "-"), ("rejected", "--")):
                counts = s[f"hist_{side}"]
                total = sum(counts)
                if total:
                    density = [c / (total * (edges[k + 1] - edges[k])) for k, c in enumerate(counts)]
                    ax.stairs(density, edges, color=f"C{i}", linestyle=style, label=f"{g} {side}")
                    top = max(top, max(k for k, c in enumerate(counts) if c) + 2)
    for ax, _ in panels:
        ax.set_xlim(0, edges[min(top, len(edges) - 1)])
    _save(plt, fig, path)
    return None


def fig_depth(run: Run, path: Path) -> str | None:
    """Paper Figure 8: alpha_d vs depth, one line per drafted variant; a row of panels per backbone
    (so a study of two dozen variants stays readable), the legend beside each row."""
    if not run.drafted:
        return "Figure 8 (acceptance by depth) skipped: the run has no drafted variant."
    groups: dict[str, list[str]] = defaultdict(list)
    for v in run.drafted:
        groups[_backbone(v) or "drafted variants"].append(v)
    plt = _pyplot()
    depth = _depth(run)
    cols = len(run.temperatures)
    fig, axes = plt.subplots(len(groups), cols, figsize=(5.2 * cols + 2.4, 3.6 * len(groups)), squeeze=False)
    for row, (group, variants) in zip(axes, groups.items()):
        for ax, t in zip(row, run.temperatures):
            ax.set(title=f"{group}, T = {_t(t)}" if len(groups) > 1 else f"T = {_t(t)}", xlabel="depth d",
                   ylabel="alpha_d (conditional acceptance)", ylim=(0, 1.05), xlim=(0.5, depth + 0.5),
                   xticks=range(1, depth + 1))
            ax.grid(alpha=0.3)
            for i, v in enumerate(variants):  # ten colours, then the same colours dashed
                if records := run.select(v, temperature=t):
                    ax.plot(range(1, depth + 1), m.acceptance_by_depth(records, depth), marker="os^D"[i // 10 % 4],
                            color=f"C{i % 10}", linestyle="-" if i < 10 else "--", label=v)
        row[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    _save(plt, fig, path)
    return None


def fig_speedup(run: Run, path: Path) -> str | None:
    """Speedup per variant: the mean over benchmarks of the per-benchmark speedups (the Average row)."""
    values = {(v, t): run.value(v, m.AVERAGE, t, "speedup") for v in run.drafted for t in run.temperatures}
    if all(s is None for s in values.values()):
        return "Speedup figure skipped: no speedups (the run needs a baseline variant and every benchmark)."
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(run.drafted) + 2), 3.8))
    width = 0.8 / len(run.temperatures)
    for i, t in enumerate(run.temperatures):
        xs = [k + i * width for k in range(len(run.drafted))]
        ax.bar(xs, [values[(v, t)] or math.nan for v in run.drafted], width, label=f"T = {_t(t)}")
    ax.set_xticks([k + width * (len(run.temperatures) - 1) / 2 for k in range(len(run.drafted))], run.drafted,
                  rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(ylabel="speedup over the baseline", title="Speedup (mean over benchmarks)")
    _save(plt, fig, path)
    return None


FIGURES = (("fig_lambda_sweep.png", "Figure 6: acceptance length vs λ", fig_lambda_sweep),
           ("fig_entropy.png", "Figure 7: draft entropy, accepted vs rejected", fig_entropy),
           ("fig_depth.png", "Figure 8: acceptance by depth", fig_depth),
           ("fig_speedup.png", "Speedup over the baseline", fig_speedup))


# ---- the report ----------------------------------------------------------------------------------
def _settings(run: Run) -> str:
    info, tree = run.info, run.info.get("tree", {})
    lines = [f"- target: `{info.get('target', '?')}`",
             "- tree: " + ", ".join(f"{k} {v}" for k, v in tree.items()),
             f"- max_new_tokens {info.get('max_new_tokens')}, seed {info.get('seed')}, top_p {info.get('top_p')}, "
             f"temperatures {', '.join(map(_t, run.temperatures))}", "- variants:"]
    for v in run.variants:
        spec = run.spec(v)
        weights = "/".join(f"{w:g}" for w in spec.get("weights") or [])
        extra = {"route": f"{spec.get('signal')}, per {spec.get('granularity')}", "merge": spec.get("merge_mode"),
                 "average": f"weights {weights or 'equal'}"}.get(spec.get("strategy"))
        members = ", ".join(n for n, _ in spec.get("drafters", []))
        lines.append(f"  - `{v}`: {spec.get('strategy', '?')}" + (f" ({extra})" if extra else "")
                     + (f" of {members}" if members else ""))
    counts = Table("counts", "", ["bench", "questions", "records"],
                   [[b, len({r["question_id"] for r in run.records if r["bench"] == b}),
                     sum(r["bench"] == b for r in run.records)] for b in run.benches])
    return "\n".join(lines) + "\n\nRecords (one per turn, every variant and temperature) per benchmark:\n\n" \
        + counts.to_markdown()


def write_report(results_dir: str | Path, out_dir: str | Path) -> Path:
    """Write every table (md, csv, tex), every figure (PNG) and report.md into out_dir (a new
    directory or a report to redo, never the results or another kind of result: taps.core.outputs)."""
    out = check_output_dir(out_dir, "report", inputs=[("RESULTS_DIR", results_dir)])
    run = load_run(results_dir)
    _pyplot()  # fail before writing anything when the figures cannot be drawn
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# TAPS report: {run.path.name}\n", f"Results: `{run.path}`\n", _settings(run)]
    notes: list[str] = []
    for table in (table1(run), table2(run), entropy_table(run), depth_table(run), speedup_table(run)):
        notes += table.notes
        if table.rows:
            table.write(out)
            parts.append(f"## {table.title}\n\n{table.caption}\n\n{table.to_markdown()}\n"
                         f"[csv]({table.name}.csv) · [tex]({table.name}.tex)\n")
    parts.append("## Figures\n")
    for name, caption, draw in FIGURES:
        note = draw(run, out / name)
        if note:
            notes.append(note)
        else:
            parts.append(f"### {caption}\n\n![{caption}]({name})\n")
    if notes:
        parts.append("## Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    path = out / "report.md"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def terminal_summary(results_dir: str | Path) -> str:
    """Table 1 and the speedup overview as Markdown, for `taps demo` to print."""
    run = load_run(results_dir)
    parts = []
    for table in (table1(run), speedup_overview(run)):
        parts.append(f"{table.title}\n\n{table.to_markdown()}" + (f"\n{table.caption}\n" if table.caption else ""))
        parts += [f"note: {n}\n" for n in table.notes]
    return "\n".join(parts)

