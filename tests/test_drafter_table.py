"""The acceptance table of a family of drafters (`taps drafter table`): cells, reuse of rows
measured with the same weights and settings, and parallel workers (on a random tiny target)."""

import json
from dataclasses import replace

import pytest

from taps.drafter.checkpoint import DrafterInfo, init_head, save_head
from taps.core.target import Target
from taps.eval.drafter_table import TableSettings, acceptance_table, to_markdown


@pytest.fixture
def bench_dir(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i}+{i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"})
        + "\n" for i in range(3)))
    (tmp_path / "mt_bench" / "question.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "writing", "turns": [f"Write about {w}.", "More."]}) + "\n"
        for i, w in enumerate(["the sea", "the wind", "stars"])))
    return tmp_path


def test_table_cells(tmp_path, target_dir, bench_dir):
    target = Target.load(target_dir, device="cpu", dtype="float32")
    heads = {}
    for seed in (0, 1):
        heads[f"eagle2-s{seed}"] = save_head(init_head(target.model.config, seed=seed), tmp_path / f"h{seed}",
                                             DrafterInfo(tokenizer_fingerprint=target.fingerprint()))
    table = acceptance_table(target, heads, TableSettings(bench_dir, n=2, temperatures=(0.0, 1.0), max_new_tokens=6))
    for name in heads:
        for bench in ("gsm8k", "mt_bench"):
            for temp in ("0.0", "1.0"):
                cell = table[name][bench][temp]
                assert cell["tau"] == cell["new_tokens"] / cell["verifier_calls"] >= 1.0
    md = to_markdown(table)
    assert md.splitlines()[0] == "| drafter | gsm8k T=0.0 | mt_bench T=0.0 | gsm8k T=1.0 | mt_bench T=1.0 |"
    assert len(md.splitlines()) == 4


def test_table_grows_and_remeasures_only_changed_drafters(tmp_path, target_dir, bench_dir):
    from taps.eval.drafter_table import update_table

    target = Target.load(target_dir, device="cpu", dtype="float32")
    info = DrafterInfo(tokenizer_fingerprint=target.fingerprint())
    heads = {"a": save_head(init_head(target.model.config, seed=0), tmp_path / "a", info)}
    out, logs = tmp_path / "table", []
    settings = TableSettings(bench_dir, n=1, temperatures=(0.0,), max_new_tokens=4)
    kw = dict(log=logs.append, progress=False)
    first = update_table(target, heads, out, settings, **kw)
    heads["b"] = save_head(init_head(target.model.config, seed=1), tmp_path / "b", info)
    logs.clear()
    second = update_table(target, heads, out, settings, **kw)
    assert second["a"] == first["a"] and set(second) == {"a", "b"}
    assert [x.split(":")[0] for x in logs if "measured" in x] == ["b"]
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["drafters"] == second and set(saved["weights"]) == {"a", "b"}
    save_head(init_head(target.model.config, seed=2), tmp_path / "a", info)  # retrained: new weights
    logs.clear()
    update_table(target, heads, out, settings, **kw)
    assert [x.split(":")[0] for x in logs if "measured" in x] == ["a"]
    logs.clear()
    update_table(target, heads, out, replace(settings, max_new_tokens=5), **kw)  # other settings: all again
    assert sorted(x.split(":")[0] for x in logs if "measured" in x) == ["a", "b"]
    out.with_suffix(".json").write_text("{torn")
    with pytest.raises(ValueError, match="table.json: not valid JSON"):
        update_table(target, heads, out, settings, **kw)


def test_table_in_parallel_workers_matches_one_process(tmp_path, target_dir, bench_dir):
    from taps.eval.drafter_table import update_table

    target = Target.load(target_dir, device="cpu", dtype="float32")
    info = DrafterInfo(tokenizer_fingerprint=target.fingerprint())
    heads = {name: save_head(init_head(target.model.config, seed=seed), tmp_path / name, info)
             for seed, name in enumerate(["a", "b", "c"])}
    settings = TableSettings(bench_dir, n=2, temperatures=(0.0, 1.0), max_new_tokens=6)
    kw = dict(log=lambda msg: None, progress=False)
    one = update_table(target, heads, tmp_path / "one", settings, **kw)
    logs = []
    two = update_table(target, heads, tmp_path / "two", settings, **{**kw, "log": logs.append}, jobs=2)
    assert two == one and sorted(x.split(":")[0] for x in logs if "measured" in x) == ["a", "b", "c"]
    assert json.loads((tmp_path / "two.json").read_text())["drafters"] == one
    # a drafter that cannot be measured is named; the others' rows are saved, and a rerun measures only it
    (tmp_path / "c" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match=r"not measured: c \("):
        update_table(target, heads, tmp_path / "three", settings, **kw, jobs=2)
    assert set(json.loads((tmp_path / "three.json").read_text())["drafters"]) == {"a", "b"}
