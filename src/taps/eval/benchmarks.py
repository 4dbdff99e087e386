"""The study's benchmarks (MT-Bench, GSM8K, MATH-500, SVAMP, or any FastChat question file) as one
record shape, `Question`, so the runner never looks at a data set's own format.

Sources, in order: a file in the data directory (`data_dir`, else $TAPS_DATA_DIR), laid out as
docs/spec.md §8 says; else the Hugging Face hub through `datasets` when it is installed and online. A path to
any FastChat `question.jsonl` is a benchmark too, named by its folder (or `NAME=PATH`).

Malformed input raises `BenchmarkFormatError` naming the file, the line (1-based) and what was
expected: a benchmark that silently loses or merges questions changes every number in the report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from taps.data.hub import HubUnavailable, hub_rows
from taps.data.sources import DATA_DIR_ENV
from taps.core.jsonl import read_json_lines


@dataclass(frozen=True)
class Question:
    """One benchmark question: the user turns to play in order, and what a grader may compare against."""

    bench: str                       # "mt_bench" | "gsm8k" | "math500" | "svamp" | a custom name
    question_id: str                 # str of the source id; GSM8K test has none: its 0-based line index
    category: str                    # FastChat category; "math" for gsm8k
    turns: tuple[str, ...]           # user turns: MT-Bench has 2, the others 1
    reference: tuple[str, ...] = ()  # FastChat "reference", or GSM8K's final number after '####'


class BenchmarkFormatError(ValueError):
    """Malformed benchmark input; the message names the file, the line and what was expected."""


# name -> file inside a data directory (docs/spec.md §8)
BENCHMARKS: dict[str, str] = {
    "mt_bench": "mt_bench/question.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
    "math500": "math500/question.jsonl",
    "svamp": "svamp/question.jsonl",
}
# name -> (hub data set, config, split), read when the local file is absent
HUB: dict[str, tuple[str, str | None, str]] = {
    "mt_bench": ("HuggingFaceH4/mt_bench_prompts", None, "train"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "svamp": ("ChilleD/SVAMP", None, "test"),
}


def parse_bench_list(spec: str) -> list[str]:
    """`"mt_bench,gsm8k,./my/question.jsonl,name=PATH"` -> its entries, checked now so that a typo fails
    before a long run starts rather than after the first benchmarks."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError(f"no benchmarks in {spec!r}; known names: {', '.join(BENCHMARKS)}, or a question.jsonl path")
    for item in items:
        if item not in BENCHMARKS and _explicit_path(item) is None:
            raise ValueError(f"unknown benchmark {item!r}: neither a known name ({', '.join(BENCHMARKS)}) nor an "
                             f"existing file (PATH or NAME=PATH)")
    if len(set(items)) < len(items):
        raise ValueError(f"a benchmark is listed twice in {spec!r}")
    return items


def load_benchmark(name_or_path: str, data_dir: str | Path | None = None, limit: int | None = None,
                   categories: Iterable[str] | None = None) -> list[Question]:
    """The questions of a benchmark name (BENCHMARKS), a FastChat question file path, or `NAME=PATH`.
    `categories` keeps only those (each must exist: a misspelt one would silently empty a run);
    `limit` then keeps the first N in file order, so a short run is a prefix of the full one."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    explicit = _explicit_path(name_or_path) if name_or_path not in BENCHMARKS else None
    bench = name_or_path
    if explicit is not None:
        bench, path = explicit
        questions = read_questions(path, bench, "gsm8k" if bench == "gsm8k" else None)
    elif name_or_path in BENCHMARKS:
        questions = _load_named(name_or_path, data_dir)
    else:
        raise FileNotFoundError(f"unknown benchmark {name_or_path!r}: neither a known name "
                                f"({', '.join(BENCHMARKS)}) nor an existing file (PATH or NAME=PATH)")
    if categories is not None:
        wanted = list(categories)
        available = sorted({q.category for q in questions})
        missing = [c for c in wanted if c not in available]
        if missing:
            raise ValueError(f"{bench}: no category {', '.join(map(repr, missing))}; "
                             f"available: {', '.join(available)}")
        questions = [q for q in questions if q.category in wanted]
    return questions if limit is None else questions[:limit]


def load_questions(benches: Sequence[str], data_dir: str | Path | None = None, limit: int | None = None,
                   categories: Sequence[str] | None = None) -> list[Question]:
    """The questions of several benchmarks (names or [name=]PATH, parse_bench_list), in order: what
    `taps eval` and a study's eval stage decode (load_benchmark on each)."""
    return [q for name in benches for q in load_benchmark(name, data_dir, limit=limit, categories=categories)]


def read_questions(path: str | Path, bench: str, fmt: str | None = None) -> list[Question]:
    """Read a JSONL benchmark file; `fmt` is "fastchat" or "gsm8k", or None to tell by the first record's
    fields (a GSM8K-format test file is then usable by path too). Blank lines are skipped."""
    path = Path(path)
    rows = read_json_lines(path, BenchmarkFormatError)
    if not rows:
        raise BenchmarkFormatError(f"{path}: no questions (an empty file)")
    if fmt is None:
        first = rows[0][1]
        fmt = "gsm8k" if isinstance(first, dict) and "turns" not in first and "question" in first else "fastchat"
    parse = _gsm8k_row if fmt == "gsm8k" else _fastchat_row
    return _unique([(f"{path}:{lineno}", parse(bench, row, f"{path}:{lineno}", index))
                    for index, (lineno, row) in enumerate(rows)])


