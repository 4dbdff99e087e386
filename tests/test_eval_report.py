"""`taps report`: tables with known numbers from hand-made records, and every file from a real tiny run."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

import pytest

from taps.core.config import SpeculationConfig, TreeConfig
from taps.drafter.checkpoint import write_untrained
from taps.eval import records as rec_mod
from taps.eval.benchmarks import Question
from taps.eval.records import ENTROPY_BINS, check_record
from taps.cli.eval import register_report as register
from taps.eval.figures import ReportError
from taps.eval.report import terminal_summary, write_report
from taps.eval.tables import (SPEED_NOTE, Table, depth_table, latex_escape, load_run, speedup_overview, speedup_table,
                              table1, table2)
from taps.eval.runner import EvalSettings, run_eval
from taps.propose.spec import parse_variant
from taps.core.target import Target
from taps.core.testing import write_tiny_target

TABLES = ("table1", "table2", "entropy", "depth", "speedup")
FIGURES = ("fig_lambda_sweep.png", "fig_entropy.png", "fig_depth.png", "fig_speedup.png")


def make(accepted, *, variant, bench="gsm8k", qid="0", turn=0, temperature=0.0, drafters=(), **per_step) -> dict:
    """A valid record; per-step node statistics untraced (None) unless given."""
    steps = len(accepted)
    emitted = [a + 1 for a in accepted]
    record = {
        "version": rec_mod.RECORD_VERSION, "variant": variant, "bench": bench, "question_id": str(qid), "turn": turn,
        "temperature": float(temperature), "category": "c", "seed": 0, "drafters": list(drafters),
        "new_tokens": 1 + sum(emitted), "verifier_calls": steps + 1, "prompt_tokens": 5, "reused_prefix": 0,
        "stop_reason": "max_new_tokens", "output": "", "accepted": list(accepted), "emitted": emitted,
        "tree_size": [5] * steps, "source": [0] * steps, "sources": [1] * steps, "step_info": [{}] * steps,
        **{k: [None] * steps for k in rec_mod.TRACED},
        "draft_entropy_hist": {"accepted": [0] * ENTROPY_BINS, "rejected": [0] * ENTROPY_BINS},
        "wall_s": 1.0, "prefill_s": 0.0, "draft_s": 0.0, "target_s": 0.0, "other_s": 0.0, "trace_s": 0.0,
    }
    record.update(per_step)
    return check_record(record, "test")


def write_run(root: Path, variants: dict, records: list[dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    info = {"target": "tiny", "tree": {"total_tokens": 12, "depth": 3, "top_k": 3}, "max_new_tokens": 8, "seed": 0,
            "top_p": 1.0, "variants": variants}
    (root / "run.json").write_text(json.dumps(info))
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def spec(strategy, drafters=(), **kw) -> dict:
    return {"strategy": strategy, "drafters": [list(d) for d in drafters], "signal": "confidence",
            "granularity": "step", "merge_mode": "disjoint", "weights": None, **kw}


# ---- Table 1 on known numbers --------------------------------------------------------------------
@pytest.fixture
def acceptance_run(tmp_path) -> Path:
    """tau per cell: [4] -> 6/2 = 3.0, [1] -> 1.5, [2] -> 2.0, [3] -> 2.5, [1, 0] -> 4/3, [0] -> 1.0."""
    variants = {"base": spec("baseline"), "a_x": spec("single", [("a", "/d/a")]), "b": spec("single", [("b", "/d/b")])}
    records = [
        make([0], variant="base", bench="gsm8k"), make([0, 0], variant="base", bench="mt_bench"),
        make([4], variant="a_x", bench="gsm8k"), make([1], variant="a_x", bench="mt_bench"),  # average 2.25
        make([2], variant="b", bench="gsm8k"), make([3], variant="b", bench="mt_bench"),  # average 2.25 (a tie)
        make([0], variant="base", bench="gsm8k", temperature=1.0),  # T=1: gsm8k only, so no Average
        make([1, 0], variant="a_x", bench="gsm8k", temperature=1.0),
    ]
    return write_run(tmp_path / "results", variants, records)


def test_table1_values_average_and_best(acceptance_run):
    table = table1(load_run(acceptance_run))
    assert table.header == ["variant", "T", "mt_bench", "gsm8k", "Average"]  # the paper's benchmark order
    assert table.rows[:3] == [["base", "0", 1.0, 1.0, 1.0], ["a_x", "0", 1.5, 3.0, 2.25],
                              ["b", "0", 2.5, 2.0, 2.25]]
    assert [r[:2] for r in table.rows[3:]] == [["base", "1"], ["a_x", "1"]]
    assert table.rows[4][3] == 4 / 3 and table.rows[4][2] is None and table.rows[4][4] is None
    assert table.bold == {(2, 2), (1, 3), (1, 4), (2, 4), (4, 3)}  # per column within a temperature; ties both
    md = table.to_markdown()
    assert "| a_x | 0 | 1.50 | **3.00** | **2.25** |" in md
    assert "| a_x | 1 | – | **1.33** | – |" in md
    tex = table.to_latex()
    assert r"a\_x & 0 & 1.50 & \textbf{3.00} & \textbf{2.25} \\" in tex
    assert r"\toprule" in tex and r"\bottomrule" in tex and tex.count(r"\midrule") == 2  # header + T block
    assert "mt\\_bench" in tex and "a_x" not in tex


def test_csv_parses_back_to_the_same_numbers(acceptance_run):
    table = table1(load_run(acceptance_run))
    rows = list(csv.reader(io.StringIO(table.to_csv())))
    assert rows[0] == table.header
    for parsed, row in zip(rows[1:], table.rows):
        assert parsed[:2] == row[:2]
        assert [float(x) if x else None for x in parsed[2:]] == row[2:]  # exact, nan/None -> empty
    assert len(rows) == 1 + len(table.rows)


def test_speedup_and_depth_tables(acceptance_run):
    run = load_run(acceptance_run)  # the baseline is named "base": found by its strategy, not its name
    rows = {(r[0], r[1], r[2]): r[3:] for r in speedup_table(run).rows}  # every wall_s is 1.0
    assert rows[("a_x", "0", "gsm8k")] == [1, 6.0, 3.0] and rows[("a_x", "0", "mt_bench")] == [1, 3.0, 1.0]
    assert rows[("a_x", "0", "Average")] == [2, 4.5, 2.0] and rows[("base", "0", "Average")][2] == 1.0
    assert rows[("a_x", "1", "gsm8k")] == [1, 4.0, 2.0] and ("a_x", "1", "Average") not in rows
    overview = {(r[0], r[1]): r[2:] for r in speedup_overview(run).rows}  # the terminal's pivot of the same numbers
    assert overview[("a_x", "0")] == [1.0, 3.0, 2.0, 4.5]
    for table in (speedup_table(run), speedup_overview(run)):  # says the trees were fixed, and their shape
        assert table.caption.startswith(SPEED_NOTE) and "fixed tree (12 tokens, 3 levels, 3 wide" in table.caption
    info = json.loads((acceptance_run / "run.json").read_text())
    (acceptance_run / "run.json").write_text(json.dumps({**info, "tree_mode": "auto"}))
    auto = speedup_table(load_run(acceptance_run)).caption
    assert "`--tree auto`" in auto and "fixed tree" not in auto
    depth = depth_table(run)
    assert depth.header == ["variant", "T", "alpha_1", "alpha_2", "alpha_3"]  # run.json tree.depth
    assert depth.rows[0] == ["a_x", "0", 1.0, 0.5, 1.0]  # steps accepting 4 and 1
    assert "| a_x | 0 | 1.000 | 0.500 | 1.000 |" in depth.to_markdown()


def test_latex_escaping():
    assert latex_escape("hass_math 90% a&b #1 {x} ~^ $\\") == \
        r"hass\_math 90\% a\&b \#1 \{x\} \textasciitilde{}\textasciicircum{} \$\textbackslash{}"
    table = Table("t", "t", ["variant", "tau"], [["eagle2_routed_x", 2.0]], bold={(0, 1)})
    assert r"eagle2\_routed\_x & \textbf{2.00} \\" in table.to_latex()
    assert r"\begin{tabular}{lr}" in table.to_latex()


def test_terminal_summary_and_missing_run_json(acceptance_run, tmp_path):
    text = terminal_summary(acceptance_run)
    assert "Average" in text and all(name in text for name in ("base", "a_x", "b"))
    assert "Speedup over the baseline" in text and "not comparable across machines" in text
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "records.jsonl").write_text((acceptance_run / "records.jsonl").read_text())
    with pytest.raises(FileNotFoundError, match="run.json is missing.*not made by `taps eval`"):
        write_report(tmp_path / "bare", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="run.json"):
        terminal_summary(tmp_path / "nowhere")


def test_skips_are_noted_and_missing_matplotlib_is_explained(acceptance_run, tmp_path, monkeypatch):
    report = write_report(acceptance_run, tmp_path / "out").read_text()
    assert "Table 2 skipped: the run has no routed variant." in report
    assert "Figure 6 (lambda sweep) skipped" in report and "Figure 7 (entropy histograms) skipped" in report
    assert not (tmp_path / "out" / "table2.md").exists() and (tmp_path / "out" / "table1.tex").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ReportError, match=r"pip install 'taps\[report\]'"):
        write_report(acceptance_run, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()  # refused before writing anything


# ---- Table 2 on known numbers --------------------------------------------------------------------
def scored(variant, qid, conf, ent, bench="gsm8k") -> dict:
    return make([0], variant=variant, qid=qid, bench=bench, tree_confidence_mean=[conf], tree_entropy_mean=[ent])


def chosen(variant, qid, picks, bench="gsm8k") -> dict:
    return make([1] * len(picks), variant=variant, qid=qid, bench=bench, drafters=("m", "c"),
                step_info=[{"route_chosen": p, "route_scores": None} for p in picks])


def test_table2_shares(tmp_path):
    members = [("m", "/d/math"), ("c", "/d/x/../chat")]  # the single variants' dirs match by resolved path
    variants = {"math": spec("single", [("math", "/d/math")]), "chat": spec("single", [("chat", "/d/chat/")]),
                "routed": spec("route", members), "turned": spec("route", members, signal="entropy",
                                                                 granularity="turn")}
    records = [
        # gsm8k: confidence picks math on q0-q2, chat on q3; entropy (lowest wins) math on q0 only
        scored("math", "0", 0.9, 1.0), scored("chat", "0", 0.5, 2.0),
        scored("math", "1", 0.8, 3.0), scored("chat", "1", 0.4, 1.0),
        scored("math", "2", 0.7, 3.0), scored("chat", "2", 0.6, 2.0),
        scored("math", "3", 0.1, 3.0), scored("chat", "3", 0.6, 2.0),
        # mt_bench: confidence picks chat twice; entropy splits
        scored("math", "0", 0.2, 1.0, "mt_bench"), scored("chat", "0", 0.3, 2.0, "mt_bench"),
        scored("math", "1", 0.2, 3.0, "mt_bench"), scored("chat", "1", 0.3, 2.0, "mt_bench"),
        chosen("routed", "0", [0, 0, 1]), chosen("routed", "1", [0]),  # steps: m 3/4
        chosen("turned", "0", [1, 1]), chosen("turned", "1", [0]),  # turns: 1/2 each (steps would be 1/3)
    ]
    table = table2(load_run(write_run(tmp_path / "r", variants, records)))
    assert table.header == ["heads", "T", "bench", "selector", "n", "m", "c"]
    rows = {(r[2], r[3]): r[4:] for r in table.rows}
    assert rows[("gsm8k", "confidence (post hoc)")] == [4, 0.75, 0.25]
    assert rows[("gsm8k", "entropy (post hoc)")] == [4, 0.25, 0.75]
    assert rows[("mt_bench", "confidence (post hoc)")] == [2, 0.0, 1.0]
    assert rows[("mt_bench", "entropy (post hoc)")] == [2, 0.5, 0.5]
    assert rows[("gsm8k", "routed (causal, per step)")] == [4, 0.75, 0.25]
    assert rows[("gsm8k", "turned (causal, per turn)")] == [2, 0.5, 0.5]
    assert all(r[0] == "math vs chat" for r in table.rows) and not table.notes  # named by the single variants
    assert "| math vs chat | 0 | gsm8k | confidence (post hoc) | 4 | 0.750 | 0.250 |" in table.to_markdown()


def test_table2_without_single_heads_is_noted(tmp_path):
    variants = {"routed": spec("route", [("m", "/d/math"), ("c", "/d/chat")])}
    table = table2(load_run(write_run(tmp_path / "r", variants, [chosen("routed", "0", [1, 1])])))
    assert any("no single-head records of m, c" in n for n in table.notes)
    assert table.rows == [["m vs c", "0", "gsm8k", "routed (causal, per step)", 2, 0.0, 1.0]]


# ---- a real tiny run -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    target_dir = write_tiny_target(root / "target")
    a = write_untrained(target_dir, root / "math", seed=1)
    b = write_untrained(target_dir, root / "chat", seed=2)
    specs = ["baseline=baseline", f"hass-math={a}", f"hass-chat={b}", *(f"hass-avg-{l}=average-{l}:{a},{b}"
             for l in (0.1, 0.5, 0.9)), f"hass-routed=route-confidence-step:{a},{b}",
             f"hass-routed-entropy=route-entropy-turn:{a},{b}", f"hass-merged=merge-disjoint:{a},{b}"]
    questions = [Question("mt_bench", "81", "writing", ("Write a poem about the sea.", "Shorter.")),
                 Question("gsm8k", "0", "math", ("Tom has 3 apples and buys 4 more. How many?",), ("7",)),
                 Question("gsm8k", "1", "math", ("A box holds 12 eggs. How many in 3 boxes?",), ("36",))]
    settings = EvalSettings(temperatures=(0.0, 1.0), max_new_tokens=8, speculation=SpeculationConfig(TreeConfig(12, 3, 3)),
                            warmup=False)
    out = root / "results"
    run_eval(Target.load(target_dir), str(target_dir), [parse_variant(s) for s in specs], questions, out, settings,
             progress=False)
    return out


def test_every_file_of_a_real_run(tiny_run, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(tiny_run), "--out", str(tmp_path / "report")])
    assert args.func(args) == 0
    path = tmp_path / "report" / "report.md"
    assert capsys.readouterr().out.strip() == str(path)
    for name in TABLES:
        for ext in ("md", "csv", "tex"):
            assert (tmp_path / "report" / f"{name}.{ext}").stat().st_size > 0, (name, ext)
    for name in FIGURES:
        assert (tmp_path / "report" / name).read_bytes().startswith(b"\x89PNG"), name
    report = path.read_text()
    assert all(f"]({name})" in report for name in FIGURES) and "[csv](table2.csv) · [tex](table2.tex)" in report
    assert "max_new_tokens 8" in report and "depth 3" in report and "## Notes" not in report
    table = list(csv.DictReader(io.StringIO((tmp_path / "report" / "table2.csv").read_text())))
    selectors = {r["selector"] for r in table}
    assert selectors == {"confidence (post hoc)", "entropy (post hoc)", "hass-routed (causal, per step)",
                         "hass-routed-entropy (causal, per turn)"}
    assert all(abs(float(r["math"]) + float(r["chat"]) - 1) < 1e-12 for r in table)
    depth = list(csv.reader(io.StringIO((tmp_path / "report" / "depth.csv").read_text())))
    assert depth[0] == ["variant", "T", "alpha_1", "alpha_2", "alpha_3"] and len(depth) == 1 + 2 * 8
    speed = list(csv.DictReader(io.StringIO((tmp_path / "report" / "speedup.csv").read_text())))
    assert {float(r["speedup"]) for r in speed if r["variant"] == "baseline"} == {1.0}


def test_lambda_sweep_ends_at_the_members_alone(tiny_run):
    from taps.eval.figures import lambda_sweeps

    run = load_run(tiny_run)
    assert lambda_sweeps(run) == [[(0.0, "hass-chat"), (0.1, "hass-avg-0.1"), (0.5, "hass-avg-0.5"),
                                   (0.9, "hass-avg-0.9"), (1.0, "hass-math")]]


def test_a_replayed_run_reports_acceptance_and_no_speed(acceptance_run):
    """--acceptance replay verified no tree: Table 1 as usual, the speed tables empty with a note that
    says why, the speedup figure skipped."""
    from taps.eval.figures import fig_speedup
    from taps.eval.tables import REPLAY_NOTE

    info = json.loads((acceptance_run / "run.json").read_text())
    (acceptance_run / "run.json").write_text(json.dumps({**info, "acceptance": "replay"}))
    run = load_run(acceptance_run)
    assert run.replayed and table1(run).rows and run.value("a_x", "gsm8k", 0.0, "speedup") is None
    for table in (speedup_table(run), speedup_overview(run)):
        assert table.rows == [] and table.notes == [REPLAY_NOTE]
    assert "replayed" in fig_speedup(run, acceptance_run / "fig.png") and not (acceptance_run / "fig.png").exists()
    assert REPLAY_NOTE in terminal_summary(acceptance_run)
