"""Benchmarks: the real counts, every malformed-input error, filtering, the path forms, the env var, the hub map."""

from __future__ import annotations

import json
import os
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from taps.eval.benchmarks import (BENCHMARKS, BenchmarkFormatError, Question, load_benchmark, parse_bench_list,
                                  read_questions)

SHARED_DATA = Path(os.environ.get("TAPS_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")
needs_shared = pytest.mark.skipif(not (SHARED_DATA / "mt_bench" / "question.jsonl").is_file(),
                                  reason=f"no shared data directory at {SHARED_DATA}")


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def fc(qid, category="writing", turns=("hi", "more"), **extra) -> dict:
    return {"question_id": qid, "category": category, "turns": list(turns), **extra}


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A tiny data directory laid out as docs/spec.md §8 says."""
    root = tmp_path / "data"
    write_jsonl(root / "mt_bench" / "question.jsonl",
                [fc(81), fc(82, "math", reference=["4", "5"]), fc(83), fc(84, "math")])
    write_jsonl(root / "gsm8k" / "test.jsonl",
                [{"question": "q0", "answer": "a\n#### 2,125"}, "", {"question": "q1", "answer": "b #### -3"}])
    write_jsonl(root / "math500" / "question.jsonl", [fc(0, "math", ["p"], reference=["s"])])
    write_jsonl(root / "svamp" / "question.jsonl", [fc(0, "math", ["b q"], reference=["27"])])
    return root


# ---------------------------------------------------------------- the shared data directory

@needs_shared
def test_shared_counts():
    mt = load_benchmark("mt_bench", SHARED_DATA)
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    assert Counter(q.category for q in mt) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                                "extraction", "stem", "humanities")}
    gsm = load_benchmark("gsm8k", SHARED_DATA)
    assert len(gsm) == 1319 and gsm[0].question_id == "0" and gsm[0].reference == ("18",)
    assert all(q.reference[0].lstrip("-").replace(".", "", 1).isdigit() for q in gsm)
    assert len(load_benchmark("math500", SHARED_DATA)) == 500
    svamp = load_benchmark("svamp", SHARED_DATA)
    assert len(svamp) == 300 and svamp[0].reference == ("27",)
    assert all(len(q.turns) == 1 for q in gsm + svamp)


# ---------------------------------------------------------------- formats, filtering, naming

def test_named_benchmarks_from_data_dir(data_dir):
    mt = load_benchmark("mt_bench", data_dir)
    assert mt[1] == Question("mt_bench", "82", "math", ("hi", "more"), ("4", "5"))
    assert mt[0].reference == ()
    gsm = load_benchmark("gsm8k", data_dir)  # blank line skipped; ids are the index among questions
    assert gsm == [Question("gsm8k", "0", "math", ("q0",), ("2125",)), Question("gsm8k", "1", "math", ("q1",), ("-3",))]
    assert load_benchmark("math500", data_dir)[0].bench == "math500"


def test_categories_then_limit_in_file_order(data_dir):
    assert [q.question_id for q in load_benchmark("mt_bench", data_dir, categories=["math"])] == ["82", "84"]
    assert [q.question_id for q in load_benchmark("mt_bench", data_dir, limit=1, categories=["math"])] == ["82"]
    assert [q.question_id for q in load_benchmark("mt_bench", data_dir, limit=3)] == ["81", "82", "83"]
    assert load_benchmark("mt_bench", data_dir, limit=0) == []
    assert len(load_benchmark("mt_bench", data_dir, limit=99)) == 4
    with pytest.raises(ValueError, match="mt_bench: no category 'maths'; available: math, writing"):
        load_benchmark("mt_bench", data_dir, categories=["math", "maths"])
    with pytest.raises(ValueError, match="limit must be >= 0"):
        load_benchmark("mt_bench", data_dir, limit=-1)


def test_path_and_name_equals_path(tmp_path):
    path = write_jsonl(tmp_path / "my_bench" / "question.jsonl", [fc("a"), fc("b")])
    assert {q.bench for q in load_benchmark(str(path))} == {"my_bench"}
    assert [q.bench for q in load_benchmark(f"custom={path}", limit=1)] == ["custom"]
    gsm = write_jsonl(tmp_path / "other" / "g.jsonl", [{"question": "q", "answer": "#### 7"}])
    assert load_benchmark(str(gsm))[0].reference == ("7",)  # GSM8K format told by its fields


def test_env_var_names_the_data_dir(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_DATA_DIR", str(data_dir))
    assert len(load_benchmark("mt_bench")) == 4
    other = tmp_path / "other"
    write_jsonl(other / "mt_bench" / "question.jsonl", [fc(1)])
    assert len(load_benchmark("mt_bench", other)) == 1  # an explicit data_dir wins over the env var


def test_missing_file_offline_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="no file .*svamp/question.jsonl.*data directory: .*TAPS_DATA_DIR"):
        load_benchmark("svamp", tmp_path)
    with pytest.raises(FileNotFoundError, match="no data directory given.*--data-dir.*TAPS_DATA_DIR"):
        load_benchmark("svamp")
    with pytest.raises(FileNotFoundError, match="unknown benchmark 'svmap'.*mt_bench, gsm8k"):
        load_benchmark("svmap")


def test_hub_fallback_maps_fields(tmp_path, monkeypatch):
    hub = {
        ("openai/gsm8k", "main", "test"): [{"question": "q", "answer": "w #### 1,000"}],
        ("HuggingFaceH4/MATH-500", None, "test"): [
            {"problem": "p", "solution": "s \\boxed{2}", "answer": "2", "subject": "Algebra",
             "unique_id": "test/a/1.json"}],
        ("HuggingFaceH4/mt_bench_prompts", None, "train"): [
            {"prompt": ["t1", "t2"], "category": "math", "prompt_id": 111, "reference": ["r1", "r2"]},
            {"prompt": ["u1", "u2"], "category": "writing", "prompt_id": 81, "reference": []}],
        ("ChilleD/SVAMP", None, "test"): [
            {"ID": "chal-1", "Body": "There are 41 birds.", "Question": "How many?", "Answer": 27.0}],
    }
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return hub[(name, config, split)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    assert load_benchmark("gsm8k", tmp_path) == [Question("gsm8k", "0", "math", ("q",), ("1000",))]
    assert load_benchmark("math500") == [Question("math500", "test/a/1.json", "math", ("p",), ("s \\boxed{2}",))]
    assert load_benchmark("mt_bench", categories=["writing"]) == [Question("mt_bench", "81", "writing", ("u1", "u2"))]
    assert load_benchmark("svamp") == [Question("svamp", "chal-1", "math", ("There are 41 birds. How many?",), ("27",))]
    assert len(calls) == 4

    hub[("ChilleD/SVAMP", None, "test")] = [{"ID": "x", "Body": "b"}]
    with pytest.raises(BenchmarkFormatError, match=r"ChilleD/SVAMP \(test\) row 0: missing field 'Answer'"):
        load_benchmark("svamp")

    def offline(name, config=None, split=None):
        raise ConnectionError("cannot reach the hub")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(FileNotFoundError, match="HuggingFaceH4/MATH-500 could not be read .ConnectionError"):
        load_benchmark("math500")


# ---------------------------------------------------------------- malformed input

@pytest.mark.parametrize("rows, fmt, message", [
    ([fc(1), "{not json"], None, r"q.jsonl:2: invalid JSON"),
    ([fc(1), "[1, 2]"], None, r"q.jsonl:2: expected a JSON object"),
    ([{"question_id": 1, "category": "c"}], None, r"q.jsonl:1: missing 'turns'"),
    ([{"category": "c", "turns": ["t"]}], None, r"q.jsonl:1: missing 'question_id'"),
    ([fc(1), fc(2, turns=[])], None, r"q.jsonl:2: turns must be a non-empty list of strings"),
    ([fc(1, turns=["a", 3])], None, r"q.jsonl:1: turns must be a non-empty list of strings"),
    ([{"question_id": 1, "category": "c", "turns": "a"}], None, r"q.jsonl:1: turns must be a non-empty list"),
    ([fc(1, reference="27")], None, r"q.jsonl:1: reference must be a list of strings"),
    ([fc(True)], None, r"q.jsonl:1: question_id must be an integer or a string"),
    ([fc(1), "", fc(2), fc(1)], None, r"q.jsonl:4: duplicate question_id '1' \(first at .*q.jsonl:1\)"),
    ([{"question": "q", "answer": "#### 1"}, {"question": "q"}], None, r"q.jsonl:2: expected GSM8K fields"),
    ([{"answer": "#### 1"}], "gsm8k", r"q.jsonl:1: expected GSM8K fields 'question' and 'answer'"),
    ([{"question": "q", "answer": "no number"}], "gsm8k", r"q.jsonl:1: the answer has no '#### <number>'"),
    (["", "  "], None, r"q.jsonl: no questions"),
])
def test_malformed_input_names_file_and_line(tmp_path, rows, fmt, message):
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(BenchmarkFormatError, match=message):
        read_questions(path, "b", fmt)


def test_gsm8k_named_benchmark_checks_gsm8k_fields(data_dir):
    write_jsonl(data_dir / "gsm8k" / "test.jsonl", [{"question": "q", "answer": "#### 1"}, {"answer": "#### 2"}])
    with pytest.raises(BenchmarkFormatError, match=r"test.jsonl:2: expected GSM8K fields"):
        load_benchmark("gsm8k", data_dir)


# ---------------------------------------------------------------- bench lists

def test_parse_bench_list(tmp_path):
    assert parse_bench_list("mt_bench,gsm8k,math500,svamp") == list(BENCHMARKS)
    path = write_jsonl(tmp_path / "mine" / "question.jsonl", [fc(1)])
    assert parse_bench_list(f" gsm8k , {path},x={path},") == ["gsm8k", str(path), f"x={path}"]
    with pytest.raises(ValueError, match="unknown benchmark 'gsm8': neither a known name .mt_bench, gsm8k, math500"):
        parse_bench_list("mt_bench,gsm8")
    with pytest.raises(ValueError, match="unknown benchmark 'x=/no/such.jsonl'"):
        parse_bench_list("x=/no/such.jsonl")
    with pytest.raises(ValueError, match="no benchmarks"):
        parse_bench_list(" , ")
    with pytest.raises(ValueError, match="listed twice"):
        parse_bench_list("gsm8k,gsm8k")
