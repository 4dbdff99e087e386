"""A server that learns its workload (issue 31): acceptance length and tokens/s per window of
requests of a task none of the shipped heads was trained on, for three runs over the same stream:

  off      `taps serve` as before: no --learn
  store    --learn: the lookup member also drafts from the online datastore of earlier answers
  adapt    --learn, and after --adapt-after requests one `taps adapt` (its own process; the stream
           waits for it, so its CPU time does not count against the server's), whose new version
           the server swaps in before the next request (if the adaptation wrote one)
  plain    no drafting (every request plain decoding, nothing learned): the reference that
           bench/compare_answers.py checks the other runs' answers against where outputs may
           differ (bf16: a tree forward rounds differently from a one-token forward)

Not a test: it prints figures; run it on an idle machine. The task (public data available
offline): translating GSM8K *train* questions into French (`--task translate`: SmolLM2-135M cannot,
and most answers loop), summarising them in one sentence (`--task summarise`) or extracting their
people, items and numbers as JSON (`--task extract-json`: a format of the user's own); the heads were
trained on chat (ShareGPT) and math answers (the math heads on answers to these very GSM8K train
questions), never on translations, summaries or extractions.
`--questions FILE` takes any FastChat question.jsonl instead (Spec-Bench's translation category, say).

The machine's speed drifts while a run lasts (10-30 % within minutes on the shared 2-core machines
of docs/learn.md, 2x once), and the goal compares the first window with the last, half an hour
apart. So every --gauge-every requests a run also decodes one fixed prompt (the first question past
the stream, or the first when there is none) twice, neither learned from: plain decoding
(--gauge-tokens / 2 tokens), and the head alone from a copy of its directory that no swap touches
(--gauge-tokens tokens). Their tokens/s per window are printed beside the stream's, and the goals'
tokens/s ratios are printed both as measured and over the head gauge of their windows (the same
work at the same time: what the machine's speed did, taken out).

Each request is greedy, one client at a time; the variant is the same in every run,
`merge-budget:HEAD,lookup` (under --tree auto, lookup's nodes join where they pay). Counted and
printed per run: lost requests (no answer) and failed ones (an error answer), and answers that
differ from the `off` run's (0 expected in float32: learning changes only what is drafted; a run
without `off` is checked against an earlier results.json's with --compare-to, by answer digest).
The goals (issue 31), checked on the printed figures:
  - adapt: last window's acceptance length >= 1.5x the first's, tokens/s >= 1.3x;
  - store: tokens/s over the whole stream >= 1.15x off's.

    python bench/serve_adapt.py --target smollm2-135m-instruct --drafters models/smollm2-135m-instruct/drafters \\
        --head eagle2-mixed-xl --task extract-json --requests 200 --window 25 --adapt-after 100 --max-tokens 200 \\
        --data-dir ../shared/data --dtype float32 --tree auto --out runs/serve_adapt_json

(docs/learn.md has this run and the translate one.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from taps.cli.args import add_tree_arguments, speculation_from, target_ref
from taps.core.jsonl import read_json_lines, write_json_atomic

RUNS = ("off", "store", "adapt", "plain")  # the module docstring says what each one is

TASKS = {
    "translate": "Translate the following text into French. Reply with the translation only.\n\n{q}",
    "summarise": "Summarise the following text in one sentence.\n\n{q}",
    # a format of the user's own: the same JSON shape on every request (what an online datastore and an
    # adapted head can learn from earlier answers); SmolLM2 answers it in JSON, mostly without loops
    "extract-json": 'Extract the people, the items and the numbers from the following text. Answer in JSON with '
                    'the keys "people", "items" and "numbers".\n\n{q}',
}


def questions(args) -> list[str]:
    if args.questions:
        rows = [row for _, row in read_json_lines(args.questions)]
        texts = [row["turns"][0] for row in rows]
    else:
        rows = [row for _, row in read_json_lines(Path(args.data_dir) / "gsm8k" / "train.jsonl")]
        texts = [TASKS[args.task].format(q=row["question"]) for row in rows]
    if len(texts) < args.requests:
        raise SystemExit(f"{len(texts)} questions, fewer than --requests {args.requests}")
    return texts


def gauge_name(head: str) -> str:
    return f"{head}-gauge"


def gauge_dir(args, out: Path) -> Path:
    """A copy of the head's directory for the gauge: the server's pool keys heads by directory and a
    swap replaces the head of --head's, so the gauge reads its own copy, version 0 for good."""
    copy = out / gauge_name(args.head)
    if not copy.exists():
        shutil.copytree(Path(args.drafters) / args.head, copy.with_suffix(".tmp"), dirs_exist_ok=True)
        copy.with_suffix(".tmp").rename(copy)
    return copy


