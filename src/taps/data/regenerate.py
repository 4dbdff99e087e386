"""Regeneration: replace every assistant turn of a data set with the target's own response.

A drafter trained on the target's own outputs matches the target better than one trained on the
data set's responses (the improvement users of EAGLE and SpecForge ask for). Each conversation is
replayed turn by turn through a ChatSession, so a later user turn follows the target's earlier
answers, exactly as at inference.

Batched (`batch_size` > 1, no drafter): the records are answered B at a time with transformers'
own `generate` (left padding), turn by turn across the batch. On a CPU one forward of 64
sequences costs about twice one of a single sequence, so this is an order of magnitude faster
(`bench/regenerate_speed.py`). Greedy answers are the target's greedy answers up to the rounding
of a padded batch, exact in float32 (tested); in bf16 a near-tie can flip. Sampled batches are
seeded per batch, not per record.

`max_turns` keeps the first K user turns of each conversation (and drops the rest), for data
whose later turns would be cut by the features' maximum length anyway.

Through a server (`regenerate_endpoint`, `--endpoint URL`): the same records from any
OpenAI-compatible server that serves the target (vLLM or SGLang on a cluster, `taps serve`
here), `concurrency` records in flight, through the client of data/regenerate_http.py; if the
server goes away, what is written stays and a rerun resumes.

Resumable: one JSON line per finished record, written in a single write and fsync'ed; a rerun
skips every id already in the output, and drops a torn last line left by a crash.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from taps.core.config import DecodeConfig, SamplingConfig, check_at_least, setting
from taps.data.features import read_conversations
from taps.data.regenerate_http import Endpoint, EndpointError, EndpointSettings
from taps.core.decode import ChatSession, chat_ids, reply_text
from taps.drafter.checkpoint import load_head
from taps.core.jsonl import JsonlFormatError, append_jsonl, read_jsonl
from taps.core.outputs import check_output_file
from taps.propose.single import SingleProposer
from taps.core.target import TargetRef


@dataclass
class RegenerateSettings:
    # `taps data regenerate`'s options (cli/args.add_settings)
    max_new_tokens: int = setting(512, at_least=1)
    temperature: float = setting(0.0, "0 = greedy")
    top_p: float = setting(1.0)
    seed: int = setting(0)
    batch_size: int = setting(1, "answer B records at a time with transformers' generate (left padding; no "
                                 "--drafter); an order of magnitude faster on a CPU at B = 32-64", at_least=1)
    max_turns: int | None = setting(None, "keep the first K user turns of each conversation", at_least=1)
    max_prompt_tokens: int | None = setting(None, "skip records whose first prompt (chat template included) is "
                                                  "longer; they are counted", at_least=1)
    limit: int | None = setting(None, "answer at most N records in all, the first N in the order they are answered "
                                      "(shortest first when batched): a run cut at N reproduces, and a rerun "
                                      "continues, the same N", at_least=1)

    def __post_init__(self) -> None:
        check_at_least(self)


def _done_ids(out: Path) -> set[str]:
    """Ids already written; a torn last line (crash during a write) is cut off."""
    try:
        rows, _ = read_jsonl(out, repair_torn=True)
    except JsonlFormatError as err:
        raise ValueError(f"{err}; refusing to append to it") from None
    for lineno, row in rows:
        if "id" not in row:
            raise ValueError(f"{out}: line {lineno} is not a regenerated record; refusing to append to it")
    return {str(row["id"]) for _, row in rows}


def _pending(data: Path, out: Path, settings: RegenerateSettings) -> tuple[int, int, list[tuple[int, dict]]]:
    """(records in data, records already in out, [(index, record cut to max_turns)] still to do).
    `out` must be a regular file (or new) and not `data` itself (taps.core.outputs)."""
    check_output_file(out, "--out", [("--data", data)])
    records = read_conversations(data)
    ids = [str(r.get("id", i)) for i, r in enumerate(records)]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{data}: record id {dup!r} appears more than once; ids must be unique to resume")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out)
    return len(records), len(done), [(i, _first_turns(r, settings.max_turns)) for i, r in enumerate(records)
                                     if ids[i] not in done]


def _report(progress, done: int, total: int, n: int, todo: int, start: float) -> None:
    rate = n / max(time.time() - start, 1e-9)
    print(f"regenerate: {done + n}/{total} records, {rate:.2f} records/s, ETA {(todo - n) / rate / 60:.1f} min",
          file=progress, flush=True)


def regenerate(target, data: str | Path, out: str | Path, settings: RegenerateSettings = RegenerateSettings(),
               proposer=None, progress=sys.stderr) -> int:
    """Regenerate every record of `data` not yet in `out`; returns how many were written now."""
    data, out = Path(data), Path(out)
    _, done, todo = _pending(data, out, settings)
    base = DecodeConfig(max_new_tokens=settings.max_new_tokens,
                        sampling=SamplingConfig(settings.temperature, settings.top_p),
                        stop_token_ids=target.stop_token_ids())
    if settings.batch_size > 1 and proposer is not None:
        raise ValueError("batched regeneration uses transformers' generate; a drafter needs batch_size 1")
    written, start = 0, time.time()
    if settings.max_prompt_tokens is not None:
        lengths = {i: len(chat_ids(target.tokenizer, _first_prompt(r))) for i, r in todo}
        skipped = [i for i, _ in todo if lengths[i] > settings.max_prompt_tokens]
        todo = [(i, r) for i, r in todo if lengths[i] <= settings.max_prompt_tokens]
        if skipped and progress is not None:
            print(f"regenerate: skipping {len(skipped)} record(s) whose first prompt is over "
                  f"{settings.max_prompt_tokens} tokens", file=progress, flush=True)
    step = settings.batch_size
    if step > 1:  # similar prompt lengths share a batch: less padding (the output order follows)
        todo.sort(key=lambda item: answer_order(item[1]))
    if settings.limit is not None:  # the records already written were this order's prefix, so the rest continues it
        todo = todo[:max(0, settings.limit - done)]
    total = done + len(todo)  # what the output will hold: the skipped records and those past --limit not counted
    for n0 in range(0, len(todo), step):
        chunk = todo[n0:n0 + step]
        if step == 1:
            i, record = chunk[0]
            new_records = [_regenerate_one(target, record, replace(base, seed=settings.seed * 1_000_003 + i), proposer)]
        else:
            new_records = _regenerate_batch(target, [r for _, r in chunk], base, settings.seed * 1_000_003 + chunk[0][0])
        for record in new_records:
            record["regenerated"].update(temperature=settings.temperature, seed=settings.seed)
        append_jsonl(out, new_records)
        written += len(new_records)
        n = n0 + len(chunk)
        if progress is not None and (n % 10 < len(chunk) or n == len(todo)):
            _report(progress, done, total, n, len(todo), start)
    return written


def regenerate_file(target: TargetRef | None, data: str | Path, out: str | Path,
                    settings: RegenerateSettings = RegenerateSettings(), drafter: str | None = None,
                    endpoint: str | None = None, via: EndpointSettings | None = None) -> str:
    """`taps data regenerate`: regenerate() on `target`, loaded here, speculatively
    with the drafter directory `drafter` if given; or, with `endpoint` (a URL) instead of a target,
    regenerate_endpoint() through that server with the options `via`. Returns what was written."""
    via = via or EndpointSettings()
    if endpoint is not None:
        if target is not None:
            raise ValueError("--target and --endpoint are exclusive: decode here or on the server, not both")
        if drafter:
            raise ValueError("--drafter is for the local path; with --endpoint the server decodes (start it with its "
                             "drafters, e.g. taps serve --drafter)")
        client = Endpoint(endpoint, model=via.model, api_key=via.api_key or os.environ.get("OPENAI_API_KEY"),
                          retries=5 if via.retries is None else via.retries)
        written = regenerate_endpoint(client, data, out, settings, concurrency=via.concurrency or 1)
        return f"regenerated {written:,} records into {out} through {client.url}"
    given = [f.name for f in fields(EndpointSettings) if getattr(via, f.name) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} is for --endpoint; the local path decodes one record at "
                         "a time (or --batch-size)")
    if target is None:
        raise ValueError("name the target: --target DIR (decode here) or --endpoint URL (decode on a server)")
    loaded = target.load()
    proposer = SingleProposer(load_head(drafter, loaded)) if drafter else None
    return f"regenerated {regenerate(loaded, data, out, settings, proposer):,} records into {out}"


def _first_prompt(record: dict) -> list[dict]:
    """The messages up to and including the first user turn."""
    turns = record["conversations"]
    first_user = next((k for k, t in enumerate(turns) if t["role"] == "user"), len(turns) - 1)
    return turns[:first_user + 1]


def answer_order(record: dict) -> int:
    """The key batched regeneration answers records by (shortest first: similar lengths share a
    batch): the JSON length of the record's conversation as regeneration reads it (`_first_turns`)."""
    return len(json.dumps(record["conversations"]))


