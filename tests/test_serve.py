"""`taps serve` against a live uvicorn server on 127.0.0.1, through the real `openai` client: chat
and completions, streamed and not, per-request variants, usage figures, /metrics, greedy output
identical to `taps generate`, a bounded queue, a client gone mid-stream, bad requests answered
with a 4xx naming the field (the server answering afterwards), SIGTERM."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from taps.cli.main import main  # noqa: E402
from taps.core.config import SpeculationConfig, TreeConfig  # noqa: E402
from taps.drafter.checkpoint import DrafterInfo, save_head  # noqa: E402
from taps.drafter.fit import fit_linear_head, greedy_sequences  # noqa: E402
from taps.serve.app import Limits, create_app, serving  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.serve.metrics import parse  # noqa: E402
from taps.core.target import Target, TargetRef  # noqa: E402
from taps.core.testing import write_tiny_target  # noqa: E402

MODEL = "tiny"
TREE = ["--total-tokens", "16", "--depth", "4", "--top-k", "4"]
PROMPT = "Write a short poem about the sea."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fitted_heads(target_dir: Path, out: Path) -> list[tuple[str, str]]:
    """Two heads that the tiny target accepts sometimes (closed-form fits on its own greedy text)."""
    target = Target.load(target_dir, device="cpu", dtype="float32")
    heads = []
    for name, seed in (("a", 1), ("b", 2)):
        g = torch.Generator().manual_seed(seed)
        data = greedy_sequences(target, torch.randint(0, target.vocab_size, (12, 6), generator=g).tolist(), 32)
        path = out / name
        save_head(fit_linear_head(target, data, seed=seed + 2), path,
                  DrafterInfo(backbone="eagle2", tokenizer_fingerprint=target.fingerprint()))
        heads.append((name, str(path)))
    return heads


@pytest.fixture(scope="module")
def served(target_dir, tmp_path_factory):
    heads = fitted_heads(target_dir, tmp_path_factory.mktemp("heads"))
    engine = Engine.load(TargetRef(str(target_dir), "cpu", "float32"), heads,
                         ["pair=merge-trie:a,b", "learned=route-bandit-turn:a,b"],
                         SpeculationConfig(TreeConfig(16, 4, 4)), model_id=MODEL)
    with serving(create_app(engine, Limits(max_queue=4, max_tokens=64))) as (_, url):
        yield {"url": url, "target": str(target_dir), "heads": dict(heads),
               "client": openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)}


def chat(served, variant=None, **kwargs):
    options = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0)
    options.update(kwargs)
    if variant is not None:
        options["extra_body"] = {"taps": {"variant": variant}}
    return served["client"].chat.completions.create(**options)


def generate_cli(capsys, served, *extra) -> dict:
    assert main(["generate", "--target", served["target"], "--max-new-tokens", "24", "--device", "cpu",
                 "--dtype", "float32", "--json", *TREE, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    data = reply.read().decode()
    conn.close()
    try:
        return reply.status, dict(reply.getheaders()), json.loads(data)
    except json.JSONDecodeError:
        return reply.status, dict(reply.getheaders()), data


def metrics(url: str) -> dict:
    status, headers, text = raw(url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(text)


def test_models_lists_the_target_heads_and_variants(served):
    (model,) = served["client"].models.list().data
    assert model.id == MODEL and model.owned_by == "taps"
    info = model.model_extra["taps"]
    assert info["drafters"] == ["a", "b"] and info["default_variant"] == "pair"
    assert {"baseline", "a", "b", "pair"} <= set(info["variants"])


@pytest.mark.parametrize("variant,cli", [("baseline", []), ("a", ["--drafter", "a"]),
                                         ("route-entropy-turn:a,b", ["--drafter", "a", "--drafter", "b", "--strategy",
                                                                     "route", "--signal", "entropy",
                                                                     "--granularity", "turn"]),
                                         ("route-bandit-turn:x=a,y=b", ["--drafter", "x=a", "--drafter", "y=b",
                                                                        "--strategy", "route", "--signal", "bandit",
                                                                        "--granularity", "turn"])])
def test_greedy_chat_is_taps_generate(served, capsys, variant, cli):
    """The same text, token count and acceptance figures as `taps generate` with the same heads."""
    cli = [served["heads"][x] if x in served["heads"] else x for x in cli]
    cli = [f"{x[0]}={served['heads'][x[2:]]}" if x[2:] in served["heads"] and x[1] == "=" else x for x in cli]
    expected = generate_cli(capsys, served, "--prompt", PROMPT, *cli)
    reply = chat(served, variant)
    assert reply.choices[0].message.content == expected["text"]
    assert reply.choices[0].finish_reason == ("length" if expected["stop_reason"] == "max_new_tokens" else "stop")
    u = reply.usage
    assert u.completion_tokens == expected["new_tokens"] and u.prompt_tokens == expected["prompt_tokens"]
    assert u.verifier_calls == expected["verifier_calls"]
    assert u.accepted_tokens == sum(expected["accepted_per_step"])
    assert u.acceptance_length == pytest.approx(expected["acceptance_length"], abs=1e-4)
    assert u.model_extra["variant"] == variant


def test_streaming_chat_gives_the_same_text_and_usage(served):
    whole = chat(served, "a")
    stream = chat(served, "a", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.verifier_calls == whole.usage.verifier_calls


def test_every_variant_is_lossless_and_reports_its_acceptance(served):
    plain = chat(served, "baseline")
    assert plain.usage.accepted_tokens == 0 and plain.usage.acceptance_length == 1.0
    assert plain.usage.verifier_calls == plain.usage.completion_tokens
    assert "head_step_shares" not in plain.usage.model_extra
    accepted = 0
    for variant in ["a", "b", "pair", None, "average:a,b", "route:a,b,lookup", "merge-budget:x=a,y=b", "learned",
                    "route-bandit:a,b,lookup"]:
        reply = chat(served, variant)
        u = reply.usage
        assert reply.choices[0].message.content == plain.choices[0].message.content, variant
        assert u.completion_tokens == plain.usage.completion_tokens
        assert u.acceptance_length == pytest.approx(u.completion_tokens / u.verifier_calls, abs=1e-4)
        assert u.accepted_tokens + u.verifier_calls >= u.completion_tokens  # each call: accepted + 1 (cut at the end)
        accepted += u.accepted_tokens
        shares = u.model_extra.get("head_step_shares")
        if variant in ("pair", None, "route:a,b,lookup", "merge-budget:x=a,y=b", "learned", "route-bandit:a,b,lookup"):
            assert shares and sum(shares.values()) == pytest.approx(1.0, abs=1e-3), (variant, shares)
        else:
            assert shares is None
    assert accepted > 0  # the fitted heads do get accepted


def test_completions_text_and_token_ids_match_generate(served, capsys):
    text = "The quick brown fox"
    expected = generate_cli(capsys, served, "--prompt", text, "--raw")
    reply = served["client"].completions.create(model=MODEL, prompt=text, max_tokens=24, temperature=0)
    assert reply.choices[0].text == expected["text"] and reply.usage.completion_tokens == expected["new_tokens"]
    ids = [5, 17, 42, 99, 7]
    expected = generate_cli(capsys, served, "--prompt-ids", ",".join(map(str, ids)), "--drafter", served["heads"]["b"])
    reply = served["client"].completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                                extra_body={"taps": {"variant": "b"}})
    assert reply.choices[0].text == expected["text"] and reply.usage.verifier_calls == expected["verifier_calls"]
    streamed = served["client"].completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected["text"]


def test_sampling_is_seeded_and_stop_strings_cut(served):
    a = chat(served, "a", temperature=1.0, top_p=0.9, seed=7)
    b = chat(served, "baseline", temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].message.content == chat(served, "a", temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
    assert b.usage.completion_tokens > 0
    text = chat(served, "a").choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.find(stop)]
    reply = chat(served, "a", stop=[stop, "never appears"])
    assert reply.choices[0].message.content == cut and reply.choices[0].finish_reason == "stop"
    streamed = chat(served, "a", stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_metrics_count_requests_tokens_and_acceptance(served):
    before = metrics(served["url"])
    replies = [chat(served, "merge-trie:b,a", max_tokens=n) for n in (8, 16)]
    after = metrics(served["url"])
    v = (("variant", "merge-trie:b,a"),)
    assert after["taps_requests_total"][(("endpoint", "chat"), ("finish", "length"), *v)] == 2
    assert after["taps_completion_tokens_total"][v] == sum(r.usage.completion_tokens for r in replies)
    assert after["taps_verifier_calls_total"][v] == sum(r.usage.verifier_calls for r in replies)
    assert after["taps_accepted_tokens_total"][v] == sum(r.usage.accepted_tokens for r in replies)
    assert after["taps_acceptance_length_count"][v] == 2
    buckets = sorted((float(dict(k)["le"]), n) for k, n in after["taps_acceptance_length_bucket"].items()
                     if dict(k)["variant"] == "merge-trie:b,a")
    assert [n for _, n in buckets] == sorted(n for _, n in buckets) and buckets[-1][1] == 2
    steps = after["taps_steps_total"][v]
    assert steps == sum(r.usage.verifier_calls - 1 for r in replies)
    assert after["taps_step_accepted_tokens_count"][v] == steps
    positions = {int(dict(k)["position"]): n for k, n in after.get("taps_draft_position_accepted_total", {}).items()
                 if dict(k)["variant"] == "merge-trie:b,a"}
    assert sum(positions.values()) == after["taps_accepted_tokens_total"][v]  # sum over d of #(accepted >= d)
    assert all(positions[d] <= positions.get(d - 1, steps) for d in positions)
    heads = {dict(k)["head"]: n for k, n in after["taps_head_steps_total"].items() if dict(k)["variant"] == "merge-trie:b,a"}
    assert sum(heads.values()) == steps
    assert after["taps_tokens_per_second"][v] > 0 and after["taps_requests_running"][()] == 0
    assert after["taps_queue_limit"][()] == 4
    # where the decode time went, by phase, as each response's usage says it; the tree sizes per step
    phases = {dict(k)["phase"]: n for k, n in after["taps_decode_phase_seconds_total"].items()
              if dict(k)["variant"] == "merge-trie:b,a"}
    assert set(phases) == {"setup", "prefill", "draft", "target", "other"}
    for phase in phases:
        assert phases[phase] == pytest.approx(sum(r.usage.model_extra["seconds"][phase] for r in replies), abs=1e-3)
    assert phases["target"] > 0 and phases["draft"] > 0
    assert sum(phases.values()) <= after["taps_decode_seconds_total"][v] + 1e-6
    tree_tokens = after["taps_tree_tokens_total"][v]
    assert steps < tree_tokens == pytest.approx(sum(r.usage.model_extra["mean_tree_tokens"] * (r.usage.verifier_calls - 1)
                                                    for r in replies), abs=0.02)
    rejected = before.get("taps_rejected_requests_total", {}).get((("status", "400"),), 0)
    raw(served["url"], "POST", "/v1/chat/completions", b"{")
    assert metrics(served["url"])["taps_rejected_requests_total"][(("status", "400"),)] == rejected + 1


def test_the_bandit_learns_across_requests_per_variant_and_logs_each_decision(served, caplog):
    """route-bandit keeps its state in the server, one per variant: each request's decision
    (one per turn here) is logged as one JSON line and rewards that variant's statistics only."""
    caplog.set_level(logging.INFO, logger="taps.serve.routing")
    plain = chat(served, "baseline").choices[0].message.content

    def learned(variant):
        pulls = metrics(served["url"]).get("taps_bandit_pulls", {})
        return sum(n for k, n in pulls.items() if dict(k)["variant"] == variant)

    before, other = learned("learned"), learned("route-bandit-turn:b,a")
    for prompt in (PROMPT, "Count from one to ten.", "Name three colours."):
        reply = chat(served, "learned", messages=[{"role": "user", "content": prompt}])
        if prompt == PROMPT:
            assert reply.choices[0].message.content == plain  # lossless
        assert sum(reply.usage.model_extra["head_step_shares"].values()) == pytest.approx(1.0, abs=1e-3)
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "taps.serve.routing"]
    mine = [d for d in logged if d["variant"] == "learned"]
    assert len(mine) == 3 and all(d["signal"] == "bandit" and d["step"] == 0 for d in mine)
    assert all(d["head"] in ("a", "b") and d["context"] in ("a", "b") and len(d["prior"]) == len(d["scores"]) == 2
               for d in mine)
    assert learned("learned") == before + 3 and learned("route-bandit-turn:b,a") == other
    page = metrics(served["url"])
    decided = {dict(k)["head"]: n for k, n in page["taps_route_decisions_total"].items()
               if dict(k)["variant"] == "learned"}
    assert sum(decided.values()) >= 3
    means = [n for k, n in page["taps_bandit_tokens_per_call"].items() if dict(k)["variant"] == "learned"]
    assert means and all(1.0 <= n <= 5.0 for n in means)  # tokens per verifier call, tree depth 4


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_REQUESTS = [  # (name, path, body, status, param)
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "body"),
    ("not an object", "/v1/chat/completions", [1, 2], 400, "body"),
    ("messages missing", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("messages not a list", "/v1/chat/completions", {**GOOD, "messages": "Hi"}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", {**GOOD, "messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("content a number", "/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("temperature a string", "/v1/chat/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("temperature negative", "/v1/chat/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("max_tokens zero", "/v1/chat/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a float", "/v1/chat/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens over the limit", "/v1/chat/completions", {**GOOD, "max_tokens": 65}, 400, "max_tokens"),
    ("seed a string", "/v1/chat/completions", {**GOOD, "seed": "7"}, 400, "seed"),
    ("stream not a boolean", "/v1/chat/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("stop not strings", "/v1/chat/completions", {**GOOD, "stop": [1]}, 400, "stop"),
    ("n above one", "/v1/chat/completions", {**GOOD, "n": 2}, 400, "n"),
    ("unknown variant", "/v1/chat/completions", {**GOOD, "taps": {"variant": "nope"}}, 400, "taps.variant"),
    ("variant naming a directory", "/v1/chat/completions", {**GOOD, "taps": {"variant": "route:a,/tmp"}}, 400,
     "taps.variant"),
    ("variant a number", "/v1/chat/completions", {**GOOD, "taps": {"variant": 3}}, 400, "taps.variant"),
    ("unknown taps key", "/v1/chat/completions", {**GOOD, "taps": {"variants": "a"}}, 400, "taps.variants"),
    ("unknown model", "/v1/chat/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("prompt beyond the context window", "/v1/chat/completions",
     {**GOOD, "messages": [{"role": "user", "content": "apples " * 600}]}, 400, "messages"),
    ("prompt plus max_tokens beyond the window", "/v1/completions",
     {"model": MODEL, "prompt": [1] * 500, "max_tokens": 64}, 400, "max_tokens"),
    ("prompt a number", "/v1/completions", {"model": MODEL, "prompt": 12}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt[1]"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("no such endpoint", "/v1/embeddings", GOOD, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_a_clear_4xx_and_the_server_goes_on(served, name, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, headers, reply = raw(served["url"], "POST", path, data)
    assert code == status, reply
    assert headers["content-type"] == "application/json"
    error = reply["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if param:
        assert param.split("[")[0].split(".")[-1] in error["message"] or param == "body", error["message"]
    assert raw(served["url"], "GET", "/v1/models")[0] == 200
    assert chat(served, "baseline", max_tokens=2).usage.completion_tokens == 2


def test_wrong_method_is_405(served):
    code, _, reply = raw(served["url"], "GET", "/v1/chat/completions")
    assert code == 405 and "not allowed" in reply["error"]["message"]


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    """A tiny target with room for long answers (2048 positions) and no chat stop tokens in reach."""
    return write_tiny_target(tmp_path_factory.mktemp("long"), seed=3, max_positions=2048)


def test_full_queue_answers_429_and_a_client_gone_frees_the_decoder(long_target):
    engine = Engine.load(TargetRef(str(long_target), "cpu", "float32"), model_id=MODEL)
    with serving(create_app(engine, Limits(max_queue=0, max_tokens=2000))) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2000, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")  # decoding now
        code, headers, reply = raw(url, "POST", "/v1/completions", json.dumps({**body, "stream": False}).encode())
        assert code == 429 and int(headers["retry-after"]) >= 1 and reply["error"]["code"] == "queue_full"
        conn.close()  # the client goes away mid-stream
        deadline = time.time() + 30
        while time.time() < deadline:
            m = metrics(url)
            if m["taps_requests_running"][()] == 0 and m.get("taps_requests_total"):
                break
            time.sleep(0.1)
        v = (("variant", "baseline"),)
        assert m["taps_requests_total"][(("endpoint", "completions"), ("finish", "cancelled"), *v)] == 1
        assert m["taps_completion_tokens_total"][v] < 2000  # stopped early, not decoded to the end
        code, _, reply = raw(url, "POST", "/v1/completions", json.dumps({**body, "stream": False, "max_tokens": 3}).encode())
        assert code == 200 and reply["usage"]["completion_tokens"] == 3


def test_taps_serve_command_binds_localhost_and_stops_on_sigterm(target_dir, tmp_path):
    from taps.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--target", "x"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.max_queue == 16
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "(default: 127.0.0.1)" in help_text and "(default: None)" not in help_text and "[])" not in help_text
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "taps", "serve", "--target", str(target_dir), "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "taps serve did not start"
            try:
                if raw(url, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        host = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": 200, "temperature": 0, "stream": True}
        host.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        stream = host.getresponse()
        assert stream.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)  # mid-stream: the request finishes, then the server exits
        rest = stream.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv,culprit", [
    (["--variant", "route:a,nope"], "--variant"),
    (["--drafter", "baseline=DIR"], "--drafter"),
    (["--port", "0"], "--port"),
    (["--max-queue", "-1"], "--max-queue"),
])
def test_serve_command_errors_exit_2_naming_the_option(target_dir, tmp_path, capsys, argv, culprit):
    head = str(tmp_path / "a")
    from taps.drafter.checkpoint import write_untrained

    write_untrained(target_dir, head)
    argv = [a.replace("DIR", head) for a in argv]
    try:
        code = main(["serve", "--target", str(target_dir), "--drafter", f"a={head}", "--device", "cpu", *argv])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and culprit in errors[0] and "Traceback" not in err, err
