"""`taps eval`: every variant decodes every question losslessly, records resume without duplicates,
mismatched reruns are refused, and a 2-process sharded run writes the same records as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from taps.core.config import SpeculationConfig, TreeConfig
from taps.drafter.checkpoint import write_untrained
from taps.eval import runner
from taps.eval.benchmarks import Question
from taps.eval.records import read_records, record_key
from taps.eval.runner import EvalSettings, ResultsMismatchError, Shard, run_eval, shard_units
from taps.propose.spec import parse_variant
from taps.core.target import Target, TargetRef
from taps.core.testing import write_tiny_target

QUESTIONS = [
    Question("mt_bench", "81", "writing", ("Write a poem about the sea.", "Now make it shorter.")),
    Question("gsm8k", "0", "math", ("Tom has 3 apples and buys 4 more. How many?",), ("7",)),
    Question("gsm8k", "1", "math", ("A box holds 12 eggs. How many in 3 boxes?",), ("36",)),
]
SETTINGS = EvalSettings(temperatures=(0.0, 1.0), max_new_tokens=12, speculation=SpeculationConfig(TreeConfig(12, 3, 3)),
                        warmup=False)
TIMING = {"wall_s", "prefill_s", "draft_s", "target_s", "other_s", "trace_s"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    target_dir = write_tiny_target(root / "target")
    a = write_untrained(target_dir, root / "math", seed=1)
    b = write_untrained(target_dir, root / "chat", seed=2)
    specs = ["base=baseline", f"math={a}", f"avg=average-0.3:{a},{b}", f"routed=route-confidence-step:{a},{b}",
             f"turned=route-entropy-turn:{a},{b}", f"merged=merge-trie:{a},{b}", f"budget=merge-budget:{a},{b}",
             f"learned=route-bandit-turn:{a},{b}"]
    return target_dir, [parse_variant(s) for s in specs], specs


def _strip(records):
    return sorted(({k: v for k, v in r.items() if k not in TIMING} for r in records), key=record_key)


def test_every_variant_every_turn_and_greedy_is_lossless(tmp_path, setup):
    target_dir, variants, _ = setup
    target = Target.load(target_dir)
    written = run_eval(target, str(target_dir), variants, QUESTIONS, tmp_path, SETTINGS, progress=False)
    assert written == len(QUESTIONS) * 2 * len(variants)
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == (2 + 1 + 1) * 2 * len(variants)  # mt_bench has two turns
    assert len({record_key(r) for r in records}) == len(records)
    greedy = {}
    for r in records:
        if r["temperature"] == 0.0:
            greedy.setdefault((r["bench"], r["question_id"], r["turn"]), set()).add(r["output"])
        assert r["new_tokens"] == 1 + sum(r["emitted"])
    assert all(len(outputs) == 1 for outputs in greedy.values()), greedy  # every variant == the baseline
    routed = [r for r in records if r["variant"] == "routed"]
    assert all(info["route_chosen"] in (0, 1) and len(info["route_scores"]) == 2
               for r in routed for info in r["step_info"])
    assert all(r["drafters"] == ["math", "chat"] for r in routed)
    learned = [r for r in records if r["variant"] == "learned"]  # one decision per turn, at its first step
    assert all(r["step_info"][0]["route_context"] in (0, 1) and len(r["step_info"][0]["route_prior"]) == 2
               and {info["route_chosen"] for info in r["step_info"]} == {r["step_info"][0]["route_chosen"]}
               for r in learned if r["step_info"])
    base = [r for r in records if r["variant"] == "base"]
    assert all(set(r["accepted"]) <= {0} and r["tree_confidence_mean"] == [None] * len(r["accepted"]) for r in base)
    merged = [r for r in records if r["variant"] == "merged"]
    assert all(len(c) == a for r in merged for c, a in zip(r["accepted_confidence"], r["accepted"]))
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["variants"]["avg"]["weights"] == [0.3, 0.7]


def interrupted_run(monkeypatch, at: int, *args, **kwargs) -> None:
    """run_eval(*args, **kwargs), interrupted (Ctrl-C) as its `at`-th conversation starts."""
    calls = {"n": 0}
    real = runner.decode_conversation

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(runner, "decode_conversation", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_eval(*args, **kwargs)
    monkeypatch.setattr(runner, "decode_conversation", real)


def test_resume_after_interruption_never_duplicates(tmp_path, setup, monkeypatch):
    target_dir, variants, _ = setup
    target = Target.load(target_dir)
    interrupted_run(monkeypatch, 5, target, str(target_dir), variants, QUESTIONS, tmp_path, SETTINGS, progress=False)
    path = tmp_path / "records.jsonl"
    before = path.read_bytes()
    assert len(read_records(path)) == 4 * 2  # 4 conversations of the 2-turn question
    with path.open("ab") as f:
        f.write(b'{"variant": "base", "bench": "gsm')  # a torn write from the crash
    written = run_eval(target, str(target_dir), variants, QUESTIONS, tmp_path, SETTINGS, progress=False)
    assert written == len(QUESTIONS) * 2 * len(variants) - 4
    after = path.read_bytes()
    assert after.startswith(before)  # earlier results untouched
    records = read_records(path)
    assert len({record_key(r) for r in records}) == len(records) == 4 * 2 * len(variants)
    assert run_eval(target, str(target_dir), variants, QUESTIONS, tmp_path, SETTINGS, progress=False) == 0
    assert path.read_bytes() == after


def test_a_resumed_bandit_decides_as_an_uninterrupted_one(tmp_path, setup, monkeypatch):
    """route-bandit learns across the questions of a run; resumed, it relearns from its records
    first, so every decision (and record) is what one uninterrupted run writes."""
    target_dir, variants, _ = setup
    learned = [v for v in variants if v.name == "learned"]
    target = Target.load(target_dir)
    questions = QUESTIONS * 2  # six conversations per temperature: the state matters by the later ones
    questions = [Question(q.bench, f"{q.question_id}-{i}", q.category, q.turns, q.reference)
                 for i, q in enumerate(questions)]
    run_eval(target, str(target_dir), learned, questions, tmp_path / "one", SETTINGS, progress=False)
    interrupted_run(monkeypatch, 7, target, str(target_dir), learned, questions, tmp_path / "two", SETTINGS,
                    progress=False)
    run_eval(target, str(target_dir), learned, questions, tmp_path / "two", SETTINGS, progress=False)
    one, two = (read_records(tmp_path / d / "records.jsonl") for d in ("one", "two"))
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in two] == \
           [{k: v for k, v in r.items() if k not in TIMING} for r in one]
    scores = {tuple(r["step_info"][0]["route_scores"]) for r in one if r["step_info"]}
    assert len(scores) > 2  # the indices moved as it learned: the comparison is not trivially equal


def test_rerun_with_other_settings_is_refused(tmp_path, setup):
    target_dir, variants, _ = setup
    target = Target.load(target_dir)
    run_eval(target, str(target_dir), variants[:1], QUESTIONS[1:2], tmp_path, SETTINGS, progress=False)
    other = EvalSettings(temperatures=(0.0,), max_new_tokens=13, speculation=SETTINGS.speculation, warmup=False)
    with pytest.raises(ResultsMismatchError, match="max_new_tokens"):
        run_eval(target, str(target_dir), variants[:1], QUESTIONS[1:2], tmp_path, other, progress=False)
    renamed = parse_variant(f"base={variants[1].drafters[0][1]}")
    with pytest.raises(ResultsMismatchError, match="variant 'base'"):
        run_eval(target, str(target_dir), [renamed], QUESTIONS[1:2], tmp_path, SETTINGS, progress=False)


def test_rerun_after_a_drafter_is_retrained_in_place_is_refused(tmp_path, setup):
    # the same variant name and path, other weights: old records must not pass for the new head's
    target_dir, _, _ = setup
    target = Target.load(target_dir)
    head = write_untrained(target_dir, tmp_path / "heads" / "math", seed=1)
    variants = [parse_variant(f"math={head}")]
    out = tmp_path / "results"
    run_eval(target, str(target_dir), variants, QUESTIONS[1:2], out, SETTINGS, progress=False)
    before = (out / "records.jsonl").read_bytes()
    write_untrained(target_dir, head, seed=3, force=True)  # retrained in place
    with pytest.raises(ResultsMismatchError, match="weights of .*math changed"):
        run_eval(target, str(target_dir), variants, QUESTIONS[1:3], out, SETTINGS, progress=False)
    assert (out / "records.jsonl").read_bytes() == before
    assert run_eval(target, str(target_dir), variants, QUESTIONS[1:3], tmp_path / "other", SETTINGS, progress=False) > 0


def test_malformed_results_line_is_named(tmp_path, setup):
    target_dir, variants, _ = setup
    (tmp_path / "records.jsonl").write_text('{"variant": "base"}\nnot json\n')
    with pytest.raises(ValueError, match=r"records\.jsonl: line 2: invalid JSON"):
        run_eval(Target.load(target_dir), str(target_dir), variants[:1], QUESTIONS[1:2], tmp_path, SETTINGS,
                 progress=False)


def test_shards_split_along_the_longer_axis_and_cover_every_unit_once():
    """Many questions: each process takes whole questions (every variant side by side); more variants
    than questions (taps demo: one question per benchmark, one of them two turns): each process takes
    whole variants over every question, so two processes decode the same number of turns."""
    demo = [Question(b, "0", "c", ("a", "b") if b == "mt_bench" else ("a",))
            for b in ("mt_bench", "gsm8k", "math500", "svamp")]
    variants = [parse_variant(f"v{i}=baseline") for i in range(40)]
    many = [Question("gsm8k", str(i), "math", ("a",)) for i in range(80)]
    for questions, vs in ((demo, variants), (many, variants[:4]), (QUESTIONS, variants[:3])):
        every = shard_units(questions, (0.0,), vs, Shard())
        parts = [shard_units(questions, (0.0,), vs, Shard(r, 2)) for r in range(2)]
        assert sorted(map(id_of, parts[0] + parts[1])) == sorted(map(id_of, every))  # each unit once
        assert all(p == [u for u in every if u in p] for p in parts)  # in the single process's order
        by_variant = len(vs) > len(questions)
        axis = [{v.name if by_variant else id(q) for q, _, v in p} for p in parts]
        assert not axis[0] & axis[1]  # a question (or a variant) never straddles two processes
        turns = [sum(len(q.turns) for q, _, _ in p) for p in parts]
        if by_variant:
            assert turns == [100, 100]  # 20 variants x 5 turns each; by question it would be 120 / 80


def id_of(unit) -> tuple:
    q, t, v = unit
    return id(q), t, v.name


def test_shards_merge_into_the_single_process_records(tmp_path, setup, monkeypatch):
    """In-process shards (rank 1, then rank 0 of 2) merge to the same records as one process."""
    target_dir, variants, _ = setup
    target = Target.load(target_dir)
    one, two = tmp_path / "one", tmp_path / "two"
    run_eval(target, str(target_dir), variants[:3], QUESTIONS, one, SETTINGS, progress=False)
    monkeypatch.setattr(runner, "_barrier", lambda: None)
    run_eval(target, str(target_dir), variants[:3], QUESTIONS, two, SETTINGS, Shard(1, 2), progress=False)
    assert not (two / "records.jsonl").exists()  # only rank 0 merges
    run_eval(target, str(target_dir), variants[:3], QUESTIONS, two, SETTINGS, Shard(0, 2), progress=False)
    assert not list((two / "shards").glob("*.jsonl"))
    assert _strip(read_records(two / "records.jsonl")) == _strip(read_records(one / "records.jsonl"))


def test_two_processes_under_accelerate_match_one(tmp_path, setup):
    target_dir, _, specs = setup
    bench = tmp_path / "mini" / "question.jsonl"
    bench.parent.mkdir()
    bench.write_text("".join(json.dumps({"question_id": q.question_id + q.bench, "category": q.category,
                                         "turns": list(q.turns)}) + "\n" for q in QUESTIONS))
    args = ["eval", "--target", str(target_dir), "--bench", str(bench), "--temperature", "0,1",
            "--max-new-tokens", "12", "--total-tokens", "12", "--depth", "3", "--top-k", "3", "--no-progress"]
    for spec in specs[:4]:
        args += ["--variant", spec]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    one = subprocess.run([sys.executable, "-m", "taps.cli.main", *args, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "taps.cli.main"]
    two = subprocess.run([*launch, *args, "--out", str(tmp_path / "two"), "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert not list((tmp_path / "two" / "shards").glob("*.jsonl"))
    assert _strip(read_records(tmp_path / "two" / "records.jsonl")) == _strip(read_records(tmp_path / "one" /
                                                                                          "records.jsonl"))


def test_worker_processes_on_one_machine_match_one_process(tmp_path, setup, capsys):
    """taps eval --jobs 2: two spawned workers, one merge; the same records as one process."""
    from taps.cli.main import main
    from taps.eval.runner import run_eval_jobs

    target_dir, variants, specs = setup
    run_eval(Target.load(target_dir, dtype="float32"), str(target_dir), variants[:4], QUESTIONS, tmp_path / "one", SETTINGS,
             progress=False)
    total = run_eval_jobs(TargetRef(str(target_dir), "cpu", "float32"), variants[:4], QUESTIONS, tmp_path / "two",
                          SETTINGS, jobs=2, progress=False)
    assert total == len(read_records(tmp_path / "one" / "records.jsonl"))
    assert not list((tmp_path / "two" / "shards").glob("*.jsonl"))
    assert _strip(read_records(tmp_path / "two" / "records.jsonl")) == _strip(read_records(tmp_path / "one" /
                                                                                          "records.jsonl"))
    replayed = EvalSettings(temperatures=(0.0,), max_new_tokens=12, speculation=SETTINGS.speculation, warmup=False,
                            acceptance="replay")  # into results of other settings: the workers' refusal, as itself
    with pytest.raises(ResultsMismatchError, match="acceptance = None, this run has 'replay'") as refused:
        run_eval_jobs(TargetRef(str(target_dir), "cpu", "float32"), variants[:4], QUESTIONS, tmp_path / "two",
                      replayed, jobs=2, progress=False)
    assert refused.value.key == "acceptance" and not list((tmp_path / "two" / "shards").glob("*"))
    assert _strip(read_records(tmp_path / "two" / "records.jsonl")) == _strip(read_records(tmp_path / "one" /
                                                                                          "records.jsonl"))
    with pytest.raises(SystemExit) as stop:  # refused when parsed, before any worker starts
        main(["eval", "--target", str(target_dir), "--variant", "base=baseline", "--bench", "gsm8k",
              "--out", str(tmp_path / "x"), "--jobs", "0"])
    assert stop.value.code == 2
    assert "argument --jobs: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_auto_trees_without_a_head_are_refused_before_any_worker(tmp_path, setup):
    """--jobs N --tree auto with only plain / lookup variants: one ValueError in the parent (it used
    to fail inside every worker with a traceback), and nothing is written."""
    from taps.eval.runner import run_eval_jobs

    target_dir, _, _ = setup
    auto = EvalSettings(temperatures=(0.0,), max_new_tokens=4, warmup=False,
                        speculation=SpeculationConfig(TreeConfig(12, 3, 3), mode="auto"))
    with pytest.raises(ValueError, match="--tree auto sizes the trees of EAGLE heads and none is given"):
        run_eval_jobs(TargetRef(str(target_dir), "cpu", "float32"),
                      [parse_variant("base=baseline"), parse_variant("look=lookup")], QUESTIONS, tmp_path / "auto",
                      auto, jobs=2, progress=False)
    assert not (tmp_path / "auto").exists()


def _close(a, b) -> bool:  # a record's values, floats to rounding (a replayed head reads one prefill's features)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4 * max(1.0, abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def test_replayed_acceptance_equals_verified_in_float32(tmp_path, setup):
    """--acceptance replay: every drafted variant's turns read along the target's own greedy answer
    (core/replay.py) give the records a verified run writes (accepted, emitted, tree sizes,
    routing, traces, outputs, reused prefixes) but the timings; the baseline decodes for real; a
    replayed run is pinned in run.json and never mixed with a verified one; T > 0 is refused."""
    target_dir, variants, specs = setup
    head = specs[1].split("=", 1)[1]
    variants = variants + [parse_variant("look=lookup"), parse_variant(f"both=merge-budget:{head},lookup")]
    greedy = EvalSettings(temperatures=(0.0,), max_new_tokens=32, speculation=SETTINGS.speculation, warmup=False)
    replayed = EvalSettings(temperatures=(0.0,), max_new_tokens=32, speculation=SETTINGS.speculation, warmup=False,
                            acceptance="replay")
    target = Target.load(target_dir, dtype="float32")
    run_eval(target, str(target_dir), variants, QUESTIONS, tmp_path / "verified", greedy, progress=False)
    run_eval(target, str(target_dir), variants, QUESTIONS, tmp_path / "replayed", replayed, progress=False)
    verified = {record_key(r): r for r in read_records(tmp_path / "verified" / "records.jsonl")}
    again = {record_key(r): r for r in read_records(tmp_path / "replayed" / "records.jsonl")}
    assert verified.keys() == again.keys() and len(again) == 4 * len(variants)
    for key, r in verified.items():
        differ = [k for k in r if k not in TIMING and not _close(again[key][k], r[k])]
        assert not differ, (key, differ)
        if r["variant"] != "base":
            assert again[key]["target_s"] == 0.0
    assert any(sum(r["accepted"]) for r in again.values())  # drafts were accepted, not only rejected
    assert json.loads((tmp_path / "replayed" / "run.json").read_text())["acceptance"] == "replay"
    with pytest.raises(ResultsMismatchError, match="acceptance"):
        run_eval(target, str(target_dir), variants[:1], QUESTIONS[:1], tmp_path / "verified", replayed, progress=False)
    with pytest.raises(ValueError, match="temperatures must be 0"):
        EvalSettings(temperatures=(0.0, 1.0), acceptance="replay")
    with pytest.raises(ValueError, match="acceptance must be one of"):
        EvalSettings(acceptance="guess")
