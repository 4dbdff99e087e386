"""Access to `taps serve` (issue 32, finding 5): an API key (`--api-key` or $TAPS_API_KEY) checked
as an OpenAI-style bearer token, in constant time, on every endpoint but /health; a loud warning
when the server listens beyond the loopback without one; /v1/models names the target by its
short name, not the path it was loaded from."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from taps.cli.main import main  # noqa: E402
from taps.data.regenerate import RegenerateSettings, regenerate_endpoint  # noqa: E402
from taps.data.regenerate_http import Endpoint, EndpointError  # noqa: E402
from taps.serve import app as serve_app  # noqa: E402
from taps.serve import auth  # noqa: E402
from taps.serve.app import create_app, serving  # noqa: E402
from taps.core.target import TargetRef  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.serve.launch import ServeSettings, serve  # noqa: E402
from test_features import write_records  # noqa: E402
from test_serve import MODEL, raw  # noqa: E402

KEY = "sk-test-0123456789"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def engine(target_dir):
    return Engine.load(TargetRef(str(target_dir), "cpu", "float32"), model_id=MODEL)


@pytest.fixture(scope="module")
def keyed(engine):
    with serving(create_app(engine, api_key=KEY)) as (_, url):
        yield url


ENDPOINTS = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("POST", "/v1/chat/completions", CHAT),
             ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2}).encode()),
             ("GET", "/v1/nowhere", None)]


@pytest.mark.parametrize("method,path,data", ENDPOINTS, ids=[e[1] for e in ENDPOINTS])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", "Bearer ", f"Bearer {KEY}x", KEY])
def test_every_endpoint_but_health_needs_the_key(keyed, method, path, data, auth):
    status, headers, reply = raw(keyed, method, path, data, {"Authorization": auth} if auth else {})
    assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
    assert headers.get("www-authenticate") == "Bearer" and KEY not in json.dumps(reply)


@pytest.mark.parametrize("method,path,data", ENDPOINTS[:4], ids=[e[1] for e in ENDPOINTS[:4]])
def test_the_key_opens_every_endpoint(keyed, method, path, data):
    assert raw(keyed, method, path, data, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert raw(keyed, "GET", "/health")[0] == 200  # no key needed: load balancers probe it


def test_the_openai_client_and_regenerate_send_the_key(keyed, tmp_path):
    client = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed + "/v1", api_key="nope", max_retries=0).models.list()
    data = write_records(tmp_path / "data.jsonl", n=1)
    settings = RegenerateSettings(max_new_tokens=2)
    with pytest.raises(EndpointError, match="401"):
        regenerate_endpoint(Endpoint(keyed, api_key="nope"), data, tmp_path / "no.jsonl", settings, progress=None)
    assert regenerate_endpoint(Endpoint(keyed, api_key=KEY), data, tmp_path / "yes.jsonl", settings,
                               progress=None) == 1


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert raw(keyed, "GET", "/v1/models", None, {"Authorization": "Bearer wrong"})[0] == 401
    assert raw(keyed, "GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert len(compared) == 2 and all(len(a) == len(b) for a, b in compared)  # digests: the length leaks nothing


def launched(monkeypatch, target_dir, capsys, **settings) -> tuple[dict, str]:
    """serve() up to the point where it would run: (what run() was given, what it printed on stderr)."""
    given = {}
    monkeypatch.setattr(serve_app, "run", lambda app, *args, **kwargs: given.update(app=app, args=args))
    # nothing is bound here: an address of another machine (192.168.1.7) must still reach the warning
    monkeypatch.setattr("taps.serve.launch.check_address", lambda host, port: None)
    serve(TargetRef(str(target_dir), "cpu", "float32"), settings=ServeSettings(**settings), announce=lambda line: None)
    return given, capsys.readouterr().err


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("192.168.1.7", None, True), ("::", None, True),
                                             ("0.0.0.0", KEY, False), ("127.0.0.1", None, False),
                                             ("127.0.0.2", None, False), ("localhost", None, False),
                                             ("::1", None, False)])
def test_listening_beyond_the_loopback_without_a_key_warns_loudly(monkeypatch, target_dir, capsys, host, key, warned):
    monkeypatch.delenv("TAPS_API_KEY", raising=False)
    _, err = launched(monkeypatch, target_dir, capsys, host=host, api_key=key)
    if warned:
        assert "WARNING" in err and host in err and "--api-key" in err and "TAPS_API_KEY" in err, err
    else:
        assert "WARNING" not in err, err


def test_the_key_may_come_from_the_environment(monkeypatch, target_dir, capsys):
    monkeypatch.setenv("TAPS_API_KEY", KEY)
    given, err = launched(monkeypatch, target_dir, capsys, host="0.0.0.0")
    assert "WARNING" not in err
    with serving(given["app"]) as (_, url):
        assert raw(url, "GET", "/v1/models")[0] == 401
        assert raw(url, "GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}"})[0] == 200


@pytest.mark.parametrize("argv", [["--api-key", ""], ["--api-key", "has space"]])
def test_a_blank_or_spaced_key_exits_2_naming_the_option(target_dir, capsys, argv):
    try:
        code = main(["serve", "--target", str(target_dir), "--device", "cpu", *argv])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "--api-key" in errors[0] and "Traceback" not in err, err
    assert "unrecognized" not in errors[0]


def test_models_shows_the_short_name_of_the_target(monkeypatch, target_dir, capsys):
    monkeypatch.delenv("TAPS_API_KEY", raising=False)
    given, _ = launched(monkeypatch, target_dir, capsys)
    with serving(given["app"]) as (_, url):
        status, _, listing = raw(url, "GET", "/v1/models")
        (model,) = listing["data"]
        assert status == 200 and model["id"] == Path(target_dir).name and "/" not in model["id"]
        body = json.dumps({"model": model["id"], "prompt": "a", "max_tokens": 2}).encode()
        assert raw(url, "POST", "/v1/completions", body)[0] == 200
    assert Engine.load(TargetRef(str(target_dir) + "/", "cpu", "float32")).model_id == Path(target_dir).name
