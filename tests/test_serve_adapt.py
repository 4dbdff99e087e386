"""`taps adapt DIR --head NAME` (serve/adapt.py): fine-tunes the served head on what `taps serve
--learn DIR` logged, reports held-out acceptance before and after, writes the next version only
when it is better, resumes a killed run to the same result, refuses bad input in one line."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from taps.cli.main import main  # noqa: E402
from taps.core.config import SpeculationConfig, TreeConfig  # noqa: E402
from taps.drafter.checkpoint import WEIGHTS_NAME, write_untrained  # noqa: E402
from taps.core.identity import file_sha256  # noqa: E402
from taps.serve.app import Limits, create_app, serving  # noqa: E402
from taps.core.target import TargetRef  # noqa: E402
from taps.serve.engine import Engine  # noqa: E402
from taps.serve.learn import Learner  # noqa: E402
from taps.serve.swap import HEADS_DIR  # noqa: E402
from taps.train.trainer import Trainer  # noqa: E402

MODEL = "tiny"
QUESTIONS = [f"What is {a} plus {b}? Answer in words." for a in range(6) for b in range(5)]  # 30 requests


@pytest.fixture(scope="module")
def logged(target_dir, tmp_path_factory):
    """A --learn directory after 30 served answers; the head served as `a` is an untrained one."""
    base = write_untrained(target_dir, tmp_path_factory.mktemp("base") / "a", seed=3)
    root = tmp_path_factory.mktemp("learn")
    engine = Engine.load(TargetRef(str(target_dir), "cpu", "float32"), [("a", str(base))], [],
                         SpeculationConfig(TreeConfig(16, 4, 4)), model_id=MODEL)
    learner = Learner(root, engine)
    with serving(create_app(engine, Limits(max_tokens=64), learner=learner)) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for q in QUESTIONS:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=24,
                                           temperature=0)
        learner.flush()
    learner.close()
    return {"root": root, "base": str(base)}


def adapt_args(root, target_dir, base, *extra) -> list[str]:
    return ["adapt", str(root), "--head", "a", "--target", str(target_dir), "--base", base, "--holdout", "6",
            "--epochs", "3", "--lr", "3e-3", "--batch-size", "4", "--max-new-tokens", "24", "--device", "cpu", *extra]


def copy_of(logged, tmp_path):
    root = tmp_path / "learn"
    shutil.copytree(logged["root"] / "log", root / "log")
    return root


def test_adapt_writes_a_better_version_and_a_killed_run_resumes_to_it(logged, target_dir, tmp_path, capsys,
                                                                      monkeypatch):
    whole = copy_of(logged, tmp_path / "whole")
    assert main(adapt_args(whole, target_dir, logged["base"])) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    scores = json.loads((whole / "adapt" / "a" / "v1" / "eval.json").read_text())
    assert scores["after"] > scores["before"], scores
    assert f"wrote {whole / HEADS_DIR / 'a' / 'v1'}" in line
    assert file_sha256(whole / HEADS_DIR / "a" / "v1" / WEIGHTS_NAME) != file_sha256(f"{logged['base']}/{WEIGHTS_NAME}")
    plan = json.loads((whole / "adapt" / "a" / "v1" / "plan.json").read_text())
    assert plan["from"] == "v0" and plan["train_records"] == len(QUESTIONS) - 6 and plan["heldout_records"] == 6

    killed = copy_of(logged, tmp_path / "killed")
    saves = []
    original = Trainer._save

    def save_then_die(self, metrics):
        original(self, metrics)
        saves.append(self.step)
        if len(saves) == 1:
            raise KeyboardInterrupt  # killed right after the first epoch's checkpoint

    monkeypatch.setattr(Trainer, "_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        main(adapt_args(killed, target_dir, logged["base"]))
    assert not (killed / HEADS_DIR).exists()
    assert main(adapt_args(killed, target_dir, logged["base"])) == 0
    out = capsys.readouterr().out
    assert f"resumed training at step {saves[0]}/" in out
    assert json.loads((killed / "adapt" / "a" / "v1" / "eval.json").read_text()) == scores
    assert file_sha256(killed / HEADS_DIR / "a" / "v1" / WEIGHTS_NAME) == \
        file_sha256(whole / HEADS_DIR / "a" / "v1" / WEIGHTS_NAME)


def test_the_next_run_starts_from_the_newest_version(logged, target_dir, tmp_path, capsys):
    root = copy_of(logged, tmp_path)
    v1 = root / HEADS_DIR / "a" / "v1"
    shutil.copytree(logged["base"], v1)
    (root / HEADS_DIR / "a" / "v2").mkdir()  # rolled back: never the start, but numbers go on after it
    (root / HEADS_DIR / "a" / "v2" / "rolled_back.json").write_text("{}")
    assert main(adapt_args(root, target_dir, logged["base"], "--epochs", "1")) == 0
    plan = json.loads((root / "adapt" / "a" / "v3" / "plan.json").read_text())
    assert plan["from"] == "v1" and plan["from_dir"] == str(v1.resolve())
    capsys.readouterr()


def test_bad_input_is_one_line(logged, target_dir, tmp_path, capsys):
    root = copy_of(logged, tmp_path)
    args = adapt_args(root, target_dir, logged["base"])
    no_base = args[:args.index("--base")] + args[args.index("--base") + 2:]
    assert main(no_base) == 2
    err = capsys.readouterr().err.strip()
    assert "--base" in err and "\n" not in err
    assert main(adapt_args(root, target_dir, logged["base"], "--holdout", "500")) == 2
    err = capsys.readouterr().err.strip()
    assert "--holdout 500" in err and "\n" not in err
    assert main(adapt_args(tmp_path / "nothing", target_dir, logged["base"])) == 2
    assert "no log/" in capsys.readouterr().err


def test_a_head_with_a_draft_vocabulary_keeps_it(logged, target_dir, tmp_path, capsys):
    """The shipped heads draft over a reduced vocabulary (eagle2-mixed-xl: 8192 ids): fine-tuned
    with the same one."""
    import torch

    from taps.drafter.checkpoint import DrafterInfo, load_head, save_head
    from taps.core.target import Target

    target = Target.load(target_dir, device="cpu", dtype="float32")
    ids = torch.tensor(sorted({*range(0, target.vocab_size, 3), *target.stop_token_ids()}))
    base = tmp_path / "reduced"
    save_head(load_head(logged["base"], target).set_draft_vocab(ids), base,
              DrafterInfo(backbone="eagle2", tokenizer_fingerprint=target.fingerprint()))
    root = copy_of(logged, tmp_path)
    assert main(adapt_args(root, target_dir, str(base), "--epochs", "1")) == 0
    assert "held-out acceptance length" in capsys.readouterr().out
    trained = load_head(root / "adapt" / "a" / "v1" / "train", target)
    assert torch.equal(trained.draft_ids.cpu(), ids)


def test_mix_trains_on_the_heads_original_features_too(logged, target_dir, tmp_path, capsys):
    from taps.data.features import FeatureSettings, extract_features
    from taps.serve.answer_log import log_files
    from taps.core.target import Target

    target = Target.load(target_dir, device="cpu", dtype="float32")
    original = tmp_path / "original"  # stands in for the head's own training features
    extract_features(target, log_files(logged["root"])[0], original, FeatureSettings(max_len=64))
    root = copy_of(logged, tmp_path / "run")
    assert main(adapt_args(root, target_dir, logged["base"], "--epochs", "1", "--mix", f"{original}:5")) == 0
    capsys.readouterr()
    config = json.loads((root / "adapt" / "a" / "v1" / "train" / "config.json").read_text())
    assert config["taps"]["features"].endswith(f" + {original}[:5]")  # the logged answers, then the mix


def test_focus_trains_on_what_the_lookup_member_misses(logged, target_dir, tmp_path, capsys):
    """--focus lookup-misses: the fine-tune reads a copy of the features whose loss mask drops the
    answer tokens lookup would have drafted (serve/adapt_focus.py); the run says how many it keeps
    and records the focus in the trained head's config."""
    root = copy_of(logged, tmp_path)
    assert main(adapt_args(root, target_dir, logged["base"], "--epochs", "1", "--focus", "lookup-misses")) == 0
    out = capsys.readouterr().out
    work = root / "adapt" / "a" / "v1"
    focus = json.loads((work / "features-lookup-misses" / "manifest.json").read_text())["focus"]
    kept = focus["answer_tokens"] - focus["covered"]
    assert f"the loss takes the {kept} of {focus['answer_tokens']} answer tokens" in out
    assert 0 < kept < focus["answer_tokens"]  # 30 answers of one shape: lookup drafts part of each
    config = json.loads((work / "train" / "config.json").read_text())
    assert config["taps"]["training_data"].endswith("(lookup-misses)")
    assert config["taps"]["features"].startswith(str(work / "features-lookup-misses"))


