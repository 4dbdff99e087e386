"""Load on `taps serve`: N requests from K concurrent clients per variant, on the real target.

Not a test. Starts a server in this process (or uses --url), then for each variant sends the same
N chat requests (greedy, mixed GSM8K and MT-Bench first turns, in turn), K at a time, through the
`openai` client, and prints requests/s, p50 / p95 latency, mean acceptance length and tokens/s
side by side: plain decoding, every single head named (the best one marked), and the
compositions named with --variant (default: the confidence router and the bandit router, which
learns across the run's requests).

Checks, printed and counted (exit code 1 if any fails):
  - no errors, and every request answered exactly once (no lost or duplicated output): the client
    keeps one answer per request index, and the server's /metrics counts N per variant;
  - losslessness: each prompt's greedy answer is the same under every variant (in bf16 a tree
    forward and a one-token forward round differently, so a near-tie can flip: the count of
    differing answers is printed; with --dtype float32 it must be 0);
  - the queue limit as documented: with the server's queue cut to --burst-queue, a burst of
    2K + 2 simultaneous requests gets 429 with Retry-After for the excess and 200 for the rest
    (skipped with --url: that server's limit is its own).

    python bench/serve_load.py [--target smollm2-135m-instruct
        --drafters models/smollm2-135m-instruct/drafters --heads eagle2-math,eagle2-chat
        --variant route-bandit-turn:eagle2-math,eagle2-chat --requests 200 --clients 8 --max-tokens 128
        --data-dir ../shared/data --dtype auto --threads 1 [--tree auto] [--total-tokens N --depth D --top-k K]]

The tree options are `taps serve`'s own, with its defaults (fixed: 60/5/10; --tree auto: the caps
96/8/8). The README's run with --tree auto predates that and capped its trees at 60/5/10: add
--total-tokens 60 --depth 5 --top-k 10 to repeat it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from taps.cli.args import add_tree_arguments, speculation_from, target_ref
from taps.eval.benchmarks import load_benchmark


def prompts(data_dir: str | None, n: int) -> list[str]:
    """n first turns, GSM8K and MT-Bench alternating (cycled if there are fewer)."""
    math = [q.turns[0] for q in load_benchmark("gsm8k", data_dir, limit=n)]
    chat = [q.turns[0] for q in load_benchmark("mt_bench", data_dir, limit=n)]
    mixed = [q for pair in zip(math, chat) for q in pair]
    return [mixed[i % len(mixed)] for i in range(n)]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def run_variant(client, model: str, variant: str, questions: list[str], clients: int, max_tokens: int) -> dict:
    answers: dict[int, list] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        start = time.perf_counter()
        try:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": questions[i]}], max_tokens=max_tokens,
                temperature=0, extra_body={"taps": {"variant": variant}})
            result = (time.perf_counter() - start, reply.choices[0].message.content, reply.usage, None)
        except Exception as err:  # counted, not raised: the run goes on
            result = (time.perf_counter() - start, None, None, f"{type(err).__name__}: {err}")
        with lock:
            answers.setdefault(i, []).append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, range(len(questions))))
    wall = time.perf_counter() - start
    ok = {i: a[0] for i, a in answers.items() if len(a) == 1 and a[0][3] is None}
    errors = [a[3] for results in answers.values() for a in results if a[3] is not None]
    usages = [a[2] for a in ok.values()]
    tokens = sum(u.completion_tokens for u in usages)
    return {"variant": variant, "wall": wall, "latencies": [a[0] for a in ok.values()], "errors": errors,
            "lost": [i for i in range(len(questions)) if i not in answers],
            "duplicated": [i for i, a in answers.items() if len(a) > 1],
            "texts": {i: a[1] for i, a in ok.items()}, "tokens": tokens,
            "acceptance": tokens / max(1, sum(u.verifier_calls for u in usages)),
            "decode_tps": statistics.mean(u.model_extra["tokens_per_second"] for u in usages) if usages else 0.0}


def burst(url: str, model: str, n: int) -> tuple[int, int, int, list[str]]:
    """n simultaneous requests: (200s, 429s with Retry-After, other answers, the other statuses)."""
    import http.client
    import json

    host, port = url.removeprefix("http://").split(":")
    barrier = threading.Barrier(n)
    statuses: list[tuple[int, str | None]] = []

    def one(_: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                           "temperature": 0})
        barrier.wait()
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        statuses.append((reply.status, reply.getheader("Retry-After")))
        conn.close()

    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(one, range(n)))
    ok = sum(s == 200 for s, _ in statuses)
    limited = sum(s == 429 and r is not None and int(r) >= 1 for s, r in statuses)
    return ok, limited, len(statuses) - ok - limited, [str(s) for s, _ in statuses if s not in (200, 429)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafters", default="models/smollm2-135m-instruct/drafters", help="directory of heads")
    p.add_argument("--heads", default="eagle2-math,eagle2-chat", help="comma-separated heads of --drafters, each "
                                                                      "run alone (the best is marked)")
    p.add_argument("--variant", action="append", default=None,
                   help="a composition to run too (repeat), in the serve grammar over the head names "
                        "(default: confidence routing and the learned bandit router over --heads)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--burst-queue", type=int, default=2, help="the queue limit of the burst check")
    p.add_argument("--data-dir", default=os.environ.get("TAPS_DATA_DIR") or "../shared/data")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1)
    add_tree_arguments(p)  # as taps serve takes them (a CPU verifies 16/5/4 faster than the default 60/5/10)
    p.add_argument("--url", help="an already running taps serve (its base URL, without /v1) instead of one here")
    args = p.parse_args()
    try:
        speculation = speculation_from(args)  # checked before anything loads
    except ValueError as err:
        p.error(str(err))

    import openai

    heads = [h for h in args.heads.split(",") if h]
    members = ",".join(heads)
    variants = ["baseline", *heads, *(args.variant if args.variant is not None else
                                      ([f"route:{members}", f"route-bandit-turn:{members}"] if len(heads) > 1 else []))]
    questions = prompts(args.data_dir, args.requests)
    server = stop = None
    if args.url is None:
        import torch

        from taps.serve.app import Limits, create_app, serving
        from taps.serve.engine import Engine

        torch.set_num_threads(args.threads)
        engine = Engine.load(target_ref(args), [(h, str(Path(args.drafters) / h)) for h in heads], speculation,
                             model_id="target")
        app = create_app(engine, Limits(max_queue=max(args.clients, args.burst_queue), max_tokens=args.max_tokens))
        stop = serving(app)
        _, url = stop.__enter__()
        server, model = app.state.taps, "target"
        print(f"taps serve on {url}: {engine.model_id} ({engine.target.dtype}, {args.threads} thread(s)), heads "
              f"{', '.join(heads)}", flush=True)
    else:
        url = args.url.rstrip("/").removesuffix("/v1")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)  # warm-up
    print(f"{args.requests} requests from {args.clients} clients, max_tokens {args.max_tokens}, greedy; "
          f"{sum(1 for i in range(len(questions)) if i % 2 == 0)} GSM8K + {len(questions) // 2} MT-Bench first turns",
          flush=True)
    runs = []
    for variant in variants:
        runs.append(run_variant(client, model, variant, questions, args.clients, args.max_tokens))
        r = runs[-1]
        print(f"  {variant}: {len(r['latencies'])} answers in {r['wall']:.1f} s", flush=True)
    single = [r for r in runs if r["variant"] in heads]
    best = max(single, key=lambda r: len(r["latencies"]) / r["wall"])["variant"] if single else None

    print("\n| variant | requests/s | p50 latency s | p95 latency s | acceptance length | decode tokens/s | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        name = r["variant"] + (" (best single head)" if r["variant"] == best else "")
        lat = r["latencies"] or [float("nan")]
        print(f"| {name} | {len(r['latencies']) / r['wall']:.3f} | {percentile(lat, 50):.2f} | {percentile(lat, 95):.2f} "
              f"| {r['acceptance']:.2f} | {r['decode_tps']:.1f} | {len(r['errors'])} |")

    failures = []
    for r in runs:
        if r["errors"] or r["lost"] or r["duplicated"]:
            failures.append(f"{r['variant']}: {len(r['errors'])} errors, lost {r['lost']}, duplicated "
                            f"{r['duplicated']}" + (f"; first error: {r['errors'][0]}" if r["errors"] else ""))
    plain = runs[0]["texts"]
    differ = {r["variant"]: sum(r["texts"].get(i) != t for i, t in plain.items()) for r in runs[1:]}
    print(f"\nanswers differing from plain decoding (lossless: 0 in float32): {differ}")
    from taps.serve.metrics import parse

    import urllib.request

    counted = parse(urllib.request.urlopen(url + "/metrics").read().decode()).get("taps_requests_total", {})
    for r in runs:
        n = sum(v for k, v in counted.items() if dict(k).get("variant") == r["variant"] and dict(k)["finish"] != "error")
        if args.url is None and n != args.requests:
            failures.append(f"{r['variant']}: the server counted {n:g} finished requests, expected {args.requests}")
    if server is not None:
        server.scheduler.max_queue = args.burst_queue
        n = 2 * args.clients + 2
        ok, limited, other, statuses = burst(url, model, n)
        print(f"burst of {n} simultaneous requests, queue limit {args.burst_queue}: {ok} answered, {limited} got 429 "
              f"with Retry-After, {other} other {statuses}")
        if other or ok < 1 + args.burst_queue or ok + limited != n:
            failures.append(f"burst: {ok} answered, {limited} limited, {other} other")
    if stop is not None:
        stop.__exit__(None, None, None)
    print("\n" + ("all checks passed" if not failures else "FAILED:\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
