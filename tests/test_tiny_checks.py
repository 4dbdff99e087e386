"""The embedded default's self-checks: GSM8K format detection, repetition measure, and the
acceptance table of drafters (on a random tiny target, for the plumbing)."""

import json

import pytest

from taps.drafter.checkpoint import DrafterInfo, init_head, save_head
from taps.target import Target
from taps.eval.drafter_table import acceptance_table, to_markdown
from taps.tiny.target_check import (chat_measures, check_target, distinct_4gram_share, final_number,
                                    follows_gsm8k_format, mt_bench_temperature, question_word_recall)


def test_gsm8k_format():
    good = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72.\n#### 72"
    assert follows_gsm8k_format(good) and final_number(good) == "72"
    assert not follows_gsm8k_format("She sold 72 clips.\n#### 72")  # no calculator annotation
    assert not follows_gsm8k_format("48/2 = <<48/2=24>>24 and then more")  # no final line
    assert final_number("x <<1+1=2>>2\n#### 1,234") == "1234"


def test_distinct_4grams():
    assert distinct_4gram_share("a b c d e f") == 1.0
    assert distinct_4gram_share("go go go go go go go go") == pytest.approx(1 / 5)
    assert distinct_4gram_share("too short") == 0.0


def test_question_word_recall_ignores_instruction_words():
    question = "Write a travel blog post about Hawaii, please."
    assert question_word_recall(question, "Hawaii has beaches; my travel there was great.") == pytest.approx(2 / 4)
    assert question_word_recall(question, "Sure, here is what you asked to write.") == 0.0  # echoes no topic word
    assert question_word_recall("Please write.", "Anything at all.") == 0.0  # no content word to look for


def test_chat_measures_tell_on_topic_answers_from_chance():
    questions = ["Describe Hawaii beaches.", "Explain volcano eruptions.", "Praise chocolate cake."]
    on_topic = ["Hawaii beaches are warm.", "A volcano eruption is loud.", "Chocolate cake is sweet."]
    m = chat_measures(questions, on_topic, [5, 5, 5])
    assert m.question_word_recall > m.question_word_recall_chance == 0.0 and m.on_topic_share == 1.0
    shifted = on_topic[1:] + on_topic[:1]  # every answer is about another question
    m = chat_measures(questions, shifted, [5, 5, 5])
    assert m.question_word_recall == 0.0 < m.question_word_recall_chance and m.on_topic_share == 0.0
    generic = ["Sure, here is some text."] * 3
    assert chat_measures(questions, generic, [5, 5, 5]).on_topic_share == 0.0  # ties are not on topic


def test_mt_bench_temperatures_follow_fastchat_and_name_unknown_categories():
    assert mt_bench_temperature({"category": "writing"}) == 0.7
    assert mt_bench_temperature({"category": "math"}) == 0.0
    with pytest.raises(ValueError, match="question 7: category 'poetry'"):
        mt_bench_temperature({"question_id": 7, "category": "poetry"})


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i}+{i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"})
        + "\n" for i in range(3)))
    (tmp_path / "mt_bench" / "question.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "writing", "turns": [f"Write about {w}.", "More."]}) + "\n"
        for i, w in enumerate(["the sea", "the wind", "stars"])))
    return tmp_path


