"""JSON-lines files that long jobs append to and resume from.

A record is appended in one write and fsync'ed, so a crash leaves at most one torn last line
(no trailing newline). Readers name the file and line of anything malformed; only the writer
that is about to append cuts a torn last line off, never a complete one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


class JsonlFormatError(ValueError):
    pass


def decode_utf8(data: bytes, path: str | Path) -> str:
    """Bytes of a text file as str (a UTF-8 BOM dropped); bytes that are not UTF-8 are an error
    naming the file, line and column, not a bare UnicodeDecodeError."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise JsonlFormatError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column}); "
                               "expected a UTF-8 file") from None


def text_lines(path: str | Path) -> list[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file (see decode_utf8)."""
    return list(enumerate(decode_utf8(Path(path).read_bytes(), path).splitlines(), 1))


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
            obj = json.loads(line)
        except UnicodeDecodeError as err:
            raise JsonlFormatError(f"{path}:{lineno}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                                   f"{err.start + 1}); expected a UTF-8 file") from None
        except json.JSONDecodeError as err:
            raise JsonlFormatError(f"{path}: line {lineno} is not valid JSON ({err})") from None
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


def write_json_atomic(path: str | Path, obj) -> None:
    """Write a whole JSON file via a temporary file and rename, so readers never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
