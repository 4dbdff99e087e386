"""Honest shutdowns (issue 32, finding 1): a server told to stop drains, and an answer it has to cut
is reported as cut (an error event in a stream, a 503 otherwise), never with a normal finish_reason;
a queued stream request gets a 503. `taps data regenerate --endpoint` saves no answer whose finish
it cannot trust and honours a Retry-After given as an HTTP date. The drain test: a server sent
SIGTERM under a regeneration's load, then restarted, loses no record and saves no cut answer."""

from __future__ import annotations

import email.utils
import http.client
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from taps.data import regenerate_http as regen  # noqa: E402
from taps.data.regenerate import RegenerateSettings, regenerate, regenerate_endpoint  # noqa: E402
from taps.data.regenerate_http import Endpoint, EndpointError  # noqa: E402
from taps.serve.app import Limits, create_app, serving  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.core.target import Target, TargetRef  # noqa: E402
from taps.core.testing import write_tiny_target  # noqa: E402
from test_features import write_records  # noqa: E402
from test_serve import MODEL, free_port, metrics, raw  # noqa: E402

LONG = 2000  # tokens: seconds of decoding on the tiny target, so a shutdown lands mid-answer


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    """A tiny target with room for long answers (2048 positions) and no chat stop tokens in reach."""
    return write_tiny_target(tmp_path_factory.mktemp("long"), seed=3, max_positions=2048)


@pytest.fixture(scope="module")
def engine(long_target):
    return Engine.load(TargetRef(str(long_target), "cpu", "float32"), model_id=MODEL)


