"""bench/ scripts run against the installed package (`pip install -e .`) and take its definitions:
no sys.path patching, the `taps` command's own tree options, no tree shape of their own where the
package has one."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_no_script_patches_the_import_path():
    assert len(SCRIPTS) >= 5
    for script in SCRIPTS:
        tree = ast.parse(script.read_text(), str(script))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert (node.value.id, node.attr) != ("sys", "path"), f"{script.name}:{node.lineno} patches sys.path"


def test_tree_options_are_the_commands_own():
    for script in SCRIPTS:
        text = script.read_text()
        assert '"--total-tokens"' not in text and '"--depth"' not in text, \
            f"{script.name} declares tree options of its own; use taps.cli.args.add_tree_arguments"
        assert "TreeConfig(60, 5, 10)" not in text and "TreeConfig(96, 8, 8)" not in text, \
            f"{script.name} re-declares a tree the package defines (config.FIXED_TREE, config.AUTO_TREE_CAPS)"


def _bench(name: str):
    """bench/NAME.py as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as importlib's recipe does: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_serve_adapt_checks_answers_against_an_earlier_off_run(tmp_path):
    """A learning run alone (`--runs adapt`) is checked against the `off` answers of an earlier
    results.json, by digest; an earlier file without digests is refused, naming --compare-to."""
    serve_adapt = _bench("serve_adapt")
    off = {"rows": [{"i": 0, "text": "a"}, {"i": 1, "text": "b"}]}
    here = serve_adapt.reference_answers({"off": off}, None)
    assert here == {0: serve_adapt.digest("a"), 1: serve_adapt.digest("b")}
    assert serve_adapt.reference_answers({"adapt": off}, None) == {}
    record = serve_adapt.request_record({"i": 0, "text": "a", "tokens": 1})
    assert record == {"i": 0, "tokens": 1, "answer_sha256": serve_adapt.digest("a")}
    assert "answer_sha256" not in serve_adapt.request_record({"i": 1, "error": "Timeout"})
    earlier = tmp_path / "results.json"
    earlier.write_text(json.dumps({"runs": {"off": {"requests": [
        {"i": 0, "answer_sha256": serve_adapt.digest("a")}, {"i": 1, "answer_sha256": serve_adapt.digest("c")}]}}}))
    reference = serve_adapt.reference_answers({"adapt": off}, str(earlier))
    assert [reference[r["i"]] != serve_adapt.digest(r["text"]) for r in off["rows"]] == [False, True]
    earlier.write_text(json.dumps({"runs": {"off": {"requests": [{"i": 0, "tokens": 3}]}}}))
    with pytest.raises(SystemExit, match="--compare-to"):
        serve_adapt.reference_answers({"adapt": off}, str(earlier))


def test_serve_adapt_summarises_each_finished_run(tmp_path):
    """What results.json keeps after every run (so a run killed later leaves the finished ones):
    lost, failed and differing requests counted against the off run, windows from the rows."""
    serve_adapt = _bench("serve_adapt")
    args = argparse.Namespace(window=2, requests=4, max_tokens=8, compare_to=None)
    row = lambda i, text, tokens=4: {"i": i, "text": text, "tokens": tokens, "calls": 2, "seconds": 1.0}
    off = {"rows": [row(0, "a"), row(1, "b"), row(2, "c"), row(3, "d")], "adapt": None, "versions": []}
    store = {"rows": [row(0, "a", 8), row(1, "x"), {"i": 2, "error": "Timeout"}], "adapt": None, "versions": []}
    summary = serve_adapt.summarise(args, {"off": off, "store": store})
    assert (summary["off"]["lost"], summary["off"]["failed"], summary["off"]["differ_from_off"]) == (0, 0, 0)
    assert (summary["store"]["lost"], summary["store"]["failed"], summary["store"]["differ_from_off"]) == (1, 1, 1)
    assert summary["store"]["capped"] == 1  # request 0 ran to max_tokens
    assert [w["acceptance"] for w in summary["store"]["windows"]] == [3.0, 0.0]
    assert summary["store"]["tokens_per_s"] == pytest.approx(6.0)
    assert serve_adapt.summarise(args, {"store": store})["store"]["differ_from_off"] is None  # nothing to compare


def test_serve_adapt_windows_carry_the_gauges_measured_inside_them():
    """Each window's gauge tokens/s come from the gauges measured within its requests (a failed
    gauge counts for nothing), and its tokens/s over the head gauge is what the goal's ratio
    divides: the machine's speed at that time taken out."""
    serve_adapt = _bench("serve_adapt")
    row = lambda i: {"i": i, "text": "a", "tokens": 6, "calls": 2, "seconds": 1.0}
    gauges = [{"after": 0, "variant": "plain", "tokens": 4, "seconds": 2.0},
              {"after": 1, "variant": "head", "tokens": 8, "seconds": 2.0},
              {"after": 3, "variant": "head", "tokens": 6, "seconds": 0.5},
              {"after": 3, "variant": "head", "tokens": 6, "seconds": 1.5},
              {"after": 2, "variant": "plain", "error": "Timeout"}]
    first, second = serve_adapt.windows({"rows": [row(i) for i in range(4)], "gauges": gauges}, 2)
    assert (first["gauge_plain_tokens_per_s"], first["gauge_head_tokens_per_s"]) == (2.0, 4.0)
    assert (second["gauge_plain_tokens_per_s"], second["gauge_head_tokens_per_s"]) == (0.0, 6.0)
    assert serve_adapt.over_gauge(first) == pytest.approx(6.0 / 4.0)
    assert serve_adapt.over_gauge(second) == pytest.approx(1.0)
    assert serve_adapt.over_gauge({**second, "gauge_head_tokens_per_s": 0.0}) is None
    args = argparse.Namespace(window=2, requests=4, max_tokens=8, compare_to=None)
    summary = serve_adapt.summarise(args, {"off": {"rows": [row(i) for i in range(4)], "adapt": None, "versions": [],
                                                   "gauges": gauges}})
    assert summary["off"]["gauge_head_tokens_per_s"] == pytest.approx(20 / 4.0)


