"""Every JSON and JSON-lines file the package reads or writes goes through here.

Two kinds of JSONL file:
- whole files (data sets, benchmark questions): read_json_lines reads every non-blank line;
  write_jsonl writes one atomically (a temporary file, fsync, rename). A name ending in `.gz` is
  gzip-compressed both ways (the shipped training data: models/*/data/*.jsonl.gz); written with no
  name or time in the gzip header, so the same records give the same bytes.
- logs that long jobs append to and resume from (results, regenerated answers): append_jsonl
  appends records in one write and fsyncs, so a crash leaves at most one torn last line (no
  trailing newline); read_jsonl skips it, and only the writer about to append cuts it off
  (repair_torn=True), never a complete line.
A bad line is an error naming the file and line (`PATH:N: invalid JSON (...)`, or with
`at=LINE_WORD`, `PATH: line N: ...`); a file that is not UTF-8 names the line and column.
Whole JSON documents (run.json, manifests, summaries, tables, checkpoint state, cached profiles,
configs): read_json reads one, a bad one is an error naming the file, where it breaks and what was
expected; write_json_atomic writes one via a rename.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

AT_COLON = "{path}:{line}"  # how a bad line is named: PATH:N (the default) or PATH: line N
LINE_WORD = "{path}: line {line}"


class JsonlFormatError(ValueError):
    pass


def decode_utf8(data: bytes, path: str | Path, error: Callable[[str], Exception] = JsonlFormatError) -> str:
    """Bytes of a text file as str (a UTF-8 BOM dropped); bytes that are not UTF-8 are an error
    naming the file, line and column, not a bare UnicodeDecodeError."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column}); "
                    "expected a UTF-8 file") from None


def read_json(path: str | Path, expected: str, error: Callable[[str], Exception] = JsonlFormatError,
              kind: type | None = dict) -> Any:
    """A whole JSON document (a missing file is the caller's FileNotFoundError). Text that is not
    UTF-8 or not JSON, or a value that is not a `kind` (an object by default; None: any value), is
    `error` naming the file and `expected`, e.g. "a features manifest"."""
    path = Path(path)
    text = decode_utf8(path.read_bytes(), path, error)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
                    f"expected {expected}") from None
    if kind is not None and not isinstance(value, kind):
        raise error(f"{path}: a JSON {_JSON_NAMES.get(type(value), type(value).__name__)}, not "
                    f"{'an object' if kind is dict else 'an array' if kind is list else kind.__name__}; "
                    f"expected {expected}")
    return value


_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def parse_json_line(line: str | bytes, where: str, error: type[ValueError] = JsonlFormatError) -> Any:
    """The JSON value of one line; bad JSON raises `error` naming `where` (the file and line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise error(f"{where}: invalid JSON ({err.msg} at column {err.colno}); expected one JSON object per line") \
            from None


def json_lines(text: str, path: str | Path, error: type[ValueError] = JsonlFormatError,
               at: str = AT_COLON) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a whole JSONL text. Lines end at "\n" only:
    str.splitlines would also cut at U+2028 or U+0085, which JSON strings may hold raw (json.dumps
    with ensure_ascii=False writes them so)."""
    return [(number, parse_json_line(line, at.format(path=path, line=number), error))
            for number, line in enumerate(text.split("\n"), start=1) if line.strip()]


def read_json_lines(path: str | Path, error: type[ValueError] = JsonlFormatError,
                    at: str = AT_COLON) -> list[tuple[int, Any]]:
    """json_lines of a whole UTF-8 file (see decode_utf8); a `.gz` name is decompressed first."""
    data = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise error(f"{path}: not a complete gzip file ({err}); expected gzip-compressed JSONL") from None
    return json_lines(decode_utf8(data, path), path, error, at)


def read_jsonl(path: str | Path, repair_torn: bool = False) -> tuple[list[tuple[int, dict]], bool]:
    """(line number, object) for every complete line, and whether a torn last line was found.

    repair_torn=True truncates the file after its last complete line (call it only before
    appending). A complete line that is not a JSON object raises JsonlFormatError.
    """
    path = Path(path)
    if not path.is_file():
        return [], False
    data = path.read_bytes()
    rows, good_end = [], 0
    for lineno, line in enumerate(data.splitlines(keepends=True), 1):
        if not line.endswith(b"\n"):
            break
        good_end += len(line)
        if not line.strip():
            continue
        try:
            obj = parse_json_line(line, LINE_WORD.format(path=path, line=lineno))
        except UnicodeDecodeError as err:
            raise JsonlFormatError(f"{path}:{lineno}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                                   f"{err.start + 1}); expected a UTF-8 file") from None
        if not isinstance(obj, dict):
            raise JsonlFormatError(f"{path}: line {lineno} is a JSON {type(obj).__name__}, expected an object")
        rows.append((lineno, obj))
    torn = good_end < len(data)
    if torn and repair_torn:
        with path.open("r+b") as f:
            f.truncate(good_end)
    return rows, torn


def append_jsonl(path: str | Path, objects: Iterable[dict]) -> None:
    """Append objects as lines in a single write, then fsync: all of them land or (after a crash) a
    torn tail that read_jsonl(repair_torn=True) removes."""
    payload = "".join(json.dumps(obj, ensure_ascii=False) + "\n" for obj in objects).encode("utf-8")
    if not payload:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """One JSON record per line, written to a temporary file beside the target and moved into place,
    so an interrupted run never leaves a half-written file under the final name (gzip-compressed
    when the name ends in `.gz`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "xb") as f:
            if path.name.endswith(".gz"):  # no file name or time in the header: same records, same bytes
                with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=f, mtime=0) as packed:
                    _write_lines(records, packed)
            else:
                _write_lines(records, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_lines(records: Iterable[dict], binary) -> None:
    text = io.TextIOWrapper(binary, encoding="utf-8", newline="\n")
    for record in records:
        text.write(json.dumps(record, ensure_ascii=False) + "\n")
    text.flush()
    text.detach()  # leaves the binary file open for the caller's fsync


def write_json_atomic(path: str | Path, obj) -> None:
    """Write a whole JSON file via a temporary file and rename, so readers never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
