"""`taps serve --learn DIR`: the answer log (regenerate's record shape, opt-out, rotation, torn
tails), the online datastore the lookup member drafts from (it grows, it is persisted and
reloaded, a running request keeps its snapshot) and greedy output identical to plain decoding
while it learns."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from taps.core.config import SpeculationConfig, TreeConfig  # noqa: E402
from taps.data.datastore import build_datastore  # noqa: E402
from taps.data.features import read_conversations  # noqa: E402
from taps.propose.rest import SEP, Datastore  # noqa: E402
from taps.propose.lookup import LookupSpec  # noqa: E402
from taps.propose.spec import LOOKUP  # noqa: E402
from taps.serve.answer_log import AnswerLog, log_files, read_log  # noqa: E402
from taps.serve.app import Limits, create_app, serving  # noqa: E402
from taps.core.target import TargetRef  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.serve.learn import Learner  # noqa: E402
from taps.serve.online_store import STORE_DIR  # noqa: E402

MODEL = "tiny"
QUESTIONS = ["Write a short poem about the sea.", "List three colours.", "What is two plus two?"]


def engine_of(target_dir) -> Engine:
    return Engine.load(TargetRef(str(target_dir), "cpu", "float32"), (), ["lookup"],
                       SpeculationConfig(TreeConfig(16, 4, 4)), model_id=MODEL)


def ask(client, question: str, variant: str = "lookup", learn: bool | None = None, max_tokens: int = 40):
    taps = {"variant": variant} if learn is None else {"variant": variant, "learn": learn}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          max_tokens=max_tokens, temperature=0, extra_body={"taps": taps})


@pytest.fixture(scope="module")
def learned(target_dir, tmp_path_factory):
    """A --learn server after each question twice (the second time with the first answer stored),
    one opted-out request and one completion; what the plain decoder answers, for comparison."""
    root = tmp_path_factory.mktemp("learn")
    engine = engine_of(target_dir)
    learner = Learner(root, engine, persist_every_s=0.0)
    replies = {}
    with serving(create_app(engine, Limits(max_tokens=64), learner=learner)) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for q in QUESTIONS:
            replies[q] = {"plain": ask(client, q, "baseline", learn=False), "first": ask(client, q)}
            learner.flush()
            replies[q]["second"] = ask(client, q)
            learner.flush()
        ask(client, "Say nothing you would not want kept.", learn=False)
        client.completions.create(model=MODEL, prompt="a completion", max_tokens=8, temperature=0)
        learner.flush()
    return {"root": root, "replies": replies, "engine": engine, "learner": learner}


def test_greedy_answers_stay_those_of_plain_decoding_while_the_store_grows(learned):
    for q, r in learned["replies"].items():
        plain = r["plain"].choices[0].message.content
        assert r["first"].choices[0].message.content == plain, q
        assert r["second"].choices[0].message.content == plain, q
        assert r["second"].usage.completion_tokens == r["plain"].usage.completion_tokens


def test_the_lookup_member_drafts_from_earlier_answers(learned):
    gains = [(r["first"].usage.acceptance_length, r["second"].usage.acceptance_length)
             for r in learned["replies"].values()]
    assert all(second >= first for first, second in gains), gains
    assert any(second > first + 0.5 for first, second in gains), gains  # the stored answer is drafted whole


def test_the_log_holds_regenerate_records_of_kept_requests_only(learned, target_dir, tmp_path):
    records = read_log(learned["root"])
    assert len(records) == 2 * len(QUESTIONS)  # the plain ones and one more opted out; a completion is no chat
    contents = [r["conversations"][0]["content"] for r in records]
    assert "Say nothing you would not want kept." not in contents
    for record in records:
        assert record["source"] == "taps-serve" and record["id"].startswith("chatcmpl-")
        assert [t["role"] for t in record["conversations"]] == ["user", "assistant"]
        assert record["regenerated"]["new_tokens"] == len(record["served"]["answer_tokens"])
        assert record["served"]["variant"] == "lookup" and record["served"]["temperature"] == 0
    by_question = {r["conversations"][0]["content"]: r for r in records}
    for q, r in learned["replies"].items():
        assert by_question[q]["conversations"][1]["content"] == r["plain"].choices[0].message.content
    # every existing tool reads it: the features reader and `taps lookup build`
    files = log_files(learned["root"])
    assert sum(len(read_conversations(f)) for f in files) == len(records)
    build_datastore(files, str(target_dir), tmp_path / "ds")
    assert Datastore.load(tmp_path / "ds").manifest["segments"] == len(records)


def test_the_store_is_persisted_and_reloaded_or_rebuilt_from_the_log(learned):
    learned["learner"].close()  # the server's shutdown closed it already: nothing left to wait for
    assert not learned["learner"].thread.is_alive() and learned["learner"].queue.empty()
    root, engine = learned["root"], learned["engine"]
    kept = learned["learner"].store.snapshot
    again = Learner(root, engine)
    assert np.array_equal(np.asarray(again.store.snapshot.tokens), np.asarray(kept.tokens))
    assert engine.pool.head(LOOKUP).datastore is again.store.snapshot
    again.close()
    (root / STORE_DIR / "tokens.npy").write_bytes(b"torn")  # a crash between the store's two files
    rebuilt = Learner(root, engine)
    assert np.array_equal(np.asarray(rebuilt.store.snapshot.tokens), np.asarray(kept.tokens))
    rebuilt.close()


def test_a_running_request_keeps_its_snapshot(learned):
    """What proposers were built from is never changed under them: publishing replaces the member."""
    engine = learned["engine"]
    before = engine.pool.head(LOOKUP)
    proposer = engine.pool.proposer(engine.named["lookup"].spec, engine.tree)
    engine.pool.replace(LOOKUP, LookupSpec(datastore=Datastore.of_segments([[1, 2, 3]])))
    assert proposer.datastore is before.datastore
    assert engine.pool.head(LOOKUP).datastore is not before.datastore
    engine.pool.replace(LOOKUP, before)


def test_the_store_is_bounded_oldest_answers_first(target_dir, tmp_path):
    from taps.serve.online_store import OnlineStore

    store = OnlineStore(tmp_path, None, max_tokens=10)
    store.add([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]])
    assert list(store.segments) == [[5, 6, 7, 8], [9, 10, 11]] and store.tokens == 7
    store.add([list(range(20, 40))])  # longer than the bound alone: its end is kept
    assert list(store.segments) == [list(range(30, 40))]
    tokens = np.asarray(store.publish().tokens)
    assert tokens[0] == SEP and tokens[-1] == SEP and len(tokens) == 12


def test_the_log_rotates_is_bounded_and_repairs_a_torn_tail(tmp_path):
    record = {"id": "x", "conversations": [{"role": "user", "content": "q" * 50}]}
    size = len(json.dumps(record)) + 1
    log = AnswerLog(tmp_path, max_file_bytes=3 * size, max_bytes=7 * size)
    for i in range(20):
        log.append({**record, "id": str(i)})
    files = log_files(tmp_path)
    assert all(f.stat().st_size <= 3 * size for f in files)
    assert sum(f.stat().st_size for f in files) <= 7 * size
    assert [r["id"] for r in read_log(tmp_path)][-1] == "19"
    with files[-1].open("ab") as f:
        f.write(b'{"id": "torn", "conv')  # a crash mid-write
    AnswerLog(tmp_path, max_file_bytes=3 * size, max_bytes=7 * size).append({**record, "id": "20"})
    assert [r["id"] for r in read_log(tmp_path)][-2:] == ["19", "20"]


def test_opt_out_must_be_a_boolean(learned, target_dir):
    from taps.serve.protocol import RequestError, parse_chat

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body).learn is True
    assert parse_chat({**body, "taps": {"learn": False}}).learn is False
    with pytest.raises(RequestError) as err:
        parse_chat({**body, "taps": {"learn": "no"}})
    assert err.value.param == "taps.learn"


def test_nothing_is_kept_without_learn(target_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = engine_of(target_dir)
    with serving(create_app(engine, Limits(max_tokens=16))) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        ask(client, QUESTIONS[0], max_tokens=8)
    assert list(tmp_path.iterdir()) == []
    assert isinstance(engine.pool.head(LOOKUP), LookupSpec) and engine.pool.head(LOOKUP).datastore is None


def test_learn_must_name_a_directory(tmp_path):
    from taps.serve.launch import ServeSettings

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--learn .*not a directory"):
        ServeSettings(learn=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="--learn-store-tokens"):
        ServeSettings(learn=str(tmp_path), learn_store_tokens=0)


def test_taps_serve_learn_keeps_answers_and_persists_the_store_at_shutdown(target_dir, tmp_path):
    """The command end to end: --learn wired in, the store written when SIGTERM stops the server."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from test_serve import free_port, raw

    port, root = free_port(), tmp_path / "learn"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "taps", "serve", "--target", str(target_dir), "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL, "--variant",
                             "lookup", "--learn", str(root), "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if raw(url, "GET", "/health")[0] == 200:
                    break
            except OSError:
                import time

                time.sleep(0.2)
        body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 12,
                "temperature": 0}
        status, _, reply = raw(url, "POST", "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = read_log(root)
    assert [r["conversations"][-1]["content"] for r in records] == [reply["choices"][0]["message"]["content"]]
    store = Datastore.load(root / STORE_DIR)
    assert store.manifest["segments"] == 1 and store.manifest["tokens"] > reply["usage"]["completion_tokens"]