def test_compare_answers_counts_differing_answers_over_the_requests_both_runs_answered(tmp_path, capsys):
    """A plain run over the first requests is the reference; each run of another results.json is
    counted over the shared requests only (a failed request has no digest and is left out); a
    missing run or a file that is not a results.json exits 2 naming it."""
    compare = _bench("compare_answers")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"runs": {"plain": {"requests": [
        {"i": 0, "answer_sha256": "a"}, {"i": 1, "answer_sha256": "b"}, {"i": 2, "error": "Timeout"}]}}}))
    stream = tmp_path / "stream.json"
    stream.write_text(json.dumps({"runs": {
        "off": {"requests": [{"i": 0, "answer_sha256": "a"}, {"i": 1, "answer_sha256": "x"},
                             {"i": 2, "answer_sha256": "c"}, {"i": 3, "answer_sha256": "d"}]},
        "store": {"requests": [{"i": 0, "answer_sha256": "a"}, {"i": 1, "error": "Timeout"}]}}}))
    assert compare.main([f"{plain}:plain", str(stream)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"off: 1 of 2 answers differ from {plain}:plain (50%)")
    assert lines[1].endswith(f"store: 0 of 1 answers differ from {plain}:plain (0%)")
    assert compare.main([f"{plain}:adapt", str(stream)]) == 2
    assert "no run 'adapt'" in capsys.readouterr().err
    not_results = tmp_path / "other.json"
    not_results.write_text("[1, 2]")
    assert compare.main([f"{plain}:plain", str(not_results)]) == 2
    assert str(not_results) in capsys.readouterr().err
    assert compare.main([str(plain), str(stream)]) == 2


def test_lookup_depth_rates_counts_each_depth_once_its_parent_was_accepted(tmp_path, capsys, monkeypatch):
    """Replaying an answer that copies the prompt for three tokens and then leaves it: depths 1-3
    accepted, depth 4 tried and rejected, nothing drafted where nothing matches; bad input exits 2."""
    from collections import Counter

    monkeypatch.syspath_prepend(str(BENCH))  # as when run: the script's folder holds _long_prompts
    rates = _bench("lookup_depth_rates")
    tried, accepted = Counter(), Counter()
    rates.replay([5, 1, 2, 3, 4, 9], [1, 2, 3, 4, 7, 8], tried, accepted)
    assert tried == Counter({(1, 1): 1, (1, 2): 1, (1, 3): 1, (1, 4): 1})  # a 1-token match ("1")
    assert accepted == Counter({(1, 1): 1, (1, 2): 1, (1, 3): 1})
    assert rates.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    other = tmp_path / "short.jsonl"
    other.write_text(json.dumps({"bench": "gsm8k", "question": 0, "decoder": "plain", "temperature": 0.0,
                                 "tokens": [1]}) + "\n")
    assert rates.main([str(other)]) == 2
    assert "no greedy `plain` answers of a --workload long run" in capsys.readouterr().err


def test_serve_adapt_splits_each_windows_steps_by_phase():
    """Per window: drafting, target and other ms per draft/verify step and the mean tree size, from
    the usage of its timed requests (steps = verifier calls - 1; rows without a split are left out)."""
    serve_adapt = _bench("serve_adapt")
    rows = [{"i": 0, "tokens": 10, "calls": 3, "seconds": 1.0, "tree_tokens": 4.0,
             "phases": {"draft": 0.02, "target": 0.2, "other": 0.002}},
            {"i": 1, "tokens": 10, "calls": 5, "seconds": 1.0, "tree_tokens": 7.0,
             "phases": {"draft": 0.06, "target": 0.4, "other": 0.01}},
            {"i": 2, "tokens": 10, "calls": 5, "seconds": 1.0}]
    split = serve_adapt.step_split(rows)
    assert split["step_draft_ms"] == pytest.approx(80 / 6) and split["step_target_ms"] == pytest.approx(100)
    assert split["step_other_ms"] == pytest.approx(2) and split["tree_tokens"] == pytest.approx(36 / 6)
    assert serve_adapt.step_split(rows[2:]) == {}
    (window,) = serve_adapt.windows({"rows": rows}, 3)
    assert window["tree_tokens"] == pytest.approx(6.0) and window["acceptance"] == pytest.approx(30 / 13)


def test_decode_speed_table_marks_a_peer_that_was_not_run(capsys, monkeypatch):
    """`--only` without transformers' `generate`: its column reads "-", not nan; the ratios that
    were measured are printed from the records."""
    monkeypatch.syspath_prepend(str(BENCH))  # as when run as a script: its sibling modules import
    decode_speed = _bench("decode_speed")

    def record(tokens, seconds):
        return {"tokens": list(range(tokens)), "seconds": seconds, "prefill_s": 0.0}
    tallies = {"plain": decode_speed.Tally(records=[record(10, 1.0)], ratios=[1.0]),
               "hf-prompt-lookup": decode_speed.Tally(records=[record(10, 0.5)], ratios=[2.0])}
    decode_speed.print_table("summarisation", 0.0, tallies)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| plain")
            or line.startswith("| hf-prompt-lookup")]
    assert len(rows) == 2 and "nan" not in "".join(rows)
    plain_cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert plain_cells[:6] == ["plain", "10.0", "1.00", "1.00", "-", "0.50"]
