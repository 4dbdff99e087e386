"""Mixtures: spec parsing, reproducible draws, over-asking, atomic writes, the `taps data mix` command."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from taps.cli import data as commands
from taps.data.mix import mix_sources, parse_count
from taps.core.jsonl import write_jsonl
from taps.data.sources import SourceSpecError, read_messages


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """A 20-record GSM8K file in a data directory and a 10-record chat file (3 of them not English)."""
    (tmp_path / "gsm8k").mkdir()
    gsm = write_rows(tmp_path / "gsm8k" / "train.jsonl",
                     [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(20)])
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about the number {i}."},
                                           {"role": "assistant", "content": f"It is {i}."}]} for i in range(7)]
    chats += [{"id": f"x{i}", "messages": [{"role": "user", "content": f"数字{i}是什么？"},
                                            {"role": "assistant", "content": "一个数字。"}]} for i in range(3)]
    return {"dir": tmp_path, "gsm8k": gsm, "chat": write_rows(tmp_path / "chat.jsonl", chats)}


@pytest.mark.parametrize("spec,expected", [
    ("sharegpt:35000", ("sharegpt", 35000)),
    ("sharegpt", ("sharegpt", None)),
    ("gsm8k:7000", ("gsm8k", 7000)),
    ("gsm8k:test:100", ("gsm8k:test", 100)),
    ("gsm8k:/path/train.jsonl:35000", ("gsm8k:/path/train.jsonl", 35000)),
    ("messages:/data/a:b.jsonl", ("messages:/data/a:b.jsonl", None)),
    ("messages:/data/run:2:5", ("messages:/data/run:2", 5)),
    ("hf:TIGER-Lab/MathInstruct:train:35000", ("hf:TIGER-Lab/MathInstruct:train", 35000)),
    ("7000", ("7000", None)),
])
def test_parse_count(spec, expected):
    assert parse_count(spec) == expected


def test_parse_count_rejects_zero():
    with pytest.raises(SourceSpecError, match="must be positive"):
        parse_count("gsm8k:0")


def test_mix_counts_tags_and_no_repeats(files):
    records = mix_sources([f"gsm8k:{files['gsm8k']}:12", f"messages:{files['chat']}"], seed=0)
    assert Counter(r["source"] for r in records) == {"gsm8k": 12, "messages": 10}
    assert len({r["id"] for r in records}) == 22  # without replacement
    assert {r["source"] for r in records[:11]} == {"gsm8k", "messages"}  # the union is shuffled, not concatenated


def test_mix_is_deterministic_for_a_seed(files):
    specs = ["gsm8k:8", f"messages:{files['chat']}:5"]
    ids = lambda seed: [r["id"] for r in mix_sources(specs, seed=seed, data_dir=files["dir"])]
    assert ids(1) == ids(1)
    assert ids(1) != ids(2)
    assert sorted(ids(1)) != sorted(ids(2))  # different draws, not only a different order


def test_smaller_count_is_a_prefix_of_the_larger_draw(files):
    small = {r["id"] for r in mix_sources(["gsm8k:5"], seed=3, data_dir=files["dir"])}
    large = {r["id"] for r in mix_sources(["gsm8k:15"], seed=3, data_dir=files["dir"])}
    assert small < large


def test_a_source_draw_does_not_depend_on_the_other_sources(files):
    alone = {r["id"] for r in mix_sources(["gsm8k:6"], seed=4, data_dir=files["dir"])}
    mixed = mix_sources([f"messages:{files['chat']}", "gsm8k:6"], seed=4, data_dir=files["dir"])
    assert alone == {r["id"] for r in mixed if r["source"] == "gsm8k"}


def test_asking_for_more_than_exists_names_source_and_counts(files):
    with pytest.raises(SourceSpecError, match=r"gsm8k: asked for 21 records, only 20 available$"):
        mix_sources(["gsm8k:21"], seed=0, data_dir=files["dir"])


def test_english_filter_before_drawing(files):
    reports = []
    records = mix_sources([f"messages:{files['chat']}"], seed=0, english=True, on_report=reports.append)
    assert sorted(r["id"] for r in records) == [f"c{i}" for i in range(7)]
    assert reports[0].dropped == {"not_english": 3} and reports[0].kept == 7
    with pytest.raises(SourceSpecError, match="asked for 8 records, only 7 available after the English filter"):
        mix_sources([f"messages:{files['chat']}:8"], seed=0, english=True)


def test_write_jsonl_round_trips_through_the_messages_reader(files, tmp_path):
    records = mix_sources(["gsm8k:4"], seed=0, data_dir=files["dir"])
    out = write_jsonl(records, tmp_path / "out" / "mix.jsonl")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == records
    back, report = read_messages(out)
    assert [r["conversations"] for r in back] == [r["conversations"] for r in records]
    assert [r["id"] for r in back] == [r["id"] for r in records] and report.kept == 4


def test_write_jsonl_keeps_unicode_line_separators_inside_records(tmp_path):
    records = [{"id": "u", "source": "s", "conversations": [
        {"role": "user", "content": "a\u2028b\x85c\r\nd"}, {"role": "assistant", "content": "é ✓"}]}]
    back, _ = read_messages(write_jsonl(records, tmp_path / "u.jsonl"))
    assert back[0]["conversations"] == records[0]["conversations"]


def test_write_jsonl_is_atomic(tmp_path):
    out = tmp_path / "mix.jsonl"
    out.write_text("previous\n", encoding="utf-8")

    def failing():
        yield {"id": "1", "source": "s", "conversations": []}
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError, match="interrupted"):
        write_jsonl(failing(), out)
    assert out.read_text(encoding="utf-8") == "previous\n"  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["mix.jsonl"]  # and no temporary file is left
    write_jsonl([{"id": "2", "source": "s", "conversations": []}], out)
    assert json.loads(out.read_text(encoding="utf-8"))["id"] == "2"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="taps")
    commands.register(p.add_subparsers(dest="command", required=True))
    return p


def test_data_mix_command(files, tmp_path, capsys):
    out = tmp_path / "mix.jsonl"
    args = parser().parse_args(["data", "mix", "--source", "gsm8k:5", "--source", f"messages:{files['chat']}",
                                "--seed", "7", "--out", str(out), "--data-dir", str(files["dir"]), "--english"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("gsm8k (") and "kept 20 of 20" in printed[0]
    assert printed[1].startswith(f"messages:{files['chat']} (") and "3 not_english" in printed[1]
    assert printed[2] == f"wrote 12 records to {out}"
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert records == mix_sources(["gsm8k:5", f"messages:{files['chat']}"], seed=7, data_dir=files["dir"], english=True)


def test_data_mix_command_requires_a_source(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["data", "mix", "--out", "x.jsonl"])
    assert "--source" in capsys.readouterr().err


def test_max_prompt_chars_caps_after_the_draw(files):
    """The cap drops drawn records with a longer first user turn and counts them; the draw does not
    move, so the capped mixture is the uncapped one minus exactly those records, in the same order."""
    questions = [f"What is {i} + {i}?" for i in range(20)]  # 15 characters for i < 10, 17 from 10 on
    reports = []
    whole = mix_sources(["gsm8k:12"], seed=4, data_dir=files["dir"])
    capped = mix_sources(["gsm8k:12"], seed=4, data_dir=files["dir"], max_prompt_chars=15, on_report=reports.append)
    first = lambda r: next(t["content"] for t in r["conversations"] if t["role"] == "user")
    assert [r["id"] for r in capped] == [r["id"] for r in whole if len(first(r)) <= 15]
    assert 0 < len(capped) < len(whole) and all(first(r) in questions[:10] for r in capped)
    (report,) = reports
    assert report.dropped == {"drawn with a first prompt over 15 chars": len(whole) - len(capped)}
    with pytest.raises(SourceSpecError, match="max-prompt-chars"):
        mix_sources(["gsm8k:12"], seed=4, data_dir=files["dir"], max_prompt_chars=0)
