"""`taps serve` under hostile requests (issue 32, finding 4): bodies refused while they stream in,
prompts refused before they are tokenised, tokenisation off the event loop, bounded /metrics,
out-of-range seeds and lone surrogates answered 400 on a connection that stays open (and a 500
that keeps it open too), fair admission for a client that honours Retry-After; then all of it at
once against one server, which stays up, bounded in memory, and fair."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from taps.drafter.checkpoint import write_untrained  # noqa: E402
from taps.serve.admission import Scheduler  # noqa: E402
from taps.serve.app import Limits, create_app, serving  # noqa: E402
from taps.core.target import TargetRef  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.serve.metrics import Metrics, parse  # noqa: E402
from taps.serve.protocol import RequestError  # noqa: E402
from test_serve import MODEL, metrics, raw  # noqa: E402

HUGE = 200 << 20  # bytes a hostile client claims to send


@pytest.fixture(scope="module")
def engine(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    heads = [(name, str(write_untrained(target_dir, root / name, seed=seed))) for name, seed in (("a", 0), ("b", 1))]
    return Engine.load(TargetRef(str(target_dir), "cpu", "float32"), heads, model_id=MODEL)


@pytest.fixture(scope="module")
def served(engine):
    app = create_app(engine, Limits(max_queue=2, max_tokens=64))
    with serving(app) as (_, url):
        yield {"url": url, "server": app.state.taps, "engine": engine}


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "The quick", "max_tokens": 4, "temperature": 0, **fields}).encode()


def connect(url: str, source: str | None = None) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0) if source else None)


def post(conn: http.client.HTTPConnection, data: bytes, path: str = "/v1/completions"):
    """(status, headers, JSON) of one request on a kept-alive connection."""
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, json.loads(reply.read())


def send_head_and_part(url: str, head: bytes, part: bytes, chunks: int) -> tuple[int, bytes]:
    """Send `head`, then `part` `chunks` times from a thread that never finishes the body; the
    status line the server answers with while the body is still incomplete."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)

    def feed():
        try:
            sock.sendall(head)
            for _ in range(chunks):
                sock.sendall(part)
        except OSError:  # the server answered and closed: the rest is not wanted
            pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    try:
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            assert data, "the server closed the connection without an answer"
            answer += data
        while b"}}" not in answer:  # the JSON error body
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    return int(answer.split()[1]), answer


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_body_is_refused_while_it_streams_in(served, framing):
    """413 after the limit's worth of bytes, before the (never finished) body ends."""
    mb = b"x" * (1 << 20)
    if framing == "content-length":
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {HUGE}\r\n\r\n"
        part = mb
    else:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        part = f"{len(mb):x}\r\n".encode() + mb + b"\r\n"
    status, answer = send_head_and_part(served["url"], head.encode(), part, chunks=6)
    assert status == 413 and b'"param":"body"' in answer.replace(b" ", b""), answer[:300]
    assert raw(served["url"], "GET", "/health")[0] == 200


def spy(monkeypatch, engine, method: str, before=None, sizes: list | None = None) -> list[int]:
    """Record (into `sizes`) the length of every text `engine.method` is asked to tokenise
    (`before` runs first)."""
    sizes, original = [] if sizes is None else sizes, getattr(engine, method)

    def recorded(text):
        sizes.append(len(json.dumps(text)))
        if before is not None:
            before()
        return original(text)

    monkeypatch.setattr(engine, method, recorded)
    return sizes


@pytest.mark.parametrize("path,field,param", [
    ("/v1/completions", {"prompt": "apples " * 500_000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "pears " * 300_000},
                                           {"role": "user", "content": "plums " * 300_000}]}, "messages"),
])
def test_a_prompt_beyond_the_token_limit_is_refused_before_it_is_tokenised(served, monkeypatch, path, field, param):
    sizes = spy(monkeypatch, served["engine"], "text_prompt")
    spy(monkeypatch, served["engine"], "chat_prompt", sizes=sizes)
    data = body(**field)
    assert 3_000_000 < len(data) < 4 << 20  # within the body limit
    status, _, reply = raw(served["url"], "POST", path, data)
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert reply["error"]["param"] == param and "tokens" in reply["error"]["message"]
    assert all(n < 1_000_000 for n in sizes), sizes  # the megabytes were never handed to the tokenizer
    assert raw(served["url"], "POST", path, body(**({"prompt": "a b c"} if param == "prompt" else
                                                     {"messages": [{"role": "user", "content": "a b c"}]})))[0] == 200


