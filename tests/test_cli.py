"""The `taps` command end to end on a tiny target directory."""

import json
import subprocess
import sys

import pytest

from taps.cli.main import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_plain_and_speculative_agree(capsys, tmp_path, target_dir):
    assert main(["drafter", "init", "--target", str(target_dir), "--out", str(tmp_path / "d"), "--seed", "1"]) == 0
    capsys.readouterr()
    common = ["generate", "--target", str(target_dir), "--prompt", "How many clips?", "--max-new-tokens", "12",
              "--device", "cpu", "--json"]
    plain = run_json(capsys, *common)
    spec = run_json(capsys, *common, "--drafter", str(tmp_path / "d"), "--total-tokens", "20", "--depth", "3")
    for key in ("text", "token_ids", "new_tokens", "steps", "acceptance_length", "tokens_per_second"):
        assert key in plain and key in spec
    assert spec["token_ids"] == plain["token_ids"]
    assert plain["acceptance_length"] == 1.0
    assert spec["new_tokens"] == len(spec["token_ids"]) <= 12


def test_generate_prompt_ids_and_raw(capsys, target_dir):
    out = run_json(capsys, "generate", "--target", str(target_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                   "--device", "cpu", "--json")
    assert out["prompt_tokens"] == 3 and out["new_tokens"] == 4
    raw = run_json(capsys, "generate", "--target", str(target_dir), "--prompt", "The quick brown fox", "--raw",
                   "--max-new-tokens", "3", "--device", "cpu", "--json", "--temperature", "1.0", "--seed", "3")
    assert raw["new_tokens"] <= 3


def test_errors_are_reported_not_raised(capsys, tmp_path, target_dir):
    assert main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "x", "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--target", str(target_dir), "--prompt-ids", "1,2", "--max-new-tokens", "600",
                 "--device", "cpu"]) == 2
    assert "context window of 512" in capsys.readouterr().err
    assert main(["generate", "--target", str(target_dir), "--drafter", str(tmp_path), "--prompt", "x",
                 "--device", "cpu"]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(target_dir), "--prompt-ids", "1,a"])


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "taps.cli.main", "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout and "drafter" in out.stdout


@pytest.mark.parametrize("strategy", [["--strategy", "route"], ["--strategy", "route", "--signal", "entropy",
                                                                "--granularity", "turn"],
                                      ["--strategy", "merge", "--merge-mode", "trie"],
                                      ["--strategy", "merge", "--merge-mode", "budget"],
                                      ["--strategy", "average", "--weight", "0.3", "--weight", "0.7"]])
def test_generate_composes_several_drafters(capsys, tmp_path, target_dir, strategy):
    for seed in (1, 2):
        assert main(["drafter", "init", "--target", str(target_dir), "--out", str(tmp_path / f"d{seed}"),
                     "--seed", str(seed)]) == 0
    capsys.readouterr()
    common = ["generate", "--target", str(target_dir), "--prompt", "How many clips?", "--max-new-tokens", "10",
              "--device", "cpu", "--json"]
    plain = run_json(capsys, *common)
    out = run_json(capsys, *common, "--drafter", f"math={tmp_path / 'd1'}", "--drafter", f"chat={tmp_path / 'd2'}",
                   *strategy)
    assert out["token_ids"] == plain["token_ids"]
    if strategy[1] == "route":
        assert all(info["route_chosen"] in (0, 1) for info in out["step_info"])


