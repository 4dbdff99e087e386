"""DIR/log/ of `taps serve --learn DIR`: every finished chat answer the server returned, as the
chat records `taps data regenerate` writes, so `taps features`, `taps lookup build` and
`taps adapt` read it as they read regenerated data.

One record per answer, in files `answers-000001.jsonl`, `answers-000002.jsonl`, ...:
    {"id": the response id, "source": "taps-serve",
     "conversations": [the request's messages..., {"role": "assistant", "content": the reply}],
     "regenerated": {"original_turns", "stop_reasons": [finish], "new_tokens"},
     "served": {"time", "model", "variant", "temperature", "top_p", "seed", "prompt_tokens",
                "answer_tokens": the emitted token ids}}
Crash-safe: each record is appended in one write and fsync'ed (jsonl.append_jsonl); a crash leaves
at most a torn last line, which the next server cuts off before it appends. Bounded: a file is
rotated when the next record would take it past `max_file_bytes`, and the oldest files are
deleted while the log holds more than `max_bytes` (the newest file always stays).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from taps.core.jsonl import JsonlFormatError, append_jsonl, read_jsonl

LOG_DIR = "log"
_NAME = re.compile(r"answers-(\d{6,})\.jsonl")


def log_files(root: str | Path) -> list[Path]:
    """The log's files under DIR (`root`), oldest first."""
    folder = Path(root) / LOG_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("answers-*.jsonl") if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def read_log(root: str | Path) -> list[dict]:
    """Every complete record of the log, oldest first (a torn last line is skipped, not repaired)."""
    return [row for path in log_files(root) for _, row in read_jsonl(path)[0]]


class AnswerLog:
    """Appends records to DIR/log/, rotating and trimming (module docstring). One writer at a time:
    the server's learner thread."""

    def __init__(self, root: str | Path, max_file_bytes: int = 16 << 20, max_bytes: int = 256 << 20):
        if max_file_bytes < 1 or max_bytes < max_file_bytes:
            raise ValueError(f"the answer log needs 1 <= max_file_bytes <= max_bytes, got {max_file_bytes}, "
                             f"{max_bytes}")
        self.folder = Path(root) / LOG_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.max_bytes = max_file_bytes, max_bytes
        files = log_files(root)
        if files:
            try:
                read_jsonl(files[-1], repair_torn=True)  # a crash's torn tail goes before anything is appended
            except JsonlFormatError as err:
                raise ValueError(f"--learn: {err}; move the file away to start a new log") from None
        self.current = files[-1] if files else self._file(1)

    def _file(self, number: int) -> Path:
        return self.folder / f"answers-{number:06d}.jsonl"

    def append(self, record: dict) -> None:
        size = len((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        if self.current.is_file() and self.current.stat().st_size > 0 and \
                self.current.stat().st_size + size > self.max_file_bytes:
            self.current = self._file(int(_NAME.fullmatch(self.current.name).group(1)) + 1)
        append_jsonl(self.current, [record])
        self._trim()

    def _trim(self) -> None:
        files = log_files(self.folder.parent)
        total = sum(p.stat().st_size for p in files)
        for old in files[:-1]:
            if total <= self.max_bytes:
                break
            total -= old.stat().st_size
            old.unlink(missing_ok=True)