def request(url: str, stream: bool, max_tokens: int = LONG) -> http.client.HTTPConnection:
    """A completion request sent (its answer not read yet)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def events(reply: http.client.HTTPResponse) -> list:
    """The data of every server-sent event of a stream, parsed ([DONE] as the string)."""
    out = []
    for line in reply.read().decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_running(url: str, n: int = 1) -> None:
    deadline = time.time() + 60
    while metrics(url)["taps_requests_running"][()] < n:
        assert time.time() < deadline, "the request never started decoding"
        time.sleep(0.02)


def test_a_stream_cut_by_shutdown_ends_with_an_error_event_not_a_finish(engine):
    with serving(create_app(engine, Limits(max_tokens=LONG)), shutdown_timeout=0) as (server, url):
        conn = request(url, stream=True)
        reply = conn.getresponse()
        assert reply.status == 200 and reply.readline().startswith(b"data: ")  # decoding now
        server.should_exit = True
        got = events(reply)
    finishes = [e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e.get("choices")]
    errors = [e["error"] for e in got if isinstance(e, dict) and "error" in e]
    assert not any(finishes), finishes  # no "stop", no "length": the answer is not complete
    assert len(errors) == 1 and errors[0]["code"] == "shutting_down" and "cut" in errors[0]["message"], got[-3:]


def test_a_request_cut_by_shutdown_is_a_503_and_a_queued_stream_too(engine):
    with serving(create_app(engine, Limits(max_tokens=LONG, max_queue=2)), shutdown_timeout=0) as (server, url):
        running = request(url, stream=False)
        wait_running(url)
        queued = request(url, stream=True)
        deadline = time.time() + 60
        while metrics(url)["taps_queue_waiting"][()] < 1:
            assert time.time() < deadline
            time.sleep(0.02)
        server.should_exit = True
        cut, waiting = running.getresponse(), queued.getresponse()
        cut_body, waiting_body = json.loads(cut.read()), json.loads(waiting.read())
    assert cut.status == 503 and cut_body["error"]["code"] == "shutting_down", cut_body
    assert cut.getheader("Retry-After")
    assert waiting.status == 503 and waiting_body["error"]["code"] == "shutting_down", waiting_body


def test_a_request_that_finishes_within_the_timeout_is_answered_whole(engine):
    with serving(create_app(engine, Limits(max_tokens=LONG)), shutdown_timeout=60) as (server, url):
        conn = request(url, stream=False, max_tokens=600)
        wait_running(url)
        server.should_exit = True
        reply = conn.getresponse()
        answer = json.loads(reply.read())
    assert reply.status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 600


class Canned(http.server.BaseHTTPRequestHandler):
    """A fake OpenAI server: /v1/models lists `tiny`; chat completions get the next canned answer
    (status, headers, body) of the class's list, the last one repeated."""

    answers: list = []
    seen: list = []

    def log_message(self, *args):
        pass

    def _send(self, status: int, headers: dict, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {}, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        answers = type(self).answers
        type(self).seen.append(1)
        self._send(*(answers.pop(0) if len(answers) > 1 else answers[0]))


def completion(finish, text="an answer", tokens=8) -> tuple[int, dict, dict]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    if finish != "missing":
        choice["finish_reason"] = finish
    return 200, {}, {"choices": [choice], "usage": {"completion_tokens": tokens}}


@pytest.fixture
def canned():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Canned, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("finish", [None, "missing", "cancelled", "content_filter", "abort"])
def test_regenerate_saves_no_answer_whose_finish_it_cannot_trust(canned, tmp_path, monkeypatch, finish):
    handler, url = canned
    handler.answers, handler.seen = [completion(finish)], []
    monkeypatch.setattr(regen.time, "sleep", lambda s: None)
    data, out = write_records(tmp_path / "data.jsonl", n=1), tmp_path / "out.jsonl"
    with pytest.raises(EndpointError, match="finish_reason"):
        regenerate_endpoint(Endpoint(url, retries=2), data, out, RegenerateSettings(max_new_tokens=8), progress=None)
    assert not out.exists() or out.read_text() == ""
    assert len(handler.seen) == 3  # asked again: an untrusted answer is retried like a 503
    handler.answers = [completion(finish), completion("length", tokens=5), completion("length")]
    assert regenerate_endpoint(Endpoint(url, retries=2), data, out, RegenerateSettings(max_new_tokens=8),
                               progress=None) == 1
    (record,) = map(json.loads, out.read_text().splitlines())
    assert record["regenerated"]["stop_reasons"] == ["max_new_tokens"] and len(handler.seen) == 6


def test_regenerate_honours_a_retry_after_given_as_an_http_date(canned, tmp_path, monkeypatch):
    handler, url = canned
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    handler.answers = [(503, {"Retry-After": when}, {"error": {"message": "restarting"}}), completion("stop")]
    waits = []
    monkeypatch.setattr(regen.time, "sleep", waits.append)
    data, out = write_records(tmp_path / "data.jsonl", n=1), tmp_path / "out.jsonl"
    assert regenerate_endpoint(Endpoint(url, retries=2), data, out, RegenerateSettings(max_new_tokens=8),
                               progress=None) == 1
    assert len(waits) == 1 and 20 <= waits[0] <= 31, waits  # the date is 30 s ahead (1 s resolution)


def serve_process(target: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "taps", "serve", "--target", str(target), "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
                             "--max-tokens", str(LONG), "--shutdown-timeout", "1", "--log-level", "warning"],
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, "taps serve did not start"
        try:
            if raw(f"http://127.0.0.1:{port}", "GET", "/health")[0] == 200:
                return proc
        except OSError:
            time.sleep(0.2)


def test_sigterm_under_a_regeneration_loses_no_record_and_saves_no_cut_answer(long_target, tmp_path):
    """The issue's repro: regenerate through a server with three records in flight, SIGTERM the
    server (shutdown timeout 1 s: the running answer, seconds long, is cut), restart it; the run retries, and its
    records are the local path's, every one whole."""
    settings = RegenerateSettings(max_new_tokens=1500)
    data = write_records(tmp_path / "data.jsonl", n=6)
    expected = tmp_path / "local.jsonl"
    regenerate(Target.load(long_target, device="cpu", dtype="float32"), data, expected, settings, progress=None)
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    proc = serve_process(long_target, port, log)
    out, outcome = tmp_path / "remote.jsonl", {}

    def run():
        try:
            outcome["written"] = regenerate_endpoint(Endpoint(url, retries=8, backoff=0.5), data, out, settings,
                                                     concurrency=3, progress=None)
        except BaseException as err:
            outcome["error"] = err

    worker = threading.Thread(target=run)
    worker.start()
    try:
        deadline = time.time() + 120
        while not (out.exists() and out.read_text()) or metrics(url)["taps_requests_running"][()] < 1:
            assert time.time() < deadline and worker.is_alive(), (outcome, log.read_text())
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # mid-answer
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert re.search(r"cut [1-9][0-9]* answer", log.read_text()), log.read_text()  # the cut did happen
        proc = serve_process(long_target, port, log)
        worker.join(300)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert outcome.get("written", 0) >= 1 and "error" not in outcome, outcome
    got = [json.loads(x) for x in out.read_text().splitlines()]
    want = [json.loads(x) for x in expected.read_text().splitlines()]
    assert sorted(got, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])  # all, once, whole
