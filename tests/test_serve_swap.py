"""Hot swaps of head versions under `taps serve --learn` (serve/swap.py): a new version is served
from the next request on, /metrics reports the version and its figures, a version whose live
acceptance falls below its predecessor's is rolled back, corrupt and mismatched versions are
refused with one log line; greedy answers stay those of plain decoding before, during and after."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serve import fitted_heads, raw  # noqa: E402

from taps.core.config import SpeculationConfig, TreeConfig  # noqa: E402
from taps.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME, write_untrained  # noqa: E402
from taps.serve.app import Limits, create_app, serving  # noqa: E402
from taps.core.target import TargetRef  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.serve.metrics import parse  # noqa: E402
from taps.serve.swap import HEADS_DIR, ROLLED_BACK, HeadSwapper  # noqa: E402

MODEL = "tiny"
PROMPTS = ["Write a short poem about the sea.", "List three colours.", "What is two plus two?"]


def ask(client, prompt: str, variant: str = "a"):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=32,
                                          temperature=0, extra_body={"taps": {"variant": variant, "learn": False}})


def version(root, name: str, number: int):
    return root / HEADS_DIR / name / f"v{number}"


@pytest.fixture(scope="module")
def setup(target_dir, tmp_path_factory):
    heads = dict(fitted_heads(target_dir, tmp_path_factory.mktemp("heads")))
    untrained = write_untrained(target_dir, tmp_path_factory.mktemp("untrained") / "u", seed=5)
    return {"heads": heads, "untrained": untrained}


def served(target_dir, root, heads, check_after: int, poll_s=None):
    engine = Engine.load(TargetRef(str(target_dir), "cpu", "float32"), [("a", heads["a"])], [],
                         SpeculationConfig(TreeConfig(16, 4, 4)), model_id=MODEL)
    swapper = HeadSwapper(root, engine, check_after=check_after, poll_s=poll_s)
    return engine, swapper, create_app(engine, Limits(max_tokens=64), swapper=swapper)


def metrics(url: str) -> dict:
    status, _, text = raw(url, "GET", "/metrics")
    assert status == 200
    return parse(text)


def test_swap_rollback_refusal_with_greedy_answers_unchanged(setup, target_dir, tmp_path, caplog):
    root, heads = tmp_path, setup["heads"]
    engine, swapper, app = served(target_dir, root, heads, check_after=2)
    with serving(app) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        plain = {p: ask(client, p, "baseline").choices[0].message.content for p in PROMPTS}
        first = [ask(client, PROMPTS[0]) for _ in range(2)]  # v0: the fitted head a
        assert [r.choices[0].message.content for r in first] == [plain[PROMPTS[0]]] * 2

        shutil.copytree(setup["untrained"], version(root, "a", 1))  # worse than a: rolled back after its trial
        swapper.scan()
        assert metrics(url)["taps_head_version"][(("head", "a"),)] == 0  # staged, not served before a request
        with caplog.at_level(logging.WARNING, logger="taps.serve"):
            trial = [ask(client, PROMPTS[0]) for _ in range(3)]  # v1, v0, v1: served alternately
            assert metrics(url)["taps_head_version"][(("head", "a"),)] == 1  # on trial
            trial.append(ask(client, PROMPTS[0]))  # v0's second: the trial ends
        assert [r.choices[0].message.content for r in trial] == [plain[PROMPTS[0]]] * 4
        assert trial[0].usage.acceptance_length < first[0].usage.acceptance_length
        assert trial[1].usage.acceptance_length == first[0].usage.acceptance_length  # v0 again, same prompt
        page = metrics(url)
        assert page["taps_head_version"][(("head", "a"),)] == 0  # rolled back
        assert page["taps_version_requests"][(("head", "a"), ("version", "v1"))] == 2
        assert page["taps_version_requests"][(("head", "a"), ("version", "v0"))] == 2 + 2
        assert page["taps_head_version_events"][(("event", "rollback"), ("head", "a"))] == 1
        rolled = [r for r in caplog.records if "rolled a back to v0" in r.getMessage()]
        assert len(rolled) == 1
        assert json.loads((version(root, "a", 1) / ROLLED_BACK).read_text())["previous"] == "v0"

        shutil.copytree(heads["a"], version(root, "a", 2))  # corrupt weights: refused, a v0 serves on
        (version(root, "a", 2) / WEIGHTS_NAME).write_bytes(b"not safetensors")
        shutil.copytree(heads["a"], version(root, "a", 3))  # another target's head: refused too
        config = json.loads((version(root, "a", 3) / CONFIG_NAME).read_text())
        (version(root, "a", 3) / CONFIG_NAME).write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="taps.serve"):
            for _ in range(3):
                swapper.scan()  # v3, the newest: refused; then v2: refused; then nothing is left to try
        refusals = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
        assert len(refusals) == 2 and all("\n" not in line for line in refusals)
        assert "v3" in refusals[0] and "hidden_size" in refusals[0]
        assert "v2" in refusals[1] and WEIGHTS_NAME in refusals[1]
        assert ask(client, PROMPTS[1]).choices[0].message.content == plain[PROMPTS[1]]
        assert metrics(url)["taps_head_version"][(("head", "a"),)] == 0

        shutil.copytree(heads["b"], version(root, "a", 4))  # a good version: on trial from the next request on
        swapper.scan()
        for p in PROMPTS:
            assert ask(client, p).choices[0].message.content == plain[p]
        page = metrics(url)
        assert page["taps_head_version"][(("head", "a"),)] == 4
        assert page["taps_version_requests"][(("head", "a"), ("version", "v4"))] == 2  # requests 1 and 3
        assert page["taps_version_acceptance_length"][(("head", "a"), ("version", "v4"))] >= 1.0
    # a new server starts on the newest good version, never on the rolled-back one
    assert HeadSwapper(root, engine, poll_s=None).served["a"] == 4


class _Pool:
    attn = None

    def __init__(self):
        self.replaced = []

    def head(self, path):
        return ("head", path)

    def replace(self, path, head):
        self.replaced.append(head)


class _Engine:
    def __init__(self):
        self.drafters, self.pool, self.target = {"a": "a-dir"}, _Pool(), None


def _serve_stream(swapper, acceptance_of):
    """One request per call of acceptance_of(version) -> tokens per verifier call; the versions used."""
    used = []
    for accept in acceptance_of:
        versions = swapper.apply()
        used.append(versions["a"])
        swapper.finished(versions, ["a"], tokens=int(10 * accept(versions["a"])), calls=10, seconds=1.0)
    return used


def test_a_trial_compares_versions_on_the_same_stretch_of_traffic(tmp_path, caplog):
    """The stream gets harder right at the swap (5.0 -> 3.0 tokens per call whatever the head): the
    new version, as good as the old, is kept; compared with the requests before the swap (the rule
    this replaced) it would have been rolled back. A worse one is rolled back after its trial."""
    swapper = HeadSwapper(tmp_path, _Engine(), check_after=2, poll_s=None)
    assert _serve_stream(swapper, [lambda v: 5.0] * 4) == [0] * 4
    swapper.staged["a"] = (1, ("head", "v1"))
    used = _serve_stream(swapper, [lambda v: 3.0] * 6)
    assert used == [1, 0, 1, 0, 1, 1]  # alternately until each served 2, then the new one
    assert swapper.served["a"] == 1 and ("a", "rollback") not in swapper.events
    (tmp_path / HEADS_DIR / "a" / "v2").mkdir(parents=True)
    swapper.staged["a"] = (2, ("head", "v2"))
    with caplog.at_level(logging.WARNING, logger="taps.serve"):
        used = _serve_stream(swapper, [lambda v: 2.0 if v == 2 else 3.0] * 6)
    assert used == [2, 1, 2, 1, 1, 1] and swapper.served["a"] == 1
    assert swapper.events[("a", "rollback")] == 1 and swapper.heads["a"] == ("head", "v1")
    assert json.loads((tmp_path / HEADS_DIR / "a" / "v2" / ROLLED_BACK).read_text())["previous"] == "v1"
    assert [r.getMessage() for r in caplog.records if "rolled a back to v1" in r.getMessage()]


def test_no_request_fails_or_changes_while_versions_arrive(setup, target_dir, tmp_path):
    """Requests from three clients at once while the watcher thread picks up two versions."""
    root, heads = tmp_path, setup["heads"]
    _, swapper, app = served(target_dir, root, heads, check_after=50, poll_s=0.05)
    with serving(app) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        plain = {p: ask(client, p, "baseline").choices[0].message.content for p in PROMPTS}
        answers, errors = [], []

        def worker(k: int) -> None:
            for i in range(4):
                p = PROMPTS[(k + i) % len(PROMPTS)]
                try:
                    answers.append((p, ask(client, p).choices[0].message.content))
                except Exception as err:  # noqa: BLE001 (counted: the test fails on any)
                    errors.append(err)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        shutil.copytree(heads["b"], version(root, "a", 1))
        shutil.copytree(heads["a"], version(root, "a", 2))
        for t in threads:
            t.join()
        assert errors == [] and len(answers) == 12
        assert all(text == plain[p] for p, text in answers)
        swapper.scan()  # whatever the watcher has not seen yet
        assert ask(client, PROMPTS[0]).choices[0].message.content == plain[PROMPTS[0]]
        assert metrics(url)["taps_head_version"][(("head", "a"),)] == 2
    swapper.close()