def _first_turns(record: dict, max_turns: int | None) -> dict:
    if max_turns is None:
        return record
    kept, users = [], 0
    for turn in record["conversations"]:
        users += turn["role"] == "user"
        if users > max_turns:
            break
        kept.append(turn)
    return {**record, "conversations": kept}


def _regenerate_batch(target, records: list[dict], cfg: DecodeConfig, seed: int) -> list[dict]:
    """Every record of the batch answered turn by turn: the k-th user turns of all records that
    have one go through one left-padded `generate` call."""
    tok = target.tokenizer
    stop = list(cfg.stop_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop[0]
    messages = [[t for t in r["conversations"][:1] if t["role"] == "system"] for r in records]
    users = [[t["content"] for t in r["conversations"] if t["role"] == "user"] for r in records]
    stops: list[list[str]] = [[] for _ in records]
    new_tokens = [0] * len(records)
    gen = torch.Generator(device=target.device).manual_seed(seed)
    for turn in range(max((len(u) for u in users), default=0)):
        active = [j for j, u in enumerate(users) if turn < len(u)]
        prompts = []
        for j in active:
            messages[j].append({"role": "user", "content": users[j][turn]})
            prompts.append(chat_ids(tok, messages[j]))
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)  # [B, W]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)  # [B, W]
        sampling = cfg.sampling
        options = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        with torch.inference_mode():
            if not sampling.greedy:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            out = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                        eos_token_id=stop, pad_token_id=pad, **options)  # [B, W + new]
        for row, j in enumerate(active):
            answer = out[row, width:].tolist()
            end = next((k for k, t in enumerate(answer) if t in stop), None)
            answer = answer if end is None else answer[:end + 1]
            stops[j].append("stop_token" if end is not None else "max_new_tokens")
            new_tokens[j] += len(answer)
            reply = reply_text(tok, answer, stop)
            messages[j].append({"role": "assistant", "content": reply})
    return [{**r, "conversations": m, "regenerated": {"original_turns": len(r["conversations"]), "stop_reasons": s,
                                                      "new_tokens": t, "batch_size": len(records)}}
            for r, m, s, t in zip(records, messages, stops, new_tokens)]


