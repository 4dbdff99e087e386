"""The model card's tables of a family of heads, read from what the build wrote (drafters.json,
each head's metrics.jsonl, the feature manifests and the regenerated data), so a card never
quotes a number that the build did not produce.

    data     per source domain: records drawn and kept, how the target's answers ended, tokens
    heads    per head: records, epochs, steps, training time, held-out top-1 at depths 1-3,
             draft vocabulary and its coverage
    epochs   held-out top-1 at depth 1 after every epoch: the learning curve over epochs
"""

from __future__ import annotations

from pathlib import Path

from taps.core.jsonl import read_json, read_json_lines


def _jsonl(path: Path) -> list[dict]:
    return [row for _, row in read_json_lines(path)] if path.is_file() else []


def data_table(work: str | Path) -> str:
    work = Path(work)
    rows = ["| domain | drawn | trained on | answers ended by the target | mean answer tokens | feature tokens | "
            "assistant tokens | cut at max_len |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for domain in ("chat", "math"):
        manifest_path = work / f"features-{domain}" / "manifest.json"
        if not manifest_path.is_file():
            continue
        manifest = read_json(manifest_path, "a features manifest")
        drawn = len(_jsonl(work / f"{domain}.jsonl"))
        regenerated = _jsonl(work / f"{domain}.regenerated.jsonl")
        ended = [r["regenerated"]["stop_reasons"][-1] == "stop_token" for r in regenerated]
        new = [r["regenerated"]["new_tokens"] for r in regenerated]
        rows.append(f"| {domain} | {drawn:,} | {manifest['records_done']:,} | "
                    f"{(f'{100 * sum(ended) / len(ended):.0f}%' if ended else '-')} | "
                    f"{(f'{sum(new) / len(new):.0f}' if new else '-')} | {manifest['tokens']:,} | "
                    f"{manifest['assistant_tokens']:,} | {manifest['truncated_records']:,} |")
    return "\n".join(rows) + "\n"


def heads_table(out: str | Path) -> str:
    out = Path(out)
    summary = read_json(out / "drafters.json", "the summary of a family's heads")
    epochs = summary.get("recipe", {}).get("epochs", "?")
    rows = ["| head | records | epochs | steps | training time | held-out top-1 (depth 1 / 2 / 3) | draft vocabulary "
            "(coverage) |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for name in sorted(summary.get("drafters", {})):
        entry = summary["drafters"][name]
        final = entry.get("final", {})
        top1 = " / ".join(f"{final[f'heldout_top1_depth{d}']:.3f}" for d in (1, 2, 3)
                          if f"heldout_top1_depth{d}" in final) or "-"
        vocab = entry.get("draft_vocab")
        vocab_text = f"{vocab['size']:,} ({100 * vocab['coverage']:.2f}%)" if vocab else "full"
        minutes = entry.get("train_seconds", 0) / 60
        rows.append(f"| {name} | {entry.get('records', 0):,} | {epochs} | {entry.get('steps', 0):,} | "
                    f"{minutes:.0f} min | {top1} | {vocab_text} |")
    return "\n".join(rows) + "\n"


def epochs_table(out: str | Path) -> str:
    out = Path(out)
    curves = {}
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        points = [r for r in _jsonl(metrics) if "heldout_top1_depth1" in r]
        if points:
            curves[metrics.parent.name] = [r["heldout_top1_depth1"] for r in points]
    if not curves:
        return ""
    n = max(len(c) for c in curves.values())
    rows = ["| head | " + " | ".join(f"epoch {e}" for e in range(1, n + 1)) + " |",
            "| --- |" + " ---: |" * n]
    for name, curve in curves.items():
        rows.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in curve) + " |" * (1 + n - len(curve)))
    return "\n".join(rows) + "\n"
