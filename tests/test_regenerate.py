"""Regeneration: assistant turns replaced by the target's own greedy answers, turn by turn,
resumable without duplicates, identical with a drafter (lossless)."""

import json

import pytest

from taps.core.config import DecodeConfig
from taps.data.regenerate import RegenerateSettings, regenerate
from taps.core.decode import ChatSession
from taps.drafter.checkpoint import init_head
from taps.propose.single import SingleProposer
from test_features import write_records


def two_turn(path):
    rows = [{"id": "a", "source": "chat", "conversations": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "old second"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_turns_are_the_targets_own(tmp_path, target):
    data = two_turn(tmp_path / "d.jsonl")
    settings = RegenerateSettings(max_new_tokens=8)
    assert regenerate(target, data, tmp_path / "out.jsonl", settings, progress=None) == 1
    (rec,) = lines(tmp_path / "out.jsonl")
    assert [t["role"] for t in rec["conversations"]] == ["system", "user", "assistant", "user", "assistant"]
    assert rec["conversations"][1]["content"] == "Hi there" and rec["conversations"][3]["content"] == "And then?"
    # the same answers as a chat session with the target
    chat = ChatSession(target, None, DecodeConfig(max_new_tokens=8, stop_token_ids=target.stop_token_ids()),
                       system="Be brief.")
    assert rec["conversations"][2]["content"] == chat.send("Hi there")[0]
    assert rec["conversations"][4]["content"] == chat.send("And then?")[0]
    assert rec["regenerated"]["original_turns"] == 5 and len(rec["regenerated"]["stop_reasons"]) == 2


def test_resume_skips_done_and_repairs_torn_line(tmp_path, target):
    data = write_records(tmp_path / "d.jsonl", n=6)
    out = tmp_path / "out.jsonl"
    settings = RegenerateSettings(max_new_tokens=4)
    assert regenerate(target, data, out, settings, progress=None) == 6
    whole = out.read_text()
    kept = "".join(whole.splitlines(keepends=True)[:3])
    out.write_text(kept + '{"id": "r3", "conv')  # crashed while writing the 4th record
    assert regenerate(target, data, out, settings, progress=None) == 3
    assert out.read_text() == whole  # same records, no duplicates, torn line gone
    assert regenerate(target, data, out, settings, progress=None) == 0


def test_drafter_gives_identical_data(tmp_path, target):
    data = write_records(tmp_path / "d.jsonl", n=3)
    head = init_head(target.model.config, seed=1).bind(target.embed_tokens, target.lm_head)
    settings = RegenerateSettings(max_new_tokens=10)
    regenerate(target, data, tmp_path / "plain.jsonl", settings, progress=None)
    regenerate(target, data, tmp_path / "spec.jsonl", settings, proposer=SingleProposer(head), progress=None)
    assert lines(tmp_path / "plain.jsonl") == lines(tmp_path / "spec.jsonl")


def test_errors(tmp_path, target):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "x", "conversations": []}\n{"id": "x", "conversations": []}\n')
    with pytest.raises(ValueError, match="'x' appears more than once"):
        regenerate(target, dup, tmp_path / "o.jsonl", progress=None)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"no": "id"}\n')
    data = write_records(tmp_path / "d.jsonl", n=2)
    with pytest.raises(ValueError, match="line 1 is not a regenerated record"):
        regenerate(target, data, foreign, progress=None)


def test_batched_equals_one_at_a_time_in_float32(tmp_path, target):
    """Left-padded batches through transformers' generate give the target's own greedy answers,
    turn by turn (exact in float32), and keep only the first max_turns user turns."""
    data = write_records(tmp_path / "d.jsonl", n=5)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    rows[1]["conversations"][1]["content"] = "a much longer question than the others, so the batch is padded"
    rows[2]["conversations"] += [{"role": "user", "content": "and a second turn"},
                                 {"role": "assistant", "content": "old"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one, batched = tmp_path / "one.jsonl", tmp_path / "batched.jsonl"
    regenerate(target, data, one, RegenerateSettings(max_new_tokens=6), progress=None)
    assert regenerate(target, data, batched, RegenerateSettings(max_new_tokens=6, batch_size=3), progress=None) == 5
    a, b = lines(one), sorted(lines(batched), key=lambda r: int(r["id"][1:]))  # batches sort by prompt length
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [r["conversations"] for r in a] == [r["conversations"] for r in b]
    assert [r["regenerated"]["stop_reasons"] for r in a] == [r["regenerated"]["stop_reasons"] for r in b]
    assert len(b[2]["regenerated"]["stop_reasons"]) == 2
    first = tmp_path / "first.jsonl"
    regenerate(target, data, first, RegenerateSettings(max_new_tokens=6, batch_size=4, max_turns=1), progress=None)
    assert [t["role"] for t in lines(first)[2]["conversations"]].count("user") == 1


def test_batched_refuses_a_drafter_and_bad_sizes(tmp_path, target):
    data = write_records(tmp_path / "d.jsonl", n=2)
    head = SingleProposer(init_head(target.config, seed=0).bind(target.embed_tokens, target.lm_head))
    with pytest.raises(ValueError, match="batch_size 1"):
        regenerate(target, data, tmp_path / "o.jsonl", RegenerateSettings(batch_size=2), proposer=head, progress=None)
    with pytest.raises(ValueError, match="batch_size"):
        RegenerateSettings(batch_size=0)
    with pytest.raises(ValueError, match="max_turns"):
        RegenerateSettings(max_turns=0)


def test_long_first_prompts_are_skipped_and_counted(tmp_path, target, capsys):
    import sys

    data = write_records(tmp_path / "d.jsonl", n=3)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    rows[1]["conversations"][0]["content"] = "word " * 200
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.jsonl"
    settings = RegenerateSettings(max_new_tokens=3, batch_size=2, max_prompt_tokens=100)
    assert regenerate(target, data, out, settings, progress=sys.stderr) == 2
    assert sorted(r["id"] for r in lines(out)) == ["r0", "r2"]
    assert "skipping 1 record(s)" in capsys.readouterr().err


def test_limit_answers_the_first_n_in_answer_order_and_a_rerun_continues_it(tmp_path, target):
    """--limit N writes the first N records in the order they are answered (shortest first when
    batched): cut after one batch, a rerun with the same N writes exactly the rest of those N, the
    same records and answers as one uninterrupted run, and nothing past N."""
    data = write_records(tmp_path / "d.jsonl", n=7)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    for k, row in enumerate(rows):  # prompt lengths in reverse file order: answer order != file order
        row["conversations"][0]["content"] = "word " * (20 - 2 * k)
        row["conversations"][1]["content"] = "old"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    settings = RegenerateSettings(max_new_tokens=3, batch_size=2, limit=5)
    assert regenerate(target, data, whole, settings, progress=None) == 5
    assert [r["id"] for r in lines(whole)] == ["r6", "r5", "r4", "r3", "r2"]  # the five shortest prompts
    assert regenerate(target, data, cut, RegenerateSettings(max_new_tokens=3, batch_size=2, limit=2),
                      progress=None) == 2
    import io

    log = io.StringIO()
    assert regenerate(target, data, cut, settings, progress=log) == 3
    assert "regenerate: 5/5 records" in log.getvalue()  # the progress counts what --limit keeps, not the file
    assert lines(cut) == lines(whole)
    assert regenerate(target, data, cut, settings, progress=None) == 0
    with pytest.raises(ValueError, match="limit"):
        RegenerateSettings(limit=0)
