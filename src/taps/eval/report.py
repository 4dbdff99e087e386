"""`taps report RESULTS_DIR --out DIR`: the study's tables (eval/tables.py) and figures
(eval/figures.py), from records and run.json only.

report.md puts the tables (each also as CSV and LaTeX) together with the figures and says what was
skipped and why, so a gap is never silent.
"""

from __future__ import annotations

from pathlib import Path

from taps.core.outputs import check_output_dir
from taps.eval.figures import FIGURES, pyplot
from taps.eval.tables import (Run, Table, depth_table, entropy_table, load_run, speedup_overview, speedup_table, table1,
                              table2, temperature_label)


def _settings(run: Run) -> str:
    info, tree = run.info, run.info.get("tree", {})
    lines = [f"- target: `{info.get('target', '?')}`",
             "- tree: " + ", ".join(f"{k} {v}" for k, v in tree.items()),
             f"- max_new_tokens {info.get('max_new_tokens')}, seed {info.get('seed')}, top_p {info.get('top_p')}, "
             f"temperatures {', '.join(map(temperature_label, run.temperatures))}", "- variants:"]
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
    pyplot()  # fail before writing anything when the figures cannot be drawn
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
        if table.rows:  # a skipped table (a replayed run's speed) is its title and notes only
            parts.append(f"{table.title}\n\n{table.to_markdown()}" + (f"\n{table.caption}\n" if table.caption else ""))
        else:
            parts.append(table.title)
        parts += [f"note: {n}\n" for n in table.notes]
    return "\n".join(parts)