def test_tokenising_a_prompt_does_not_block_the_event_loop(served, monkeypatch):
    """While one request's prompt is being tokenised (held here), /health still answers."""
    entered, release = threading.Event(), threading.Event()
    spy(monkeypatch, served["engine"], "text_prompt", before=lambda: (entered.set(), release.wait(60)))
    results = []
    worker = threading.Thread(target=lambda: results.append(raw(served["url"], "POST", "/v1/completions", body())))
    worker.start()
    try:
        assert entered.wait(30)
        assert raw(served["url"], "GET", "/health")[0] == 200  # hangs (then fails) if the loop is blocked
    finally:
        release.set()
        worker.join(60)
    assert results and results[0][0] == 200


BAD_FIELDS = [  # (the field, what the error names)
    ({"seed": 2 ** 63}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"stop": ["\udfff"]}, "stop[0]"),
    ({"model": "tiny\ud800"}, "model"),
    ({"taps": {"variant": "a\ud800"}}, "taps.variant"),
]


def test_bad_seeds_and_lone_surrogates_are_400_on_a_connection_that_stays_open(served):
    conn = connect(served["url"])
    try:
        for field, param in BAD_FIELDS:
            status, _, reply = post(conn, body(**field))
            assert status == 400 and reply["error"]["param"] == param, (field, reply)
        chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "\ud800"}]}
        status, _, reply = post(conn, json.dumps(chat).encode(), "/v1/chat/completions")
        assert status == 400 and reply["error"]["param"] == "messages[0].content", reply
        status, _, reply = post(conn, body(seed=2 ** 63 - 1, temperature=1.0))  # the largest seed is fine
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
    finally:
        conn.close()


def test_a_huge_integer_or_deep_nesting_is_a_400_not_a_500(served):
    """Python's JSON reader refuses integers of over 4300 digits and nesting beyond its recursion
    limit with other errors than JSONDecodeError: still a malformed body, still a 400."""
    conn = connect(served["url"])
    try:
        for data in [body()[:-1] + b', "seed": ' + b"9" * 5000 + b"}",
                     body()[:-1] + b', "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                     body()[:-1] + b', "user": ' + b"[" * 900 + b'"\\ud800"' + b"]" * 900 + b"}"]:
            status, _, reply = post(conn, data)
            assert status == 400 and reply["error"]["param"].startswith(("body", "user[0][0][0]")), reply
        assert post(conn, body())[0] == 200
    finally:
        conn.close()


def test_an_internal_error_is_a_500_on_a_connection_that_stays_open(served, monkeypatch):
    engine = served["engine"]
    original = engine.text_prompt

    def broken_once(text):
        monkeypatch.setattr(engine, "text_prompt", original)
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "text_prompt", broken_once)
    conn = connect(served["url"])
    try:
        status, _, reply = post(conn, body())
        assert status == 500 and reply["error"]["type"] == "server_error" and "a bug" in reply["error"]["message"]
        status, _, reply = post(conn, body())  # the same connection
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
    finally:
        conn.close()


def test_metrics_keep_a_bounded_number_of_variant_series():
    """Ad-hoc variants beyond the first few share one series, `other`; the server's own keep theirs."""
    from types import SimpleNamespace

    m = Metrics(keep=("baseline", "a"))
    outcome = SimpleNamespace(tokens=[1, 2], prompt_tokens=3, accepted_tokens=1, verifier_calls=1, decode_s=0.1,
                              acceptance_length=2.0, accepted=[1], heads=["x"], decisions=[{"head": "x"}],
                              seconds={"draft": 0.01, "target": 0.08}, tree_tokens=[3])

    def finish(label):
        m.finished("chat", SimpleNamespace(label=label, composition=True), outcome, "stop", 0.1)

    finish("a")
    for i in range(400):
        finish(f"merge-trie:h{i}=a,b")
    finish("baseline")
    page = parse(m.render(0, 0, 2))
    variants = {dict(k)["variant"] for k in page["taps_requests_total"]}
    assert {"a", "baseline", "other"} <= variants and len(variants) <= 3 + Metrics.MAX_VARIANTS
    assert sum(page["taps_requests_total"].values()) == 402  # every request still counted
    heads = {dict(k)["head"] for k in page["taps_head_steps_total"]}
    assert len(heads) <= 2  # a head name of a variant counted as `other` is `other` too
    lines = m.render(0, 0, 2).count("\n")
    for i in range(400, 800):
        finish(f"merge-trie:h{i}=a,b")
    assert m.render(0, 0, 2).count("\n") == lines