def test_judge_merge_scores_the_versions_as_a_learn_server_serves_them(logged, target_dir, tmp_path, capsys):
    """--judge merge: before and after are the acceptance of merge-budget:HEAD,lookup over a
    datastore of the training answers only (judge-store/), kept beside the head-alone keys; the
    verdict follows them. The merged figure differs from the head alone's (lookup drafts too)."""
    from taps.propose.rest import Datastore

    root = copy_of(logged, tmp_path)
    assert main(adapt_args(root, target_dir, logged["base"], "--epochs", "1", "--judge", "merge")) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    work = root / "adapt" / "a" / "v1"
    scores = json.loads((work / "eval.json").read_text())
    assert set(scores) == {"before_merge", "after_merge"}
    assert "merged with lookup + the training answers' datastore" in line
    assert f"{scores['before_merge']:.3f} (v0) -> {scores['after_merge']:.3f}" in line
    assert ("wrote" in line) == (scores["after_merge"] > scores["before_merge"])
    train = [json.loads(x) for x in (work / "train.jsonl").read_text().splitlines()]
    store = Datastore.load(work / "judge-store")
    plan = json.loads((work / "plan.json").read_text())
    assert store.manifest["segments"] == len(train) == plan["train_records"]  # not the held-out answers
    # the same log judged alone (the default): another figure for the same old head
    alone = copy_of(logged, tmp_path / "alone")
    assert main(adapt_args(alone, target_dir, logged["base"], "--epochs", "1")) == 0
    capsys.readouterr()
    head_scores = json.loads((alone / "adapt" / "a" / "v1" / "eval.json").read_text())
    assert set(head_scores) == {"before", "after"} and head_scores["before"] != scores["before_merge"]