def test_check_target_and_table_run(tmp_path, target_dir, data_dir):
    target = Target.load(target_dir, device="cpu", dtype="float32")
    samples = []
    check = check_target(target, data_dir, n=2, max_new_tokens=6, samples=samples)
    assert check.gsm8k_questions == 2 and check.mt_bench_questions == 2 and len(samples) == 2 + 2 * 2
    assert [s["decoding"] for s in samples if s["bench"] == "mt_bench"] == ["greedy", "greedy", "T=0.7", "T=0.7"]
    for m in (check.mt_bench_greedy, check.mt_bench_sampled):
        assert 0.0 <= m.on_topic_share <= 1.0 and m.mean_answer_tokens <= 6
    assert 0.0 <= check.gsm8k_format_share <= 1.0 and check.mean_answer_tokens_gsm8k <= 6
    heads = {}
    for seed in (0, 1):
        heads[f"eagle2-s{seed}"] = save_head(init_head(target.model.config, seed=seed), tmp_path / f"h{seed}",
                                             DrafterInfo(tokenizer_fingerprint=target.fingerprint()))
    table = acceptance_table(target, heads, data_dir, n=2, temperatures=(0.0, 1.0), max_new_tokens=6)
    for name in heads:
        for bench in ("gsm8k", "mt_bench"):
            for temp in ("0.0", "1.0"):
                cell = table[name][bench][temp]
                assert cell["tau"] == cell["new_tokens"] / cell["verifier_calls"] >= 1.0
    md = to_markdown(table)
    assert md.splitlines()[0] == "| drafter | gsm8k T=0.0 | mt_bench T=0.0 | gsm8k T=1.0 | mt_bench T=1.0 |"
    assert len(md.splitlines()) == 4


def test_table_grows_and_remeasures_only_changed_drafters(tmp_path, target_dir, data_dir):
    from taps.eval.drafter_table import update_table

    target = Target.load(target_dir, device="cpu", dtype="float32")
    info = DrafterInfo(tokenizer_fingerprint=target.fingerprint())
    heads = {"a": save_head(init_head(target.model.config, seed=0), tmp_path / "a", info)}
    out, logs = tmp_path / "table", []
    kw = dict(n=1, temperatures=(0.0,), max_new_tokens=4, log=logs.append, progress=False)
    first = update_table(target, heads, data_dir, out, **kw)
    heads["b"] = save_head(init_head(target.model.config, seed=1), tmp_path / "b", info)
    logs.clear()
    second = update_table(target, heads, data_dir, out, **kw)
    assert second["a"] == first["a"] and set(second) == {"a", "b"}
    assert [x.split(":")[0] for x in logs if "measured" in x] == ["b"]
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["drafters"] == second and set(saved["weights"]) == {"a", "b"}
    save_head(init_head(target.model.config, seed=2), tmp_path / "a", info)  # retrained: new weights
    logs.clear()
    update_table(target, heads, data_dir, out, **kw)
    assert [x.split(":")[0] for x in logs if "measured" in x] == ["a"]
    logs.clear()
    update_table(target, heads, data_dir, out, **{**kw, "max_new_tokens": 5})  # other settings: all again
    assert sorted(x.split(":")[0] for x in logs if "measured" in x) == ["a", "b"]
    out.with_suffix(".json").write_text("{torn")
    with pytest.raises(ValueError, match="table.json: not valid JSON"):
        update_table(target, heads, data_dir, out, **kw)


def test_table_in_parallel_workers_matches_one_process(tmp_path, target_dir, data_dir):
    from taps.eval.drafter_table import update_table

    target = Target.load(target_dir, device="cpu", dtype="float32")
    info = DrafterInfo(tokenizer_fingerprint=target.fingerprint())
    heads = {name: save_head(init_head(target.model.config, seed=seed), tmp_path / name, info)
             for seed, name in enumerate(["a", "b", "c"])}
    kw = dict(n=2, temperatures=(0.0, 1.0), max_new_tokens=6, log=lambda msg: None, progress=False)
    one = update_table(target, heads, data_dir, tmp_path / "one", **kw)
    logs = []
    two = update_table(target, heads, data_dir, tmp_path / "two", **{**kw, "log": logs.append}, jobs=2,
                       target_dir=target_dir)
    assert two == one and sorted(x.split(":")[0] for x in logs if "measured" in x) == ["a", "b", "c"]
    assert json.loads((tmp_path / "two.json").read_text())["drafters"] == one
    # a drafter that cannot be measured is named; the others' rows are saved, and a rerun measures only it
    (tmp_path / "c" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match=r"not measured: c \("):
        update_table(target, heads, data_dir, tmp_path / "three", **kw, jobs=2, target_dir=target_dir)
    assert set(json.loads((tmp_path / "three.json").read_text())["drafters"]) == {"a", "b"}
