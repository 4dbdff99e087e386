"""What a command may write over, checked before it writes anything.

An output that is not a regular file or a directory (a FIFO, a device, a symbolic link: writing
"into" one replaces it with a regular file or writes somewhere else), an output that is one of the
command's own inputs, and a directory that holds another kind of result (features written into an
eval results directory, a head into a datastore) are refused: each would destroy or mix what is
there. Overwriting a finished result of the same kind (a head, a mixture) takes the command's
--force; resumable outputs (features, eval results, regenerated answers) resume instead.

A directory's kind is read from the files each command leaves there (RESULT_MARKERS), so no
command needs to know the others.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

# (marker file or directory, the kind of result it marks), first match wins
RESULT_MARKERS = (
    ("datastore.json", "datastore"),
    ("run.json", "eval results"),
    ("manifest.json", "features"),
    ("report.md", "report"),
    ("ckpt", "drafter"),
    ("model.safetensors", "drafter"),
)
DRAFTER_ARCHITECTURE = "LlamaForCausalLMEagle"  # a target model's config names its own


class OutputError(ValueError):
    """An output path a command must not write to; the message names it."""


def _what(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def kind_of(directory: str | Path) -> str | None:
    """The kind of taps result a directory holds (RESULT_MARKERS), "target model" for a model
    directory that is not a drafter, None for a new, empty or unmarked one."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for marker, kind in RESULT_MARKERS:
        if (directory / marker).exists():
            if kind == "drafter" and marker == "model.safetensors" and not _is_drafter(directory):
                return "target model"
            return kind
    return None


def _is_drafter(directory: Path) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # weights without a readable config: nothing a target model would be either
    return isinstance(config, dict) and ("taps" in config or DRAFTER_ARCHITECTURE in config.get("architectures", []))


def check_output_dir(path: str | Path, kind: str, flag: str = "--out", force: bool | None = None,
                     inputs: Sequence[tuple[str, str | Path]] = ()) -> Path:
    """Refuse an output directory that is not a directory, is one of `inputs` ((flag, path)
    pairs), or holds another kind of result than `kind`. force=False: one that holds a `kind`
    already is refused too (overwriting it takes --force); None: the command resumes it."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise OutputError(f"{flag} {path}: {_what(os.lstat(path).st_mode)}; expected a directory (new, empty, or "
                          f"holding {_article(kind)})")
    _not_an_input(path, flag, inputs)
    found = kind_of(path)
    if found is not None and found != kind:
        raise OutputError(f"{flag} {path}: holds {_article(found)}, not {_article(kind)}; use another {flag} so "
                          "neither overwrites the other")
    if found == kind and force is False:
        raise OutputError(f"{flag} {path}: holds {_article(kind)} already; pass --force to overwrite it, or use "
                          f"another {flag}")
    return path


def check_output_file(path: str | Path, flag: str = "--out", inputs: Sequence[tuple[str, str | Path]] = (),
                      force: bool | None = None, holds: Callable[[Path], bool] | None = None,
                      what: str = "output") -> Path:
    """Refuse an output file that exists as anything but a regular file, is one of `inputs`
    ((flag, path) pairs), or is not empty and does not hold what this command writes (`holds`,
    given the path). force=False: an existing non-empty one is refused too (overwriting takes
    --force); None: the command resumes or appends to it."""
    path = Path(path)
    if os.path.lexists(path):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise OutputError(f"{flag} {path}: {_what(mode)}; expected a regular file or a new path")
    _not_an_input(path, flag, inputs)
    if path.is_file() and path.stat().st_size > 0:
        if holds is not None and not holds(path):
            raise OutputError(f"{flag} {path}: holds something else than {what}; refusing to overwrite it, use "
                              f"another {flag}")
        if force is False:
            raise OutputError(f"{flag} {path}: exists; pass --force to overwrite it, or use another {flag}")
    return path


def _not_an_input(path: Path, flag: str, inputs: Sequence[tuple[str, str | Path]]) -> None:
    for input_flag, given in inputs:
        given = Path(given)
        same = path.exists() and given.exists() and os.path.samefile(path, given)
        if same or path.resolve() == given.resolve():
            raise OutputError(f"{flag} {path}: is also the input {input_flag} {given}; write the output elsewhere")


def first_line_is(path: Path, keys: Sequence[str]) -> bool:
    """Whether the first non-blank line of a file is a JSON object with all of `keys`: a JSONL
    file of the records a command writes, told from anything else without reading it whole."""
    try:
        with path.open("rb") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and all(k in obj for k in keys)
    except (OSError, ValueError):
        return False
    return True


def _article(kind: str) -> str:
    if kind.endswith("results"):
        return kind
    return ("an " if kind[0] in "aeiou" else "a ") + kind