def measure_gauge(client, args, prompt: str, after: int) -> list[dict]:
    """The fixed prompt, plain and by the head alone, not learned from; a gauge that fails is
    recorded as such (the stream goes on)."""
    rows = []
    for label, variant, tokens in (("plain", "plain", max(args.gauge_tokens // 2, 1)),
                                   ("head", gauge_name(args.head), args.gauge_tokens)):
        try:
            reply = client.chat.completions.create(
                model="target", messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
                extra_body={"taps": {"variant": variant, "learn": False}})
            u = reply.usage.model_extra
            rows.append({"after": after, "variant": label,
                         "tokens": reply.usage.completion_tokens, "calls": u["verifier_calls"],
                         "seconds": reply.usage.completion_tokens / u["tokens_per_second"]
                         if u.get("tokens_per_second") else None})
        except Exception as err:
            rows.append({"after": after, "variant": label, "error": f"{type(err).__name__}: {err}"})
    return rows


def run(args, name: str, stream: list[str], learn: Path | None, adapt_after: int | None,
        gauge: tuple[str, Path] | None = None) -> dict:
    """One run of the stream through a fresh server; per request: usage figures or the error; per
    gauge (prompt, head copy), every --gauge-every requests: its two decodes."""
    import openai

    from taps.serve.app import Limits, create_app, serving
    from taps.serve.engine import Engine
    from taps.serve.learn import Learner
    from taps.serve.swap import HeadSwapper

    head_dir = str(Path(args.drafters) / args.head)
    drafters = [(args.head, head_dir)] + ([(gauge_name(args.head), str(gauge[1]))] if gauge else [])
    engine = Engine.load(target_ref(args), drafters, [f"learning=merge-budget:{args.head},lookup"],
                         speculation_from(args), model_id="target")
    learner = Learner(learn, engine) if learn is not None else None
    swapper = HeadSwapper(learn, engine, check_after=args.check_after, poll_s=None) if learn is not None else None
    rows, gauges, adapted = [], [], None
    body = {"taps": {"variant": "plain", "learn": False}} if name == "plain" else None
    with serving(create_app(engine, Limits(max_tokens=args.max_tokens), learner=learner, swapper=swapper)) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        for i, text in enumerate(stream):
            if adapt_after is not None and i == adapt_after:
                learner.flush()
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "taps", "adapt", str(learn), "--head", args.head,
                                       "--target", args.target, "--base", head_dir, "--holdout", str(args.holdout),
                                       "--device", args.device, "--focus", args.focus, "--judge", args.judge],
                                      capture_output=True, text=True)
                adapted = {"seconds": round(time.perf_counter() - start, 1), "rc": done.returncode,
                           "output": (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()[-1:]}
                print(f"  {name}: adapt after {i} requests: {adapted}", flush=True)
                swapper.scan()
            try:
                reply = client.chat.completions.create(model="target", messages=[{"role": "user", "content": text}],
                                                       max_tokens=args.max_tokens, temperature=0, extra_body=body)
                u = reply.usage.model_extra
                rows.append({"i": i, "text": reply.choices[0].message.content, "tokens": reply.usage.completion_tokens,
                             "calls": u["verifier_calls"], "seconds": reply.usage.completion_tokens / u["tokens_per_second"]
                             if u.get("tokens_per_second") else None,
                             "phases": u.get("seconds"), "tree_tokens": u.get("mean_tree_tokens")})
            except Exception as err:  # counted, the stream goes on
                rows.append({"i": i, "error": f"{type(err).__name__}: {err}"})
            if learner is not None:  # requests spaced out: each one drafts from every earlier answer (reproducible)
                learner.flush()
            if gauge is not None and i % args.gauge_every == args.gauge_every // 2:  # mid-way through each group
                gauges.extend(measure_gauge(client, args, gauge[0], i))
            if (i + 1) % args.window == 0:
                part = [r for r in rows[-args.window:] if "error" not in r]
                calls = sum(r["calls"] for r in part)
                print(f"  {name}: {i + 1}/{len(stream)} requests, last window's acceptance "
                      f"{sum(r['tokens'] for r in part) / max(calls, 1):.2f}", flush=True)
        if learner is not None:
            learner.flush()
    versions = swapper.rows() if swapper is not None else []
    return {"run": name, "rows": rows, "adapt": adapted, "versions": versions, "gauges": gauges}


def rate(rows: list[dict]) -> float:
    """tokens/s of these rows together (0.0: none timed)."""
    seconds = sum(r["seconds"] or 0.0 for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds else 0.0


def windows(result: dict, size: int) -> list[dict]:
    """Per window of `size` requests: acceptance and tokens/s of its answers, and the tokens/s of the
    gauges measured inside it (0.0 where none)."""
    out = []
    ok = [r for r in result["rows"] if "error" not in r]
    gauges = [g for g in result.get("gauges", []) if "error" not in g]
    for start in range(0, max(r["i"] for r in result["rows"]) + 1, size):
        part = [r for r in ok if start <= r["i"] < start + size]
        tokens, calls = sum(r["tokens"] for r in part), sum(r["calls"] for r in part)
        inside = [g for g in gauges if start <= g["after"] < start + size]
        out.append({"requests": f"{start + 1}-{start + size}", "acceptance": tokens / calls if calls else 0.0,
                    "tokens_per_s": rate(part), **step_split(part),
                    "gauge_plain_tokens_per_s": rate([g for g in inside if g["variant"] == "plain"]),
                    "gauge_head_tokens_per_s": rate([g for g in inside if g["variant"] == "head"])})
    return out


def step_split(rows: list[dict]) -> dict:
    """Where these requests' steps went: per draft/verify step, ms of drafting, of the target's tree
    forwards and of the rest, and the mean tree size (empty: rows from before usage had them)."""
    timed = [r for r in rows if r.get("phases") and r.get("tree_tokens") is not None]
    steps = sum(r["calls"] - 1 for r in timed)
    if not steps:
        return {}
    per_step = {f"step_{phase}_ms": 1e3 * sum(r["phases"][phase] for r in timed) / steps
                for phase in ("draft", "target", "other")}
    return {**per_step, "tree_tokens": sum(r["tree_tokens"] * (r["calls"] - 1) for r in timed) / steps}


def over_gauge(window: dict) -> float | None:
    """The window's tokens/s over its head gauge's (None: no gauge in it)."""
    return window["tokens_per_s"] / window["gauge_head_tokens_per_s"] if window["gauge_head_tokens_per_s"] else None


def digest(text: str) -> str:
    """What results.json keeps of an answer: enough to tell a later run's answers from this one's."""
    return hashlib.sha256(text.encode()).hexdigest()


def request_record(row: dict) -> dict:
    """A request as results.json keeps it: its figures (or error), and its answer as a digest."""
    record = {k: v for k, v in row.items() if k != "text"}
    if "text" in row:
        record["answer_sha256"] = digest(row["text"])
    return record


def reference_answers(results: dict, compare_to: str | None) -> dict[int, str]:
    """Request index -> answer digest of learning off: this invocation's `off` run, else the `off`
    run of an earlier results.json (--compare-to), else none."""
    if "off" in results:
        return {r["i"]: digest(r["text"]) for r in results["off"]["rows"] if "text" in r}
    if compare_to is None:
        return {}
    earlier = json.loads(Path(compare_to).read_text())
    rows = earlier.get("runs", {}).get("off", {}).get("requests", [])
    if not rows or any("answer_sha256" not in r for r in rows if "error" not in r):
        raise SystemExit(f"--compare-to {compare_to}: no `off` run with answer digests (written since session 28)")
    return {r["i"]: r.get("answer_sha256") for r in rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafters", default="models/smollm2-135m-instruct/drafters")
    p.add_argument("--head", default="eagle2-mixed-xl", help="a head of --drafters (EAGLE-2 / HASS: what taps adapt fine-tunes)")
    p.add_argument("--task", choices=sorted(TASKS), default="translate")
    p.add_argument("--questions", help="a FastChat question.jsonl to stream instead of --task")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--adapt-after", type=int, default=100)
    p.add_argument("--holdout", type=int, default=20)
    p.add_argument("--focus", default="all", choices=["all", "lookup-misses"],
                   help="taps adapt --focus: the answer tokens its loss takes")
    p.add_argument("--judge", default="head", choices=["head", "merge"],
                   help="taps adapt --judge: the held-out acceptance of the head alone or merged with lookup")
    p.add_argument("--check-after", type=int, default=20, help="the server's rollback window (--learn-check-after)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--data-dir", default=os.environ.get("TAPS_DATA_DIR") or "../shared/data")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--runs", default="off,store,adapt", help=f"comma-separated, in order: {', '.join(RUNS)}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the server (default 1: beside the server's own threads, torch's default of "
                        "every core oversubscribes a 2-core machine and its tokens/s stop meaning anything)")
    p.add_argument("--gauge-every", type=int, default=5,
                   help="decode the gauge prompt after every this many requests (0: no gauge)")
    p.add_argument("--gauge-tokens", type=int, default=64, help="the head gauge's tokens (plain: half as many)")
    p.add_argument("--out", help="write results.json here (default: a temporary directory)")
    p.add_argument("--compare-to", help="an earlier results.json whose `off` answers this invocation's are checked "
                                        "against, when it runs no `off` itself")
    add_tree_arguments(p)
    args = p.parse_args()
    try:
        speculation_from(args)
    except ValueError as err:
        p.error(str(err))
    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="serve_adapt-"))
    out.mkdir(parents=True, exist_ok=True)
    unknown = [name for name in args.runs.split(",") if name not in RUNS]
    if unknown:
        p.error(f"--runs: unknown run {unknown[0]!r} ({', '.join(RUNS)})")
    if args.gauge_every < 0 or args.gauge_tokens < 1:
        p.error("--gauge-every must be >= 0 and --gauge-tokens >= 1")
    texts = questions(args)
    stream = texts[:args.requests]
    gauge = (texts[args.requests] if len(texts) > args.requests else texts[0], gauge_dir(args, out)) \
        if args.gauge_every else None
    results, summary = {}, {}
    for name in args.runs.split(","):
        learn = None if name in ("off", "plain") else out / f"learn-{name}"
        if learn is not None and learn.exists():
            raise SystemExit(f"{learn} exists: give a new --out (a learning run starts from nothing)")
        results[name] = run(args, name, stream, learn, args.adapt_after if name == "adapt" else None, gauge)
        print(f"  {name}: done", flush=True)
        # after every run, so that a run killed later still leaves the finished runs' figures
        summary = summarise(args, results)
        write_json_atomic(out / "results.json", {"args": vars(args), "runs": summary,
                                                 "complete": len(results) == len(args.runs.split(","))})

    print_table(args, summary)
    print(f"\nwrote {out / 'results.json'}")
    return 0


def summarise(args, results: dict) -> dict:
    """Each finished run as results.json keeps it: windows, lost / failed / differing requests,
    every request's record, the adaptation and the versions served."""
    off = reference_answers(results, args.compare_to)
    summary = {}
    for name, result in results.items():
        answered = {r["i"] for r in result["rows"]}
        ok = [r for r in result["rows"] if "error" not in r]
        summary[name] = {
            "windows": windows(result, args.window),
            "lost": sum(i not in answered for i in range(args.requests)),
            "failed": len(result["rows"]) - len(ok),
            "differ_from_off": sum(off.get(r["i"]) != digest(r["text"]) for r in result["rows"] if "text" in r)
            if off else None,
            "requests": [request_record(r) for r in result["rows"]],
            "capped": sum(r.get("tokens", 0) >= args.max_tokens for r in result["rows"]),
            "tokens_per_s": rate(ok),
            "gauge_head_tokens_per_s": rate([g for g in result.get("gauges", []) if g.get("variant") == "head"
                                             and "error" not in g]),
            "adapt": result["adapt"], "versions": result["versions"], "gauges": result.get("gauges", [])}
    return summary


def print_table(args, summary: dict) -> None:
    """The windows of every run side by side, and the goals' ratios where their runs are there."""
    print(f"\nstream: {args.requests} requests ({args.questions or args.task}), head {args.head}, variant "
          f"merge-budget:{args.head},lookup, max_tokens {args.max_tokens}\n")
    first = next(iter(summary.values()))["windows"]
    print("| run | " + " | ".join(w["requests"] for w in first) + " | lost | failed | differ from off |")
    print("| --- |" + " ---: |" * (len(first) + 3))
    for name, figures in summary.items():
        cells = " | ".join(f"{w['acceptance']:.2f} / {w['tokens_per_s']:.0f}" for w in figures["windows"])
        print(f"| {name} (acceptance / tok/s) | {cells} | {figures['lost']} | {figures['failed']} | "
              f"{figures['differ_from_off']} |")
        if any(w["gauge_head_tokens_per_s"] for w in figures["windows"]):
            gauged = " | ".join(f"{w['gauge_plain_tokens_per_s']:.0f} / {w['gauge_head_tokens_per_s']:.0f}"
                                for w in figures["windows"])
            print(f"| {name} gauge (plain / head tok/s) | {gauged} | | | |")
        if all("tree_tokens" in w for w in figures["windows"]):
            split = " | ".join(f"{w['step_draft_ms']:.1f} / {w['step_target_ms']:.1f} / {w['step_other_ms']:.1f} / "
                               f"{w['tree_tokens']:.1f}" for w in figures["windows"])
            print(f"| {name} per step (draft / target / other ms / tree tokens) | {split} | | | |")
        if figures["capped"] > len(figures["requests"]) // 2:
            print(f"  note: {figures['capped']} of {len(figures['requests'])} answers of {name} ran to --max-tokens (often a "
                  "repetition loop, which any lookup drafter copies): the stream measures loops, not the task")
    if "adapt" in summary:
        ws = summary["adapt"]["windows"]
        print(f"\nadapt: last / first window: acceptance {ws[-1]['acceptance'] / ws[0]['acceptance']:.2f}x "
              f"(goal 1.5x), tokens/s {ws[-1]['tokens_per_s'] / max(ws[0]['tokens_per_s'], 1e-9):.2f}x (goal 1.3x)")
        first, last = over_gauge(ws[0]), over_gauge(ws[-1])
        if first and last:
            print(f"adapt: last / first window's tokens/s over its head gauge: {last / first:.2f}x (the machine's "
                  f"speed taken out; head gauge {ws[0]['gauge_head_tokens_per_s']:.1f} -> "
                  f"{ws[-1]['gauge_head_tokens_per_s']:.1f} tok/s, plain {ws[0]['gauge_plain_tokens_per_s']:.1f} -> "
                  f"{ws[-1]['gauge_plain_tokens_per_s']:.1f})")
    if "store" in summary and "off" in summary:
        print(f"store / off tokens/s over the stream: "
              f"{summary['store']['tokens_per_s'] / max(summary['off']['tokens_per_s'], 1e-9):.2f}x (goal 1.15x)")
        store, off = summary["store"], summary["off"]
        if store["gauge_head_tokens_per_s"] and off["gauge_head_tokens_per_s"]:
            print(f"store / off over each run's head gauge: "
                  f"{store['tokens_per_s'] / store['gauge_head_tokens_per_s'] / (off['tokens_per_s'] / off['gauge_head_tokens_per_s']):.2f}x "
                  f"(head gauge {off['gauge_head_tokens_per_s']:.1f} in off, {store['gauge_head_tokens_per_s']:.1f} in store)")


if __name__ == "__main__":
    sys.exit(main())
