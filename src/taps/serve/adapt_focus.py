"""`taps adapt --focus lookup-misses`: fine-tune a head only on the answer tokens the lookup
member would not have drafted.

Why: a server with --learn serves the head merged with a lookup member that drafts from the
prompt and from the online datastore of earlier answers. On a stream of one format that member
already drafts much of what an adapted head learns: in docs/learn.md's JSON-extraction runs the
adapted head's own held-out acceptance rose from 2.94 to 3.46 while the merge's stayed where it
was. Taking the head's loss only where lookup fails spends the fine-tune where the merge needs
the head.

A token is *covered* when the lookup member, replayed over its record as the server saw it,
drafts it as its first choice at depth 1: prompt lookup over the context so far (the prompt and
the answer up to that token), then the datastore of the answers logged before this one (the
online store's segments, serve/online_store.answer_segment). First choice = the depth-1 node
with the highest score, under the proposer's starting estimates (prompt lookup before the
datastore, each in its own order). The rest of a record is unchanged: the head still reads every
feature as context; covered tokens only drop out of the loss.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from taps.core.config import TreeConfig
from taps.core.jsonl import read_json, write_json_atomic
from taps.data.chat import answer_spans
from taps.data.features import MANIFEST
from taps.propose.lookup import LookupProposer, LookupSpec
from taps.propose.rest import Datastore
from taps.serve.online_store import answer_segment

FOCUS = ("all", "lookup-misses")


def first_choice(proposer: LookupProposer) -> int | None:
    """The lookup tree's best depth-1 token (None: it drafts nothing here)."""
    tree = proposer.propose()
    children = (tree.parents == 0).nonzero().flatten()  # [C] depth-1 nodes
    if children.numel() == 0:
        return None
    return int(tree.tokens[children[tree.logp[children].argmax()]])


def covered_mask(records: list[tuple[list[int], list[int]]], special: set[int]) -> list[list[bool]]:
    """Per record (input_ids, loss_mask), in log order: True at the answer tokens the lookup member
    would have drafted as its first choice (module docstring)."""
    out, segments = [], []
    for ids, mask in records:
        covered = [False] * len(ids)
        store = Datastore.of_segments(segments) if segments else None
        spans = answer_spans(mask)
        for start, end in spans:
            proposer = LookupProposer(TreeConfig(), LookupSpec(datastore=store))
            proposer.start(torch.empty(0), torch.tensor(ids[:start], dtype=torch.long))
            for t in range(start, end):
                covered[t] = first_choice(proposer) == ids[t]
                proposer.advance([ids[t]])
        segments.extend(answer_segment(ids[:start], ids[start:end], special) for start, end in spans)
        out.append(covered)
    return out


def focus_features(src: str | Path, dst: str | Path, special: set[int]) -> dict:
    """A copy of the features directory `src` in `dst` whose loss mask drops the covered tokens
    (written into a temporary directory, then renamed: a killed run leaves no half copy). Its
    manifest's data digest names the focus, so a trainer never resumes across the two. Returns
    {"answer_tokens", "covered"}; an existing complete `dst` is read, not rebuilt."""
    src, dst = Path(src), Path(dst)
    if (dst / MANIFEST).is_file():
        return read_json(dst / MANIFEST, "a features manifest")["focus"]
    manifest = read_json(src / MANIFEST, "a features manifest")
    shards = {s["name"]: load_file(src / s["name"]) for s in manifest["shards"]}
    records = []
    for name in shards:
        ids, mask, offsets = (shards[name][k].tolist() for k in ("input_ids", "loss_mask", "offsets"))
        records += [(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    covered = covered_mask(records, special)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    flat = iter(c for record in covered for c in record)
    answer_tokens = n_covered = 0
    for name, tensors in shards.items():
        mask = tensors["loss_mask"].clone()  # [N]
        keep = torch.tensor([not next(flat) for _ in range(mask.numel())])  # [N]
        answer_tokens, n_covered = answer_tokens + int((mask != 0).sum()), n_covered + int(((mask != 0) & ~keep).sum())
        save_file({**tensors, "loss_mask": torch.where(keep, mask, torch.zeros_like(mask))}, tmp / name)
    focus = {"focus": "lookup-misses", "answer_tokens": answer_tokens, "covered": n_covered}
    manifest.update(data_digest=f"{manifest['data_digest']}+lookup-misses", focus=focus,
                    assistant_tokens=answer_tokens - n_covered)
    write_json_atomic(tmp / MANIFEST, manifest)
    os.replace(tmp, dst)
    return focus
