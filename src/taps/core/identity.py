"""What a run was made with, by content: a target's weights digest, and the check that a resumed
run is the same run.

A tokenizer fingerprint cannot tell a base model from its instruct version; the weights can. Hashing
every byte of a multi-GB model at each load would cost seconds to minutes, so the digest covers the
config, every safetensors file's name, size and header (tensor names, shapes, dtypes, offsets) and
256 evenly spaced 4 KiB windows of its data: two checkpoints of one architecture differ in
nearly every window. Reading a header also checks the file is whole (a truncated or corrupt file is
refused naming it). Digests are cached in memory, keyed by each file's size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

from taps.core.jsonl import read_json

WINDOWS, WINDOW = 256, 4096
_cache: dict[tuple, str] = {}


class CorruptWeightsError(ValueError):
    """A weights file that is not a whole safetensors file; the message names it."""


def safetensors_header(path: Path) -> tuple[bytes, int]:
    """(header JSON bytes, data length) of a safetensors file, checking the file holds all its tensors."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise CorruptWeightsError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CorruptWeightsError(f"{path}: truncated or not safetensors (a {n:,}-byte header in a "
                                      f"{size:,}-byte file)")
        header = handle.read(n)
    try:
        tensors = json.loads(header)
        end = max((int(t["data_offsets"][1]) for k, t in tensors.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError):
        raise CorruptWeightsError(f"{path}: corrupt safetensors header") from None
    if 8 + n + end != size:
        raise CorruptWeightsError(f"{path}: truncated or corrupt: its tensors need {8 + n + end:,} bytes, the "
                                  f"file has {size:,}")
    return header, end


def weights_identity(model_dir: str | Path) -> str:
    """Digest of a Hugging Face model directory's config and safetensors weights (see the module doc)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    stats = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (str(model_dir.resolve()), stats, (model_dir / "config.json").stat().st_mtime_ns)
    if key in _cache:
        return _cache[key]
    h = hashlib.sha256()
    config = read_json(model_dir / "config.json", "a model's config", CorruptWeightsError)
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True).encode())
    for f in files:
        header, data_len = safetensors_header(f)
        h.update(f"{f.name}|{f.stat().st_size}|".encode() + header)
        start = 8 + len(header)
        with open(f, "rb") as handle:
            for i in range(WINDOWS):
                handle.seek(start + (data_len - WINDOW) * i // max(WINDOWS - 1, 1) if data_len > WINDOW else start)
                h.update(handle.read(WINDOW))
    _cache[key] = digest = "sha256:" + h.hexdigest()[:32]
    return digest


def tensors_identity(model) -> str:
    """Digest of an in-memory model's parameters (targets built in code, not loaded from a directory)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:32]


def file_sha256(path: str | Path) -> str:
    """The sha256 of a whole file, hex, read in 1 MiB blocks. The digests kept in manifests and
    results keep the spelling each was first written in (a resumed run compares them as text)."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class MismatchError(ValueError):
    """A resume under other content settings; `key` names the first that differs."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def check_same(where: str | Path, saved: dict, ours: dict, keys, hint: str) -> list[str]:
    """Refuse (MismatchError naming the key and both values) when a key of `keys` differs between
    what `where` was made with and this run. A key `saved` lacks (written before it was recorded)
    is unknown, not different: it is accepted with one warning line. Returns the missing keys."""
    missing = [k for k in keys if k not in saved and ours.get(k) is not None]
    for key in keys:
        if key in saved and saved[key] != ours.get(key):
            raise MismatchError(f"{where}: made with {key} = {saved[key]!r}, this run has {ours.get(key)!r}; {hint}",
                                key)
    if missing:
        print(f"taps: warning: {where}: made before {', '.join(missing)} {'was' if len(missing) == 1 else 'were'} "
              "recorded; not checked, recorded from now on", file=sys.stderr)
    return missing
