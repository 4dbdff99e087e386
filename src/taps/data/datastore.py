"""`taps lookup build`: a retrieval datastore (propose/rest.py) from chat records, the
target's own answers (`taps data regenerate` output, or any `{"conversations": [{role, content}]}`
JSONL).

Each assistant turn becomes one segment, tokenized as the decoder sees it: the conversation goes
through the target's chat template (data/chat.encode_conversation, the assistant mask that trains
drafters), and a segment is the assistant content with its end-of-turn token, preceded by its role
header (the tokens from the last special token before the content: ChatML's `<|im_start|>
assistant\\n`, which every prompt the decoder renders ends with, so the first tokens of an answer
are drafted too). User and system turns are not stored: only the target's own words are.
A tokenizer without a chat template stores the assistant contents as plain text.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import AutoTokenizer

from taps.data.chat import encode_conversation, special_ids
from taps.core.jsonl import read_json_lines
from taps.core.outputs import check_output_dir
from taps.propose.rest import INDEX_DEPTH, MANIFEST, Datastore, DatastoreError, is_datastore, write_datastore
from taps.core.target import tokenizer_fingerprint
from taps.core.targets import resolve_target, target_name


def assistant_segments(tokenizer, conversations: list[dict], special: set[int] | None = None) -> list[list[int]]:
    """The segments of one conversation: each assistant turn with its role header (module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer(t["content"], add_special_tokens=False)["input_ids"] for t in conversations
                if t["role"] == "assistant" and t["content"]]
    ids, mask = encode_conversation(tokenizer, conversations)
    special = special_ids(tokenizer) if special is None else special
    segments, i = [], 0
    while i < len(ids):
        if not mask[i]:
            i += 1
            continue
        end = i
        while end < len(ids) and mask[end]:
            end += 1
        head = i
        while head > 0 and not mask[head - 1] and ids[head] not in special:
            head -= 1
        segments.append(ids[head:end])
        i = end
    return segments


def _conversations(path: Path, lineno: int, record) -> list[dict]:
    where = f"{path}:{lineno}"
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        raise DatastoreError(f"{where}: expected an object with a 'conversations' list of {{role, content}}")
    for k, turn in enumerate(record["conversations"]):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise DatastoreError(f"{where}: conversations[{k}] is not a {{\"role\": str, \"content\": str}} turn")
    return [{"role": t["role"], "content": t["content"]} for t in record["conversations"]]


def build_datastore(records: list[str | Path], target: str, out: str | Path, depth: int = INDEX_DEPTH,
                    force: bool = False) -> str:
    """Tokenize the assistant turns of every record file with the target's tokenizer, write the
    datastore to `out` and load it once (which builds and saves its index). Returns a summary.
    A datastore already in `out` is rebuilt only with `force` (taps.core.outputs)."""
    if not records:
        raise DatastoreError("--records: give at least one JSONL file")
    if not 1 <= depth <= 64:
        raise DatastoreError(f"--index-depth {depth}: expected 1..64")
    paths = [Path(r) for r in records]
    for path in paths:
        if not path.is_file():
            raise DatastoreError(f"--records {path}: no such file")
    out = check_output_dir(out, "datastore", force=force, inputs=[("--records", path) for path in paths])
    if out.is_dir() and any(out.iterdir()) and not is_datastore(out):
        raise DatastoreError(f"--out {out}: a directory that holds other files; expected a new or empty directory, "
                             "or a datastore to rebuild")
    t0 = time.perf_counter()
    model_dir = resolve_target(target)
    if not model_dir.is_dir():
        raise DatastoreError(f"--target {target}: no such model directory (expected a Hugging Face model directory, "
                             "a .gguf file or a known name)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise DatastoreError(f"--target {target}: no loadable tokenizer ({err})") from None
    special = special_ids(tokenizer)
    segments, sources = [], []
    for path in paths:
        before, turns = len(segments), 0
        for lineno, record in read_json_lines(path, DatastoreError):
            conversations = _conversations(path, lineno, record)
            turns += sum(t["role"] == "assistant" for t in conversations)
            try:
                segments.extend(assistant_segments(tokenizer, conversations, special))
            except ValueError as err:
                raise DatastoreError(f"{path}:{lineno}: {err}") from None
        if len(segments) == before:
            raise DatastoreError(f"{path}: no assistant turns; expected chat records with assistant answers")
        sources.append({"file": str(path), "segments": len(segments) - before, "assistant_turns": turns})
    meta = {"target": target_name(target), "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "sources": sources, "chat_template": bool(getattr(tokenizer, "chat_template", None))}
    manifest = write_datastore(out, segments, meta, depth)
    tokenized = time.perf_counter() - t0
    store = Datastore.load(out)
    return (f"wrote {Path(out) / MANIFEST}: {manifest['tokens']:,} tokens in {manifest['segments']:,} assistant "
            f"segments from {len(paths)} file(s); tokenized in {tokenized:.1f} s, index (depth {depth}) built in "
            f"{store.load_seconds:.1f} s")
