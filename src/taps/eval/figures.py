"""The study's figures (matplotlib, PNG): the paper's Figures 6, 7 and 8 and the speedups, from the
same `Run` the tables read (eval/tables.py). matplotlib (the `report` extra) is imported only when a
figure is drawn.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from taps.eval import metrics as m
from taps.eval.tables import Run, backbone_of, resolved_dir, singles_by_dir, temperature_label, tree_depth


class ReportError(ValueError):
    """The figures cannot be drawn (matplotlib is missing); `taps report` says so before writing anything."""


def pyplot():
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
        ax.set(title=f"T = {temperature_label(t)}", xlabel=xlabel, ylabel=ylabel)
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
            sweeps[tuple(resolved_dir(d) for _, d in spec["drafters"])].append((lam, v))
    singles = singles_by_dir(run)
    for (first, second), sweep in sweeps.items():
        sweep += [(lam, singles[d]) for lam, d in ((1.0, first), (0.0, second)) if d in singles]
    return [sorted(s) for s in sweeps.values() if len({lam for lam, _ in s}) >= 2]


def fig_lambda_sweep(run: Run, path: Path) -> str | None:
    """Paper Figure 6: acceptance length vs lambda (lambda_sweeps), a panel per temperature."""
    sweeps = lambda_sweeps(run)
    if not sweeps:
        return ("Figure 6 (lambda sweep) skipped: no two members averaged at two or more lambdas (counting "
                "their single-head variants as lambda 1 and 0).")
    plt = pyplot()
    fig, panels = _panels(plt, run, "acceptance length", "λ (weight of the first member; 0, 1: a member alone)")
    for ax, t in panels:
        for i, sweep in enumerate(sweeps):  # a line style per sweep, a colour per benchmark
            names = [v for _, v in sweep if run.strategy(v) == "average"]
            prefixes = {backbone_of(v) for v in names}
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
        groups[backbone_of(v) or "drafted variants"].append(v)
    summaries = {(g, t): m.entropy_summary(run.select(vs, temperature=t)) for g, vs in groups.items()
                 for t in run.temperatures}
    if not any(sum(s["hist_accepted"]) + sum(s["hist_rejected"]) for s in summaries.values()):
        return "Figure 7 (entropy histograms) skipped: no traced draft nodes in the records."
    plt = pyplot()
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
        groups[backbone_of(v) or "drafted variants"].append(v)
    plt = pyplot()
    depth = tree_depth(run)
    cols = len(run.temperatures)
    fig, axes = plt.subplots(len(groups), cols, figsize=(5.2 * cols + 2.4, 3.6 * len(groups)), squeeze=False)
    for row, (group, variants) in zip(axes, groups.items()):
        for ax, t in zip(row, run.temperatures):
            ax.set(title=f"{group}, T = {temperature_label(t)}" if len(groups) > 1 else f"T = {temperature_label(t)}", xlabel="depth d",
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
    if run.replayed:
        return "Speedup figure skipped: acceptance was replayed, no speed measured."
    values = {(v, t): run.value(v, m.AVERAGE, t, "speedup") for v in run.drafted for t in run.temperatures}
    if all(s is None for s in values.values()):
        return "Speedup figure skipped: no speedups (the run needs a baseline variant and every benchmark)."
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(run.drafted) + 2), 3.8))
    width = 0.8 / len(run.temperatures)
    for i, t in enumerate(run.temperatures):
        xs = [k + i * width for k in range(len(run.drafted))]
        ax.bar(xs, [values[(v, t)] or math.nan for v in run.drafted], width, label=f"T = {temperature_label(t)}")
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
