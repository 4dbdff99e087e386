"""`taps data regenerate --endpoint` against a live `taps serve`: the same records as the local
path for greedy decoding (one record at a time or several in flight), resumable, and a server that
goes away mid-run stops the run with one error line and keeps what was written; a rerun resumes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from taps.cli.main import main  # noqa: E402
from taps.data.regenerate import RegenerateSettings, regenerate, regenerate_endpoint  # noqa: E402
from taps.data.regenerate_http import Endpoint  # noqa: E402
from taps.serve.app import create_app, serving  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.core.target import Target, TargetRef  # noqa: E402
from test_features import write_records  # noqa: E402
from test_serve import MODEL  # noqa: E402

SETTINGS = RegenerateSettings(max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(target_dir):
    return Engine.load(TargetRef(str(target_dir), "cpu", "float32"), model_id=MODEL)


@pytest.fixture(scope="module")
def local(target_dir, tmp_path_factory):
    """The data (a two-turn record with a system prompt among one-turn ones) and the local path's output."""
    root = tmp_path_factory.mktemp("regen")
    data = write_records(root / "data.jsonl", n=5)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    rows[2]["conversations"] = [{"role": "system", "content": "Be brief."}, *rows[2]["conversations"],
                                {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "old"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "local.jsonl"
    regenerate(Target.load(target_dir, device="cpu", dtype="float32"), data, out, SETTINGS, progress=None)
    return data, lines(out)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_endpoint_gives_the_local_records_and_resumes(engine, local, tmp_path):
    data, expected = local
    assert len(expected[2]["regenerated"]["stop_reasons"]) == 2
    with serving(create_app(engine)) as (_, url):
        out = tmp_path / "remote.jsonl"
        assert regenerate_endpoint(Endpoint(url), data, out, SETTINGS, progress=None) == 5
        assert lines(out) == expected  # same records, same order, same regenerated block
        assert regenerate_endpoint(Endpoint(url + "/v1/"), data, out, SETTINGS, progress=None) == 0
        several = tmp_path / "several.jsonl"
        assert regenerate_endpoint(Endpoint(url, model=MODEL), data, several, SETTINGS, concurrency=3,
                                   progress=None) == 5
        assert sorted(lines(several), key=lambda r: r["id"]) == sorted(expected, key=lambda r: r["id"])


class StopAfter:
    """ASGI middleware: after `n` chat completions the server goes away (it answers 503 while uvicorn
    shuts down, then refuses connections)."""

    def __init__(self, app, n: int):
        self.app, self.n, self.server = app, n, None

    async def __call__(self, scope, receive, send):
        chat = scope["type"] == "http" and scope["path"].endswith("/chat/completions")
        if chat and self.n <= 0:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)
        if chat:
            self.n -= 1
            if self.n == 0:
                self.server.should_exit = True


def test_server_going_away_mid_run_keeps_the_records_and_a_rerun_resumes(engine, local, tmp_path, capsys):
    data, expected = local
    out = tmp_path / "out.jsonl"
    argv = ["data", "regenerate", "--data", str(data), "--out", str(out), "--max-new-tokens", "8", "--retries", "1"]
    app = StopAfter(create_app(engine), n=3)
    with serving(app) as (server, url):
        app.server = server
        code = main([*argv, "--endpoint", url])
        err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and url in errors[0] and "rerun to resume" in errors[0], err
    partial = lines(out)
    assert 1 <= len(partial) < 5 and partial == expected[:len(partial)]
    with serving(create_app(engine)) as (_, url):
        assert main([*argv, "--endpoint", url]) == 0
    assert lines(out) == expected  # no record lost or written twice


@pytest.mark.parametrize("extra,culprit", [
    (["--endpoint", "ftp://host/v1"], "--endpoint"),
    (["--endpoint", "http://127.0.0.1:9/v1", "--batch-size", "4"], "--batch-size"),
    (["--endpoint", "http://127.0.0.1:9/v1", "--drafter", "d"], "--drafter"),
    (["--target", "TARGET", "--concurrency", "2"], "--concurrency"),
    (["--target", "TARGET", "--endpoint", "http://127.0.0.1:9/v1"], "--endpoint"),
    (["--endpoint", "http://127.0.0.1:9/v1", "--retries", "0"], "http://127.0.0.1:9/v1"),
])
def test_endpoint_option_errors_exit_2(local, target_dir, tmp_path, capsys, extra, culprit):
    data, _ = local
    extra = [str(target_dir) if a == "TARGET" else a for a in extra]
    try:
        code = main(["data", "regenerate", "--data", str(data), "--out", str(tmp_path / "o.jsonl"), *extra])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and culprit in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()