def test_admission_lets_a_client_with_nothing_queued_in_ahead_of_one_that_fills_the_queue():
    """The scheduler alone: client A fills the queue; B's request is admitted (A's newest waiting one
    is refused with 429 and Retry-After) and runs next."""

    async def scenario():
        s = Scheduler(max_queue=2)
        await s.acquire("A")  # running
        a1, a2 = asyncio.ensure_future(s.acquire("A")), asyncio.ensure_future(s.acquire("A"))
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as full:
            await s.acquire("A")
        assert full.value.status == 429 and int(full.value.headers["Retry-After"]) >= 1
        b = asyncio.ensure_future(s.acquire("B"))
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as evicted:
            await a2
        assert evicted.value.status == 429 and "Retry-After" in evicted.value.headers
        s.release(0.5)
        await asyncio.sleep(0)
        assert b.done() and not a1.done()  # B has not run lately: it goes first
        s.release(0.5)
        await asyncio.sleep(0)
        assert a1.done()
        s.release(0.5)
        assert s.running == 0 and s.waiting == 0

    asyncio.run(scenario())


def greedy_client(url: str, stop: threading.Event, counts: dict, source: str) -> None:
    """Sends request after request; on 429 retries at once."""
    conn = connect(url, source)
    while not stop.is_set():
        try:
            status, _, _ = post(conn, body(max_tokens=16))
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = connect(url, source)
            continue
        counts[status] = counts.get(status, 0) + 1
    conn.close()


def polite_client(url: str, requests: int, source: str, give_up: int = 6) -> dict:
    """`requests` requests one after the other; on 429 waits Retry-After seconds; gives up after
    `give_up` refusals in a row."""
    conn, done, refused, streak = connect(url, source), 0, 0, 0
    while done < requests and streak < give_up:
        status, headers, _ = post(conn, body(max_tokens=16))
        if status == 429:
            refused, streak = refused + 1, streak + 1
            time.sleep(float(headers["retry-after"]))
            continue
        assert status == 200
        done, streak = done + 1, 0
    conn.close()
    return {"done": done, "refused": refused}


def fairness(url: str, requests: int = 4) -> tuple[dict, dict]:
    """Three greedy clients on 127.0.0.2 beside a polite one on 127.0.0.3."""
    stop, counts = threading.Event(), {}
    greedy = [threading.Thread(target=greedy_client, args=(url, stop, counts, "127.0.0.2")) for _ in range(3)]
    for thread in greedy:
        thread.start()
    try:
        while sum(counts.values()) < 5:  # the greedy ones keep the queue full
            time.sleep(0.05)
        polite = polite_client(url, requests, "127.0.0.3")
    finally:
        stop.set()
        for thread in greedy:
            thread.join(60)
    return polite, counts


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_hostile_clients_together_leave_the_server_up_bounded_and_fair(served):
    """Oversized bodies and prompts, bad seeds, bad unicode and 400 ad-hoc variants beside greedy
    clients and one that honours Retry-After: every hostile request gets its 4xx, the server stays up,
    its memory and /metrics stay bounded, and the polite client is never refused."""
    url = served["url"]
    peak = peak_rss_mb()
    errors = []

    def hostile():
        try:
            conn = connect(url)
            for _ in range(3):  # 200 MB, streamed in chunks (the client holds 1 MB at a time)
                try:
                    conn.request("POST", "/v1/completions", body=(b"x" * (1 << 20) for _ in range(HUGE >> 20)),
                                 headers={"Content-Type": "application/json"}, encode_chunked=True)
                except OSError:
                    pass
                assert conn.getresponse().status == 413
                conn.close()
            for field, _ in BAD_FIELDS:
                assert raw(url, "POST", "/v1/completions", body(**field))[0] == 400
            assert raw(url, "POST", "/v1/completions", body(prompt="apples " * 500_000))[0] == 400
            for i in range(400):
                status, _, reply = raw(url, "POST", "/v1/completions",
                                       body(max_tokens=1, taps={"variant": f"merge-trie:h{i}=a,b"}))
                assert status in (200, 429), reply
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    attacker = threading.Thread(target=hostile)
    attacker.start()
    polite, greedy = fairness(url)
    attacker.join(600)
    assert not errors, errors
    assert polite == {"done": 4, "refused": 0}, (polite, greedy)
    assert greedy.get(200, 0) > 0  # the greedy ones were served too
    assert raw(url, "GET", "/health")[0] == 200
    page = metrics(url)
    variants = {dict(k)["variant"] for k in page["taps_requests_total"]}
    assert "other" in variants and len(variants) <= Metrics.MAX_VARIANTS + 6
    assert sum(len(v) for v in page.values()) < 3000
    assert peak_rss_mb() - peak < 150  # 600 MB of bodies came in; none was held whole
