"""Training mixtures: a fixed number of conversations drawn from each source, shuffled together,
reproducible from a seed. The paper's variants are mixtures: `sharegpt:35000` + `mathinstruct:PATH:35000`.

Spec grammar: ``SOURCE[:COUNT]``, SOURCE as in `taps.data.sources.load_source`. A last
colon-separated part made only of digits is always the COUNT, so `gsm8k:7000` is 7,000 records of the
default GSM8K split, `gsm8k:/data/train.jsonl:35000` a file and a count, and a path with colons
(`messages:/data/a:b.jsonl`) needs nothing special. The one case that needs care: a path whose last
colon-part is all digits (`/data/run:2`) must be followed by an explicit count.
Without a COUNT a source contributes all its records.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable

from taps.data.english import english_only
from taps.data.sources import Record, SourceReport, SourceSpecError, first_user_turn, load_source
from taps.core.jsonl import write_jsonl
from taps.core.outputs import check_output_file, first_line_is

_COUNT = re.compile(r"[0-9]+")


def parse_count(spec: str) -> tuple[str, int | None]:
    """Split `SOURCE[:COUNT]` into the source spec and the count (None: every record)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and re.fullmatch(r"[-+][0-9]+", tail):
        raise SourceSpecError(f"--source {spec}: the count must be a positive integer, got {tail}")
    if not (sep and head and _COUNT.fullmatch(tail)):
        return spec, None
    if int(tail) == 0:
        raise SourceSpecError(f"{spec}: the count must be positive (omit it to take every record)")
    return head, int(tail)


def _draw(records: list[Record], count: int | None, seed: int, spec: str, report: SourceReport) -> list[Record]:
    """`count` records without replacement. The order comes from shuffling the whole source with a
    generator seeded by (seed, spec), so a source's sample does not depend on the other sources of
    the mix, and a smaller count is a prefix of a larger one (35k+35k is inside 70k+70k)."""
    if count is not None and count > len(records):
        after = " after the English filter" if "not_english" in report.dropped else ""
        raise SourceSpecError(f"{spec}: asked for {count:,} records, only {len(records):,} available{after}")
    order = list(records)
    random.Random(f"{seed}:{spec}").shuffle(order)
    return order[:count]


def mix_sources(specs: list[str], seed: int, data_dir: str | Path | None = None, english: bool = False,
                on_report: Callable[[SourceReport], None] | None = None,
                max_prompt_chars: int | None = None) -> list[Record]:
    """Records drawn from every `SOURCE[:COUNT]` spec and shuffled together. Each record keeps the
    `source` tag its reader set (the source's name: sharegpt, gsm8k, ...), so a mixture can be split by
    domain again. `english` applies `english_only` to each source before drawing (counted in the
    report as not_english). `max_prompt_chars` drops, after the draw, the drawn records whose first
    user turn is longer (counted in the report): the draw itself does not move, so the
    same seed and count with and without a cap give a mixture and its subsequence (eagle2-mixed-xl's
    chat data is `sharegpt:12000` drawn with seed 15, then capped at 1,600 characters: 10,677).
    `on_report` sees each source's report once it is read and drawn."""
    if max_prompt_chars is not None and max_prompt_chars < 1:
        raise SourceSpecError(f"--max-prompt-chars must be a positive integer, got {max_prompt_chars}")
    mixed: list[Record] = []
    for text in specs:
        spec, count = parse_count(text)
        records, report = load_source(spec, data_dir)
        if english:
            records = _english(records, report)
        if not records:
            if on_report is not None:
                on_report(report)
            raise SourceSpecError(f"--source {text}: no usable records (an empty file, or every record dropped: "
                                  f"{report.dropped or 'none read'})")
        drawn = _draw(records, count, seed, spec, report)
        if max_prompt_chars is not None:
            over = sum(not _prompt_fits(r, max_prompt_chars) for r in drawn)
            if over:
                report.dropped[f"drawn with a first prompt over {max_prompt_chars:,} chars"] = over
        if on_report is not None:
            on_report(report)
        mixed.extend(drawn)
    random.Random(seed).shuffle(mixed)
    if max_prompt_chars is not None:  # after the shuffle too, so the uncapped order is kept
        mixed = [r for r in mixed if _prompt_fits(r, max_prompt_chars)]
    return mixed


def mix_to_file(specs: list[str], seed: int, out: str | Path, data_dir: str | Path | None = None,
                english: bool = False, on_report: Callable[[SourceReport], None] | None = None,
                force: bool = False, max_prompt_chars: int | None = None) -> str:
    """`taps data mix`: mix_sources written to `out` atomically; returns what was written. `out`
    must not be a source, nor anything but a regular file, and an existing mixture is replaced only
    with `force` (taps.core.outputs)."""
    check_output_file(out, "--out", [(f"--source {text}", path) for text, path in _source_files(specs)],
                      force=force, holds=lambda path: first_line_is(path, ("conversations",)),
                      what="records (JSONL of conversations)")
    records = mix_sources(specs, seed, data_dir=data_dir, english=english, on_report=on_report,
                          max_prompt_chars=max_prompt_chars)
    return f"wrote {len(records):,} records to {write_jsonl(records, out)}"


def _source_files(specs: list[str]) -> list[tuple[str, Path]]:
    """(spec, file) for every `KIND:PATH[:COUNT]` spec that names an existing file."""
    files = []
    for text in specs:
        rest = parse_count(text)[0].partition(":")[2]
        if rest and Path(rest).expanduser().exists():
            files.append((text, Path(rest).expanduser()))
    return files


def _english(records: list[Record], report: SourceReport) -> list[Record]:
    """english_only, with the records it drops counted in the report."""
    kept = english_only(records)
    if len(kept) < len(records):
        report.dropped["not_english"] = len(records) - len(kept)
    report.kept = len(kept)
    return kept


def _prompt_fits(record: Record, cap: int) -> bool:
    """Whether the record's first user turn has at most `cap` characters."""
    return len(first_user_turn(record) or "") <= cap