# ---------------------------------------------------------------- internals

def _explicit_path(item: str) -> tuple[str, Path] | None:
    """(bench name, file) for `PATH` (named by its folder) or `NAME=PATH`; None if no such file."""
    whole = Path(item).expanduser()
    if whole.is_file():
        return whole.resolve().parent.name, whole
    name, sep, rest = item.partition("=")
    if sep and name.strip() and Path(rest).expanduser().is_file():
        return name.strip(), Path(rest).expanduser()
    return None


def _load_named(name: str, data_dir: str | Path | None) -> list[Question]:
    """A known benchmark from the data directory, else from the hub; the error says how to fix either."""
    root = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    path = Path(root).expanduser() / BENCHMARKS[name] if root else None
    if path is not None and path.is_file():
        return read_questions(path, name, "gsm8k" if name == "gsm8k" else "fastchat")
    dataset, config, split = HUB[name]
    try:
        rows = hub_rows(dataset, split, config)
    except HubUnavailable as err:
        tried = f"no file {path}" if path is not None else "no data directory given"
        raise FileNotFoundError(
            f"benchmark {name}: {tried} (data directory: {root or 'none'}), and the hub data set {dataset} could "
            f"not be read ({err}). Pass --data-dir (or set {DATA_DIR_ENV}) to a folder "
            f"holding {BENCHMARKS[name]}, or install `datasets` and go online") from err
    located = []
    for i, row in enumerate(rows):
        where = f"{dataset} ({split}) row {i}"
        located.append((where, _hub_row(name, row, where, i)))
    return _unique(located)


def _hub_row(name: str, row: dict, where: str, index: int) -> Question:
    """Map a hub row to the local file's shape, so results do not depend on where the data came from."""
    try:
        if name == "gsm8k":
            return _gsm8k_row(name, row, where, index)
        if name == "mt_bench":
            return _fastchat_row(name, {"question_id": row["prompt_id"], "category": row["category"],
                                        "turns": row["prompt"], "reference": row.get("reference") or []}, where, index)
        if name == "math500":
            return _fastchat_row(name, {"question_id": row["unique_id"], "category": "math",
                                        "turns": [row["problem"]], "reference": [row["solution"]]}, where, index)
        answer = row["Answer"]  # svamp: a float such as 27.0; the local file writes "27"
        answer = str(int(answer)) if isinstance(answer, float) and answer.is_integer() else str(answer)
        return _fastchat_row(name, {"question_id": row["ID"], "category": "math", "reference": [answer],
                                    "turns": [f"{row['Body'].strip()} {row['Question'].strip()}"]}, where, index)
    except KeyError as err:
        raise BenchmarkFormatError(f"{where}: missing field {err}; fields are {sorted(row)}") from None


def _fastchat_row(bench: str, row: Any, where: str, index: int) -> Question:
    if not isinstance(row, dict):
        raise BenchmarkFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question_id", "category", "turns"):
        if key not in row:
            raise BenchmarkFormatError(f"{where}: missing {key!r}; expected FastChat fields "
                                       f"question_id, category, turns [, reference]")
    qid, category, turns, ref = row["question_id"], row["category"], row["turns"], row.get("reference") or []
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise BenchmarkFormatError(f"{where}: question_id must be an integer or a string, got {qid!r}")
    if not isinstance(category, str):
        raise BenchmarkFormatError(f"{where}: category must be a string, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise BenchmarkFormatError(f"{where}: turns must be a non-empty list of strings, got {turns!r:.80}")
    if not isinstance(ref, list) or not all(isinstance(r, str) for r in ref):
        raise BenchmarkFormatError(f"{where}: reference must be a list of strings, got {ref!r:.80}")
    return Question(bench, str(qid), category, tuple(turns), tuple(ref))


def _gsm8k_row(bench: str, row: Any, where: str, index: int) -> Question:
    """GSM8K: one turn; the reference is the final number after '####', commas dropped ("2,125" -> "2125")."""
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
        raise BenchmarkFormatError(f"{where}: expected GSM8K fields 'question' and 'answer' (strings)")
    if "####" not in row["answer"]:
        raise BenchmarkFormatError(f"{where}: the answer has no '#### <number>' line")
    final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    return Question(bench, str(index), "math", (row["question"],), (final,))


def _unique(located: list[tuple[str, Question]]) -> list[Question]:
    """Refuse duplicate ids: results are keyed by (bench, question_id), so a duplicate would overwrite one."""
    seen: dict[str, str] = {}
    for where, q in located:
        if q.question_id in seen:
            raise BenchmarkFormatError(f"{where}: duplicate question_id {q.question_id!r} "
                                       f"(first at {seen[q.question_id]})")
        seen[q.question_id] = where
    return [q for _, q in located]