@pytest.mark.parametrize("sugar, spec", [
    (["--strategy", "route", "--signal", "entropy", "--granularity", "turn"], "route-entropy-turn:math={d1},chat={d2}"),
    (["--strategy", "merge", "--merge-mode", "trie"], "merge-trie:math={d1},chat={d2}"),
    (["--strategy", "average", "--weight", "0.3", "--weight", "0.7"], "average-0.3:math={d1},chat={d2}"),
])
def test_generate_variant_is_what_the_flags_build(capsys, tmp_path, target_dir, sugar, spec):
    """--variant SPEC and the --drafter/--strategy sugar name one composition: the same run, step for step."""
    dirs = {f"d{seed}": str(tmp_path / f"d{seed}") for seed in (1, 2)}
    for seed in (1, 2):
        assert main(["drafter", "init", "--target", str(target_dir), "--out", dirs[f"d{seed}"], "--seed", str(seed)]) == 0
    capsys.readouterr()
    common = ["generate", "--target", str(target_dir), "--prompt", "How many clips?", "--max-new-tokens", "10",
              "--device", "cpu", "--json"]
    flags = run_json(capsys, *common, "--drafter", f"math={dirs['d1']}", "--drafter", f"chat={dirs['d2']}", *sugar)
    named = run_json(capsys, *common, "--variant", spec.format(**dirs))
    for key in ("token_ids", "accepted_per_step", "drafter_per_step", "step_info"):
        assert named[key] == flags[key], key


def test_generate_strategy_errors(capsys, tmp_path, target_dir):
    assert main(["drafter", "init", "--target", str(target_dir), "--out", str(tmp_path / "d")]) == 0
    base = ["generate", "--target", str(target_dir), "--prompt-ids", "1,2", "--device", "cpu"]
    assert main(base + ["--drafter", str(tmp_path / "d"), "--drafter", str(tmp_path / "d")]) == 2
    assert "names must be distinct" in capsys.readouterr().err
    assert main(base + ["--drafter", f"a={tmp_path / 'd'}", "--drafter", f"b={tmp_path / 'd'}"]) == 2
    assert "single takes exactly one drafter" in capsys.readouterr().err
    assert main(base + ["--strategy", "merge"]) == 2
    assert "needs --drafter" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["drafter", "table"], ["train"], ["eval"], ["demo"]])
def test_help_shows_real_defaults_only(capsys, argv):
    # argparse's stock formatter would print "(default: None)" after help that already says what an
    # unset option means, e.g. "(default: $TAPS_DATA_DIR)"; ours prints only defaults that exist.
    from taps.cli.main import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([*argv, "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert text.count("(default:") >= 1


@pytest.mark.parametrize("key, out, moved", [("target_fingerprint", None, True), ("drafter_weights", None, True),
                                             ("acceptance", None, True),  # a verified demo's, before replay was the default
                                             ("tree", None, False), ("target_fingerprint", "mine", False)])
def test_demo_moves_an_earlier_defaults_results_aside(tmp_path, monkeypatch, capsys, key, out, moved):
    """`make demo` after a new embedded default shipped still runs in one command: results of the old
    target or heads in the default directory are moved aside (kept), never mixed in; any other
    mismatch, or a directory the user named, keeps the refusal."""
    from types import SimpleNamespace

    from taps import study
    from taps.eval import report
    from taps.eval.runner import ResultsMismatchError

    monkeypatch.chdir(tmp_path)
    results = tmp_path / (out or "runs/demo-study") / "results"
    results.mkdir(parents=True)
    (results / "records.jsonl").write_text("old\n")
    calls = []

    def run_study(s, stages, progress):
        calls.append(stages)
        if len(calls) == 1:
            raise ResultsMismatchError(f"{key} differs", key)
        return tmp_path / "report"

    monkeypatch.setattr(study, "demo_study", lambda *a, **k: SimpleNamespace(variants=[], benches=[], target="t",
                                                                             results=results))
    monkeypatch.setattr(study, "run_study", run_study)
    monkeypatch.setattr(report, "terminal_summary", lambda path: "")
    rc = main(["demo", "--no-progress"] + (["--out", out] if out else []))
    aside = list((tmp_path / "runs").glob("demo-study.previous-*")) if (tmp_path / "runs").is_dir() else []
    if moved:
        assert rc == 0 and len(calls) == 2 and len(aside) == 1
        assert (aside[0] / "results" / "records.jsonl").read_text() == "old\n"
        assert "moved them to" in capsys.readouterr().out
    else:
        assert rc == 2 and len(calls) == 1 and not aside
        assert (results / "records.jsonl").read_text() == "old\n"
        assert f"{key} differs" in capsys.readouterr().err