def _regenerate_one(target, record: dict, cfg: DecodeConfig, proposer) -> dict:
    session = ChatSession(target, proposer, cfg)

    def answer(messages: list[dict]) -> tuple[str, str, int]:
        session.messages = messages[:-1]
        reply, result = session.send(messages[-1]["content"])
        return reply, result.stop_reason, len(result.tokens)

    return _replay(record, answer)


def _replay(record: dict, answer) -> dict:
    """The record with every assistant turn replaced by answer(messages so far) -> (reply,
    stop reason, new tokens), turn by turn (a later user turn follows the earlier replies)."""
    turns = record["conversations"]
    system = turns[0]["content"] if turns and turns[0]["role"] == "system" else None
    messages = [{"role": "system", "content": system}] if system else []
    stops, new_tokens = [], 0
    for turn in turns:
        if turn["role"] == "user":
            messages.append({"role": "user", "content": turn["content"]})
            reply, stop, n = answer(messages)
            messages.append({"role": "assistant", "content": reply})
            stops.append(stop)
            new_tokens += n
    return {**record, "conversations": messages,
            "regenerated": {"original_turns": len(turns), "stop_reasons": stops, "new_tokens": new_tokens}}


def regenerate_endpoint(endpoint: Endpoint, data: str | Path, out: str | Path,
                        settings: RegenerateSettings = RegenerateSettings(), concurrency: int = 1,
                        progress=sys.stderr) -> int:
    """`regenerate` through an OpenAI-compatible server (vLLM, SGLang, `taps serve`) that serves the
    target: the same records (greedy: the same answers, when the server renders the chat template
    as the target's tokenizer does), the same resume. `concurrency` records are in flight at once;
    each is written when it finishes (so with concurrency > 1 in finishing order; ids say which is
    which). If the server goes away, the records finished so far are kept and EndpointError says
    to rerun."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if settings.batch_size > 1 or settings.max_prompt_tokens is not None or settings.limit is not None:
        raise ValueError("--batch-size, --max-prompt-tokens and --limit are for the local path; with --endpoint the "
                         "server batches, refuses prompts beyond its context window, and answers finish out of order")
    data, out = Path(data), Path(out)
    total, done, todo = _pending(data, out, settings)
    if not todo:
        return 0
    endpoint.served_model()  # fails before any work if the server is not there

    def one(index: int, record: dict) -> dict | str:
        seed = settings.seed * 1_000_003 + index
        try:
            new = _replay(record, lambda messages: endpoint.chat(messages, settings.max_new_tokens, settings.temperature,
                                                                 settings.top_p, seed))
        except EndpointError as err:
            if err.too_long:
                return str(err)
            raise
        new["regenerated"].update(temperature=settings.temperature, seed=settings.seed)
        return new

    written, skipped, start = 0, [], time.time()

    def keep(result: dict | str) -> None:
        nonlocal written
        if isinstance(result, str):
            skipped.append(result)
            return
        append_jsonl(out, [result])
        written += 1
        if progress is not None and (written % 10 == 0 or written + len(skipped) == len(todo)):
            _report(progress, done, total, written, len(todo), start)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        order = {pool.submit(one, i, r): i for i, r in todo}
        pending, failure = set(order), None
        while pending and failure is None:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=order.get):
                if future.exception() is not None:
                    failure = failure or future.exception()
                    continue
                keep(future.result())
        if failure is not None:
            for future in pending:
                future.cancel()
            for future in sorted(wait(pending).done, key=order.get):  # those already running: keep what finishes
                if not future.cancelled() and future.exception() is None:
                    keep(future.result())
            raise EndpointError(f"{failure} ({written} record(s) written in this run)") from None
    if skipped and progress is not None:
        print(f"regenerate: skipped {len(skipped)} record(s) the server refused as too long for its context window "
              f"(the first: {skipped[0]})", file=progress, flush=True)
    return written
