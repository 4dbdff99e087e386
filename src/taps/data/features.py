"""Target features for drafter training: shards of (input_ids, loss_mask, hidden) per record.

`hidden` is the target's last-layer feature at every position (HF hidden_states[-1], the LM
head's input), computed by teacher forcing over the conversation rendered with the target's
chat template; `loss_mask` marks the assistant tokens (data/chat.py). With `aux_layers` (what an
EAGLE-3 head reads, drafter/head3.py) each shard also holds `aux` [N, k * H]: the outputs of those
decoder layers side by side; the manifest names them.

Layout of a features directory:
    manifest.json              target fingerprint, hidden size, dtype, max_len, data file, counts
    shard-00000.safetensors    input_ids [N] int32, loss_mask [N] uint8, hidden [N, H], offsets [R+1] int64
                               (+ aux [N, k * H] with aux_layers)
Shards are written whole and atomically, then the manifest is replaced atomically, so a run
killed at any point resumes after its last complete shard; a directory made for another target
(tokenizer fingerprint) or another data file is refused instead of being mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from taps.core.config import setting
from taps.data.chat import encode_conversation
from taps.drafter.head3 import check_aux_layers, default_aux_layers
from taps.core.identity import MismatchError, check_same, file_sha256
from taps.core.jsonl import read_json, read_json_lines, write_json_atomic
from taps.core.outlock import output_lock
from taps.core.outputs import check_output_dir
from taps.core.target import TargetRef

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


class FeaturesError(ValueError):
    pass


def read_conversations(path: str | Path) -> list[dict]:
    """Our normalised JSONL ({"id", "source", "conversations": [{"role", "content"}]}), one per line."""
    path = Path(path)
    records = []
    for lineno, record in read_json_lines(path, FeaturesError):
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise FeaturesError(f"{path}:{lineno}: expected an object with a 'conversations' list")
        records.append(record)
    if not records:
        raise FeaturesError(f"{path}: no records (an empty file); expected one JSON record per line")
    return records


def file_digest(path: Path) -> str:
    return "sha256:" + file_sha256(path)[:32]  # a features manifest's spelling


@dataclass
class FeatureSettings:
    # `taps features`'s options (cli/args.add_settings)
    max_len: int = setting(2048, at_least=1)
    dtype: str = setting("bf16", "stored feature dtype", choices=("bf16", "fp16", "fp32"))
    records_per_shard: int = setting(512, at_least=1)
    tokens_per_batch: int = setting(8192, "padded tokens per target forward", at_least=1)
    aux_layers: str = setting(
        "", "also store these decoder layers' outputs for EAGLE-3 heads: 'auto' (the engines' default low / middle / "
            "high layers) or comma-separated layer indices; default: none", metavar="auto|L1,L2,L3")

    def __post_init__(self) -> None:
        for name in ("max_len", "records_per_shard", "tokens_per_batch"):
            if getattr(self, name) < 1:
                raise FeaturesError(f"{name} must be >= 1, got {getattr(self, name)}")


def resolve_aux_layers(spec: str, num_layers: int) -> list[int]:
    """FeatureSettings.aux_layers for a target of num_layers decoder layers: [] for none."""
    spec = spec.strip()
    if not spec:
        return []
    try:
        if spec == "auto":
            return list(default_aux_layers(num_layers))
        parts = [p.strip() for p in spec.split(",")]
        if not all(p.lstrip("-").isdigit() for p in parts):
            raise ValueError(f"expected 'auto' or comma-separated layer indices, got {spec!r}")
        return list(check_aux_layers([int(p) for p in parts], num_layers, "aux_layers"))
    except ValueError as err:
        raise FeaturesError(f"--aux-layers: {err}") from None


# what a features directory's content depends on: a resume with any other value is refused
CONTENT_KEYS = ("tokenizer_fingerprint", "target_weights", "target_dtype", "hidden_size", "max_len", "dtype",
                "data_digest", "aux_layers")


def _open_manifest(out: Path, target, data: Path, settings: FeatureSettings, n_records: int) -> dict:
    fresh = {"format_version": FORMAT_VERSION, "tokenizer_fingerprint": target.fingerprint(),
             "target_name": target.name, **target.identity(), "hidden_size": target.hidden_size,
             "dtype": settings.dtype, "max_len": settings.max_len, "data_file": str(data),
             "aux_layers": resolve_aux_layers(settings.aux_layers, int(target.config.num_hidden_layers)),
             "data_digest": file_digest(data), "records_total": n_records, "records_done": 0, "tokens": 0,
             "assistant_tokens": 0, "truncated_records": 0, "sources": {}, "shards": [], "complete": False}
    path = out / MANIFEST
    if not path.is_file():
        if any(out.glob("shard-*.safetensors")):
            raise FeaturesError(f"{out} holds shards but no {MANIFEST}: refusing to mix; use an empty directory")
        return fresh
    manifest = read_manifest(path)
    manifest.setdefault("aux_layers", [])  # written before aux layers existed: it has none
    try:
        missing = check_same(path, manifest, fresh, CONTENT_KEYS,
                             "these shards belong to another target or data set: use another --out")
    except MismatchError as err:
        raise FeaturesError(str(err)) from None
    if missing:  # a manifest written before they were recorded: record them from now on
        manifest.update({k: fresh[k] for k in missing})
        try:
            write_json_atomic(path, manifest)
        except OSError:
            pass  # a read-only features directory is still readable
    return manifest


def read_manifest(path: Path) -> dict:
    manifest = read_json(path, "a features manifest (an object with a 'shards' list)", FeaturesError)
    if not isinstance(manifest.get("shards"), list):
        raise FeaturesError(f"{path}: not a features manifest (expected an object with a 'shards' list)")
    return manifest


def features_of(target: TargetRef, data: str | Path, out: str | Path,
                settings: FeatureSettings = FeatureSettings()) -> str:
    """`taps features`: extract_features with `target` loaded; returns a summary."""
    manifest = extract_features(target.load(), data, out, settings)
    return (f"features: {manifest['records_done']} records, {manifest['tokens']:,} tokens "
            f"({manifest['assistant_tokens']:,} assistant), {manifest['truncated_records']} truncated, in {out}")


def extract_features(target, data: str | Path, out: str | Path, settings: FeatureSettings = FeatureSettings(),
                     progress=sys.stderr) -> dict:
    """Write (or resume) the features of every record of `data` under `out`; returns the manifest."""
    if target.tokenizer is None:
        raise FeaturesError("the target has no tokenizer: features need its chat template")
    if settings.dtype not in _DTYPES:
        raise FeaturesError(f"unknown dtype {settings.dtype!r}; expected one of {', '.join(_DTYPES)}")
    data, out = Path(data), Path(out)
    records = read_conversations(data)
    check_output_dir(out, "features", inputs=[("--data", data)])  # resumed, never another kind of result
    manifest_path = out / MANIFEST
    if manifest_path.is_file():  # a finished directory is only read: several processes may share it
        manifest = _open_manifest(out, target, data, settings, len(records))
        if manifest.get("complete") and manifest["records_done"] == len(records):
            return manifest
    with output_lock(out, "features"):
        return _extract(target, data, out, records, settings, progress)


def _extract(target, data: Path, out: Path, records: list[dict], settings: FeatureSettings, progress) -> dict:
    manifest = _open_manifest(out, target, data, settings, len(records))
    start_t, done_tokens = time.time(), 0
    bar = tqdm(total=len(records), initial=manifest["records_done"], unit="rec", desc="features", file=progress,
               disable=progress is None, dynamic_ncols=True)
    while manifest["records_done"] < len(records):
        first = manifest["records_done"]
        chunk = records[first:first + settings.records_per_shard]
        encoded = []
        for i, record in enumerate(chunk):
            try:
                ids, mask = encode_conversation(target.tokenizer, record["conversations"], None)
            except ValueError as err:
                raise FeaturesError(f"{data}: record {first + i + 1} (id {record.get('id')!r}): {err}") from None
            manifest["truncated_records"] += len(ids) > settings.max_len
            encoded.append((ids[: settings.max_len], mask[: settings.max_len]))
        layers = (-1, *(layer + 1 for layer in manifest["aux_layers"]))  # hidden_states indices
        hidden = _features_in_batches(target, [ids for ids, _ in encoded], settings, layers)
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        lengths = [len(ids) for ids, _ in encoded]
        tensors = {
            "input_ids": torch.tensor([t for ids, _ in encoded for t in ids], dtype=torch.int32),  # [N]
            "loss_mask": torch.tensor([m for _, mask in encoded for m in mask], dtype=torch.uint8),  # [N]
            "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),  # [R+1]
        }
        stacked = torch.cat(hidden).to(_DTYPES[settings.dtype]).cpu()  # [N, (1 + k) * H]
        h = target.hidden_size
        tensors["hidden"] = stacked[:, :h].contiguous()  # [N, H]
        if manifest["aux_layers"]:
            tensors["aux"] = stacked[:, h:].contiguous()  # [N, k * H]
        tmp = out / f".{name}.tmp"
        save_file(tensors, tmp)
        os.replace(tmp, out / name)
        n_tokens = sum(lengths)
        manifest["shards"].append({"name": name, "first_record": first, "records": len(chunk), "tokens": n_tokens})
        manifest["records_done"] += len(chunk)
        manifest["tokens"] += n_tokens
        manifest["assistant_tokens"] += int(tensors["loss_mask"].sum())
        sources = Counter(manifest["sources"])
        sources.update(str(r.get("source", "unknown")) for r in chunk)
        manifest["sources"] = dict(sources)
        manifest["complete"] = manifest["records_done"] == len(records)
        write_json_atomic(out / MANIFEST, manifest)
        done_tokens += n_tokens
        bar.update(len(chunk))
        bar.set_postfix(tokens=f"{manifest['tokens']:,}", tok_s=f"{done_tokens / max(time.time() - start_t, 1e-9):,.0f}")
    bar.close()
    return manifest


def _features_in_batches(target, sequences: list[list[int]], settings: FeatureSettings,
                         layers: tuple[int, ...] = (-1,)) -> list[torch.Tensor]:
    """Right-padded batches under a padded-token budget; returns one [T_i, len(layers) * H] tensor
    per sequence (the hidden states of `layers`, side by side)."""
    out: list[torch.Tensor | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batch: list[int] = []

    def flush():
        width = max(len(sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        hidden = target.encode(ids, mask, layers)  # [B, T, len(layers) * H]
        for row, i in enumerate(batch):
            out[i] = hidden[row, : len(sequences[i])].cpu()
        batch.clear()

    for i in order:
        width = max([len(sequences[j]) for j in batch] + [len(sequences[i])])
        if batch and width * (len(batch) + 1) > settings.tokens_per_batch:
            flush()
        batch.append(i)
    if batch:
        flush()
    return out  # type: ignore[return-value]


class FeatureShards:
    """Read-only view of a features directory: records by index, each (input_ids, loss_mask, hidden)."""

    def __init__(self, path: str | Path, fingerprint: str | None = None, target_weights: str | None = None):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise FeaturesError(f"{manifest_path}: missing; run `taps features` first")
        self.manifest = read_manifest(manifest_path)
        if fingerprint is not None and self.manifest["tokenizer_fingerprint"] != fingerprint:
            raise FeaturesError(f"{manifest_path}: made for tokenizer {self.manifest['tokenizer_fingerprint']}, "
                                f"not the target's {fingerprint}")
        made_with = self.manifest.get("target_weights")  # absent in manifests written before it was recorded
        if target_weights is not None and made_with is not None and made_with != target_weights:
            raise FeaturesError(f"{manifest_path}: made with target_weights = {made_with!r}, the target has "
                                f"{target_weights!r}; these are another model's features (same tokenizer)")
        self._index = [(s["name"], j) for s in self.manifest["shards"] for j in range(s["records"])]
        self._offsets = {}

        for shard in self.manifest["shards"]:
            try:
                with safe_open(self.path / shard["name"], framework="pt") as f:
                    self._offsets[shard["name"]] = f.get_tensor("offsets")
            except (SafetensorError, OSError) as err:
                raise FeaturesError(f"{self.path / shard['name']}: not a readable features shard ({err})") from None

    def __len__(self) -> int:
        return len(self._index)

    def record_length(self, i: int) -> int:
        """Record i's token count, from the shard offsets (no features read)."""
        name, j = self._index[i]
        return int(self._offsets[name][j + 1] - self._offsets[name][j])

    def token_arrays(self):
        """Per shard, in record order: (first record index, input_ids [N], loss_mask [N], offsets
        [R+1]); the token ids and masks without the hidden states (counting tokens reads no features)."""
        first = 0
        for shard in self.manifest["shards"]:
            with safe_open(self.path / shard["name"], framework="pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            yield first, ids, mask, self._offsets[shard["name"]]
            first += shard["records"]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        name, j = self._index[i]
        lo, hi = int(self._offsets[name][j]), int(self._offsets[name][j + 1])
        keys = ("input_ids", "loss_mask", "hidden", "aux") if self.aux_layers else ("input_ids", "loss_mask", "hidden")
        with safe_open(self.path / name, framework="pt") as f:
            return {key: f.get_slice(key)[lo:hi] for key in keys}

    @property
    def aux_layers(self) -> list[int]:
        """The decoder layers whose outputs the shards hold as `aux` (EAGLE-3's input); [] for none."""
        return list(self.manifest.get("aux_layers") or [])


class FeatureSet:
    """Several features directories, each optionally cut to its first `limit` records, as one set:
    a mixture like "N/2 chat + N/2 math" reuses the features of the single-domain sets (their
    records are in draw order, and a smaller draw is a prefix of a larger one)."""

    def __init__(self, parts: list[tuple[str | Path, int | None]], fingerprint: str | None = None,
                 target_weights: str | None = None):
        if not parts:
            raise FeaturesError("no features directory given")
        self.parts = []
        for path, limit in parts:
            shards = FeatureShards(path, fingerprint, target_weights)
            if limit is not None and limit > len(shards):
                raise FeaturesError(f"{path}: asked for its first {limit:,} records, it has {len(shards):,}")
            self.parts.append((shards, len(shards) if limit is None else limit))
        sizes = {s.manifest["hidden_size"] for s, _ in self.parts}
        prints = {s.manifest["tokenizer_fingerprint"] for s, _ in self.parts}
        if len(sizes) > 1 or len(prints) > 1:
            raise FeaturesError(f"features directories of different targets: hidden sizes {sorted(sizes)}, "
                                f"tokenizers {sorted(prints)}")
        self.hidden_size = sizes.pop()
        aux = {tuple(s.aux_layers) for s, _ in self.parts}
        if len(aux) > 1:
            raise FeaturesError(f"features directories with different aux layers {sorted(aux)}: extract them all with "
                                "the same --aux-layers")
        self.aux_layers = list(aux.pop())
        self.description = " + ".join(f"{s.path}[:{n}]" for s, n in self.parts)

    def identity(self) -> str:
        """Digest of what the training records are: each part's data, tokenizer, settings, shards and
        limit (not target_weights, which older manifests lack; the trainer checks the target apart)."""
        keys = ("tokenizer_fingerprint", "hidden_size", "max_len", "dtype", "data_digest", "records_done", "shards")
        # aux layers only where there are some: the identity of features without them stays what it was
        blob = json.dumps([[{k: s.manifest.get(k) for k in keys} | ({"aux_layers": s.aux_layers} if s.aux_layers else {}),
                            n] for s, n in self.parts], sort_keys=True)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:32]

    @classmethod
    def from_specs(cls, specs: list[str] | str, fingerprint: str | None = None,
                   target_weights: str | None = None) -> "FeatureSet":
        """Specs `DIR` or `DIR:LIMIT` (a last colon-part of digits is the limit)."""
        parts = []
        for spec in [specs] if isinstance(specs, (str, Path)) else specs:
            head, sep, tail = str(spec).rpartition(":")
            parts.append((head, int(tail)) if sep and head and tail.isdigit() else (str(spec), None))
        return cls(parts, fingerprint, target_weights)

    def __len__(self) -> int:
        return sum(n for _, n in self.parts)

    def token_arrays(self):
        """FeatureShards.token_arrays over every part, record indices global to this set and each
        part cut to its limit (a shard past the limit keeps offsets [R'+1] of its first R' records)."""
        base = 0
        for shards, n in self.parts:
            for first, ids, mask, offsets in shards.token_arrays():
                if first >= n:
                    break
                yield base + first, ids, mask, offsets[: min(n - first, offsets.numel() - 1) + 1]
            base += n

    def _locate(self, i: int) -> tuple[FeatureShards, int]:
        for shards, n in self.parts:
            if i < n:
                return shards, i
            i -= n
        raise IndexError(i)

    def record_length(self, i: int) -> int:
        """Record i's token count (no features read): what the trainer groups micro-batches by."""
        shards, j = self._locate(i)
        return shards.record_length(j)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shards, j = self._locate(i)
        return shards[j]
