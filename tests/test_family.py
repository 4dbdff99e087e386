"""A family of drafters for one target (taps.train.family): data, optional regeneration by the
target, features and both backbones' training at a toy size, resumable, in parallel workers."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from taps.core.target import Target


def test_drafter_recipe_end_to_end(tmp_path, data_dir, target_dir):
    from taps.drafter.checkpoint import load_head, read_config
    from taps.train.family import DrafterRecipe, build_drafters

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=12, max_len=48, epochs=1, batch_size=4, warmup_steps=1)
    summary = build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    target = Target.load(target_dir, device="cpu", dtype="float32")
    assert set(summary["drafters"]) == {f"{b}-{d}" for b in ("eagle2", "hass")
                                         for d in ("chat", "math", "mixed-small", "mixed-large")}
    for name, info in summary["drafters"].items():
        head = load_head(tmp_path / "drafters" / name, target)
        _, meta = read_config(tmp_path / "drafters" / name)
        assert meta.backbone == name.split("-")[0] and meta.training_data == name.split("-", 1)[1]
        assert sorted(p.name for p in (tmp_path / "drafters" / name).iterdir()) == \
            ["config.json", "metrics.jsonl", "model.safetensors"]
    assert summary["drafters"]["eagle2-mixed-small"]["records"] == 12
    assert summary["drafters"]["eagle2-mixed-large"]["records"] == 24
    # a rerun finds everything done
    again = build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    assert again["drafters"] == summary["drafters"]
    # a build spanning sessions may change how heads are trained, not what: other settings are refused
    with pytest.raises(ValueError, match="drafters.json: its heads were trained with epochs = 1, this run has 2"):
        build_drafters(replace(recipe, epochs=2), target_dir, tmp_path / "drafters", tmp_path / "work")
    build_drafters(replace(recipe, compile_loss=True, checkpoint_steps=7), target_dir, tmp_path / "drafters",
                   tmp_path / "work")


def test_heads_taken_longest_first():
    from taps.train.family import EAGLE3_COST, head_costs, longest_first

    costs = head_costs({"chat": 900, "math": 300, "xl-chat": 2000, "xl-math": 1000})
    assert costs[("hass", "mixed-large")] == 3 * 1200 and costs[("eagle2", "mixed-small")] == 600
    assert costs[("eagle3", "chat")] == EAGLE3_COST * 900 and costs[("eagle2", "mixed-xl")] == 3000
    order = longest_first(list(costs), costs)
    assert sorted(order) == sorted(costs)
    assert [costs[h] for h in order] == sorted(costs.values(), reverse=True)
    assert order[0] == ("eagle3", "mixed-xl") and order[-1] == ("eagle2", "math")


def test_drafters_in_parallel_workers_match_one_process(tmp_path, data_dir, target_dir):
    from taps.train.family import DrafterRecipe, build_drafters

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=12, max_len=48, epochs=1, batch_size=4, warmup_steps=1, threads=1,
                           backbones=("eagle2",), domains=("chat", "math", "mixed-small"))
    one = build_drafters(recipe, target_dir, tmp_path / "one", tmp_path / "w1")
    two = build_drafters(recipe, target_dir, tmp_path / "two", tmp_path / "w2", jobs=2)
    assert set(two["drafters"]) == set(one["drafters"]) == {"eagle2-chat", "eagle2-math", "eagle2-mixed-small"}
    for name in one["drafters"]:
        a, b = load_file(tmp_path / "one" / name / "model.safetensors"), load_file(tmp_path / "two" / name / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name
    (tmp_path / "two" / "drafters.json").write_text("{")
    with pytest.raises(ValueError, match="drafters.json: not valid JSON"):
        build_drafters(recipe, target_dir, tmp_path / "two", tmp_path / "w2", jobs=2)


def test_features_use_every_core_when_heads_train_in_workers(tmp_path, monkeypatch):
    """With --jobs, --threads is each worker's share: the features, extracted before the workers
    start, use the whole machine; one job keeps --threads throughout."""
    from taps.train import family as drafter_recipe
    from taps.train.family import DrafterRecipe, build_drafters

    class Seen(Exception):
        pass

    def features(recipe, target, work, sources, backbones):
        raise Seen(torch.get_num_threads())

    monkeypatch.setattr(drafter_recipe, "_features", features)
    monkeypatch.setattr("taps.core.target.Target.load", lambda *a, **k: None)
    before = torch.get_num_threads()
    try:
        seen = {}
        for jobs in (2, 1):
            torch.set_num_threads(before)
            with pytest.raises(Seen) as err:
                build_drafters(DrafterRecipe(threads=1), "unused", tmp_path / f"out{jobs}", tmp_path / "work", jobs=jobs)
            seen[jobs] = err.value.args[0]
    finally:
        torch.set_num_threads(before)
    assert seen == {2: before, 1: 1}


def test_regenerated_data_keeps_the_drawn_order(tmp_path, data_dir, target_dir):
    """With regenerate, the target answers every drawn prompt (batched), the answers go back in the
    drawn order (so mixed-small's prefixes stay a random draw), and the features are built from them."""
    from taps.data.features import read_conversations
    from taps.data.regenerate import RegenerateSettings, regenerate
    from taps.train.family import DrafterRecipe, build_drafters

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=10, max_len=48, epochs=1, batch_size=4, warmup_steps=1,
                           backbones=("eagle2",), domains=("math", "mixed-small"), regenerate=True,
                           regen_batch_size=4, regen_max_new_tokens={"chat": 5, "math": 6})
    summary = build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    assert set(summary["drafters"]) == {"eagle2-math", "eagle2-mixed-small"}
    work = tmp_path / "work"
    for domain, limit in (("chat", 5), ("math", 6)):
        drawn, trained = read_conversations(work / f"{domain}.jsonl"), read_conversations(work / f"{domain}.train.jsonl")
        assert [r["id"] for r in trained] == [r["id"] for r in drawn]
        target = Target.load(target_dir, device="cpu", dtype="float32")
        one = tmp_path / f"{domain}-one.jsonl"
        regenerate(target, work / f"{domain}.jsonl", one, RegenerateSettings(max_new_tokens=limit), progress=None)
        by_id = {r["id"]: r["conversations"] for r in read_conversations(one)}
        assert all(r["conversations"] == by_id[r["id"]] for r in trained)  # the target's own greedy answers
        manifest = json.loads((work / f"features-{domain}" / "manifest.json").read_text())
        assert manifest["data_file"].endswith(f"{domain}.train.jsonl")
    with pytest.raises(ValueError, match="regen_max_new_tokens"):
        build_drafters(replace(recipe, regen_max_new_tokens=7), target_dir, tmp_path / "drafters", tmp_path / "work")


def test_shipped_regenerated_data_skips_regeneration(tmp_path, data_dir, target_dir, monkeypatch):
    """A build ships its regenerated answers (ship_data, gzip); a recipe naming them rebuilds the same
    training files and features without calling the target's generate, and refuses data from another
    draw naming the file and line."""
    from taps.data.features import read_conversations
    from taps.train import family
    from taps.train.family import DrafterRecipe, build_drafters, ship_data

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=6, max_len=48, epochs=1, batch_size=4, warmup_steps=1,
                           backbones=("eagle2",), domains=("math",), regenerate=True,
                           regen_batch_size=4, regen_max_new_tokens={"chat": 5, "math": 6})
    build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    [shipped] = ship_data(tmp_path / "work", tmp_path / "ship", domains=("math",))
    assert shipped.name == "math.train.jsonl.gz" and shipped.read_bytes()[:2] == b"\x1f\x8b"
    original = read_conversations(tmp_path / "work" / "math.train.jsonl")
    assert read_conversations(shipped) == original
    assert ship_data(tmp_path / "work", tmp_path / "ship2", domains=("math",))[0].read_bytes() == shipped.read_bytes()

    def no_regeneration(*args, **kwargs):
        raise AssertionError("regenerate() called although the shipped data is present")

    monkeypatch.setattr(family, "regenerate", no_regeneration)
    again = replace(recipe, shipped_data={"math": str(shipped), "chat": str(tmp_path / "absent.jsonl.gz")})
    build_drafters(again, target_dir, tmp_path / "drafters2", tmp_path / "work2")
    assert read_conversations(tmp_path / "work2" / "math.train.jsonl") == original
    before = json.loads((tmp_path / "work" / "features-math" / "manifest.json").read_text())
    after = json.loads((tmp_path / "work2" / "features-math" / "manifest.json").read_text())
    assert after["tokens"] == before["tokens"] and after["assistant_tokens"] == before["assistant_tokens"]

    other_draw = replace(again, seed=1)  # the same file does not answer another draw
    with pytest.raises(ValueError, match=r"math\.train\.jsonl\.gz:\d+: record id .* not in this draw"):
        build_drafters(other_draw, target_dir, tmp_path / "drafters3", tmp_path / "work3")


def test_only_the_domains_the_pending_heads_need_are_prepared(tmp_path, data_dir, target_dir):
    from taps.train.family import DrafterRecipe, build_drafters

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=8, max_len=160, epochs=1, batch_size=4, warmup_steps=1,
                           backbones=("eagle2",), domains=("math",), draft_vocab=40, keep_epoch_heads=True)
    summary = build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    assert (tmp_path / "work" / "features-math").is_dir() and not (tmp_path / "work" / "chat.jsonl").exists()
    vocab = summary["drafters"]["eagle2-math"]["draft_vocab"]  # the heads draft over 40 tokens of their data
    assert vocab["size"] == 40 and 0.5 < vocab["coverage"] <= 1.0
    config = json.loads((tmp_path / "drafters" / "eagle2-math" / "config.json").read_text())
    assert config["draft_vocab_size"] == 40
    epoch_head = tmp_path / "work" / "train-eagle2-math" / "epochs" / "epoch-01"
    assert (epoch_head / "model.safetensors").is_file()  # every epoch's head, for learning curves
    build_drafters(replace(recipe, domains=("math", "mixed-small")), target_dir, tmp_path / "drafters",
                   tmp_path / "work")
    assert (tmp_path / "work" / "features-chat").is_dir()


def test_shipped_heads_are_16_bit_and_load_strictly(tmp_path, data_dir, target_dir):
    from taps.drafter.checkpoint import load_head, read_config
    from taps.train.family import DrafterRecipe, build_drafters, ship_heads

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=8, max_len=48, epochs=1, batch_size=4, warmup_steps=1,
                           backbones=("eagle2",), domains=("math",))
    build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    assert ship_heads(tmp_path / "drafters", tmp_path / "ship") == ["eagle2-math"]
    weights = load_file(tmp_path / "ship" / "eagle2-math" / "model.safetensors")
    full = load_file(tmp_path / "drafters" / "eagle2-math" / "model.safetensors")
    assert set(weights) == set(full) and all(w.dtype == torch.bfloat16 for w in weights.values())
    assert all(torch.equal(weights[k], full[k].to(torch.bfloat16)) for k in full)
    assert json.loads((tmp_path / "ship" / "drafters.json").read_text())["shipped_dtype"] == "bfloat16"
    target = Target.load(target_dir, device="cpu", dtype="float32")
    head = load_head(tmp_path / "ship" / "eagle2-math", target)
    _, info = read_config(tmp_path / "ship" / "eagle2-math")
    assert info.backbone == "eagle2" and head.fc.weight.dtype == torch.float32


def test_card_tables_quote_what_the_build_wrote(tmp_path, data_dir, target_dir):
    from taps.train.family import DrafterRecipe, build_drafters
    from taps.train.family_card import data_table, epochs_table, heads_table

    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}",
                           n_per_domain=8, max_len=160, epochs=2, batch_size=4, warmup_steps=1,
                           backbones=("eagle2",), domains=("math",), regenerate=True, regen_batch_size=4,
                           regen_max_new_tokens=5, draft_vocab=40)
    summary = build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    data = data_table(tmp_path / "work").splitlines()
    manifest = json.loads((tmp_path / "work" / "features-math" / "manifest.json").read_text())
    assert data[2].startswith("| math | 8 | 8 |") and f"| {manifest['tokens']:,} |" in data[2]
    heads = heads_table(tmp_path / "drafters").splitlines()
    entry = summary["drafters"]["eagle2-math"]
    assert heads[2].startswith(f"| eagle2-math | {entry['records']} | 2 | {entry['steps']} |")
    assert f"{entry['final']['heldout_top1_depth1']:.3f}" in heads[2] and "| 40 (" in heads[2]
    curve = epochs_table(tmp_path / "drafters").splitlines()
    assert curve[0] == "| head | epoch 1 | epoch 2 |" and curve[2].startswith("| eagle2-math | ")


def test_mixed_xl_draws_apart_cuts_by_answer_order_and_rebuilds_from_shipped_data(tmp_path, data_dir, target_dir,
                                                                                    monkeypatch):
    """mixed-xl (eagle2-mixed-xl's recipe at a toy size): its own draw (seed, count, a cap on the first
    prompt's characters), the target's answers cut at a limit in answer order (shortest first), one
    head on both domains with the xl training settings; its shipped answers rebuild the same training
    files without the target's generate; a bad xl recipe is refused naming the key."""
    from taps.data.features import read_conversations
    from taps.data.mix import mix_sources
    from taps.data.regenerate import RegenerateSettings, regenerate
    from taps.train import family
    from taps.train.family import DrafterRecipe, build_drafters, ship_data

    chat_source = f"sharegpt:{data_dir / 'sharegpt.json'}"
    drawn = mix_sources([f"{chat_source}:20"], 3, english=True)
    lengths = sorted(len(r["conversations"][0]["content"]) for r in drawn)
    # the longest cap that keeps more than 5 and drops at least one: the draw's order depends on the
    # data file's path (pytest's tmp dir), and a median cap keeps everything when over half tie at the top
    cap = max(c for c in set(lengths) if 5 < sum(n <= c for n in lengths) < len(lengths))
    xl = {"seed": 3, "chat_count": 20, "chat_max_prompt_chars": cap, "chat_limit": 5, "math_count": 12,
          "math_limit": 4, "epochs": 1, "batch_size": 2, "grad_accum": 2, "warmup_steps": 1, "max_len": 40}
    recipe = DrafterRecipe(data_dir=str(data_dir), chat_source=chat_source, n_per_domain=6, max_len=48, epochs=2,
                           batch_size=4, warmup_steps=1, backbones=("eagle2",), domains=("mixed-xl",),
                           regenerate=True, regen_batch_size=3, regen_max_new_tokens={"chat": 5, "math": 6}, xl=xl)
    summary = build_drafters(recipe, target_dir, tmp_path / "drafters", tmp_path / "work")
    work = tmp_path / "work"
    assert set(summary["drafters"]) == {"eagle2-mixed-xl"} and summary["drafters"]["eagle2-mixed-xl"]["records"] == 9
    assert not (work / "chat.jsonl").exists()  # the family's own draws are not needed
    chat = read_conversations(work / "xl-chat.jsonl")
    assert [r["id"] for r in chat] == [r["id"] for r in drawn if len(r["conversations"][0]["content"]) <= cap]
    assert 5 < len(chat) < 20
    target = Target.load(target_dir, device="cpu", dtype="float32")
    for source, limit, tokens in (("xl-chat", 5, 5), ("xl-math", 4, 6)):
        cut = tmp_path / f"{source}-cut.jsonl"
        regenerate(target, work / f"{source}.jsonl", cut,
                   RegenerateSettings(max_new_tokens=tokens, batch_size=3, limit=limit), progress=None)
        assert read_conversations(work / f"{source}.train.jsonl") == read_conversations(cut)  # answer order kept
        manifest = json.loads((work / f"features-{source}" / "manifest.json").read_text())
        assert manifest["max_len"] == 40  # xl's, not the family's 48
    metrics = [json.loads(x) for x in (tmp_path / "drafters" / "eagle2-mixed-xl" / "metrics.jsonl").read_text().splitlines()]
    assert max(row.get("epoch", 0) for row in metrics) == 1  # xl's epochs, not the family's 2
    trained = json.loads((tmp_path / "drafters" / "eagle2-mixed-xl" / "config.json").read_text())
    assert '"batch_size": 2' in json.dumps(trained) and '"grad_accum": 2' in json.dumps(trained)  # xl's batch

    shipped = ship_data(work, tmp_path / "ship", domains=("xl-chat", "xl-math"))
    assert [p.name for p in shipped] == ["xl-chat.train.jsonl.gz", "xl-math.train.jsonl.gz"]

    def no_regeneration(*args, **kwargs):
        raise AssertionError("regenerate() called although the shipped data is present")

    monkeypatch.setattr(family, "regenerate", no_regeneration)
    again = replace(recipe, xl={**xl, "shipped_data": {"chat": str(shipped[0]), "math": str(shipped[1])}})
    build_drafters(again, target_dir, tmp_path / "drafters2", tmp_path / "work2")
    for source in ("xl-chat", "xl-math"):
        assert read_conversations(tmp_path / "work2" / f"{source}.train.jsonl") == \
            read_conversations(work / f"{source}.train.jsonl")
    with pytest.raises(ValueError, match="more than this recipe's limit of 3"):
        build_drafters(replace(again, xl={**again.xl, "chat_limit": 3}), target_dir, tmp_path / "d3", tmp_path / "w3")
    with pytest.raises(ValueError, match="xl: unknown key 'chat_limt'"):
        build_drafters(replace(recipe, xl={**xl, "chat_limt": 4}), target_dir, tmp_path / "d4", tmp_path / "w4")
    with pytest.raises(ValueError, match="mixed-xl needs the recipe's xl settings"):
        build_drafters(replace(recipe, xl=None), target_dir, tmp_path / "d5", tmp_path / "w5")
    with pytest.raises(ValueError, match="needs regenerate: true"):
        build_drafters(replace(recipe, regenerate=False), target_dir, tmp_path / "d6", tmp_path / "w6")


def test_xl_settings_bind_only_a_build_with_mixed_xl_heads(tmp_path):
    """drafters.json refuses a change of the xl settings where a mixed-xl head was trained with
    them, and ignores it where none was (the family's heads do not depend on it)."""
    from taps.train.family import DrafterRecipe, _record, check_same_recipe

    recipe = DrafterRecipe(xl={"seed": 15})
    _record(tmp_path, recipe, "eagle2-math", {})
    check_same_recipe(tmp_path, replace(recipe, xl={"seed": 16}))
    _record(tmp_path, recipe, "eagle2-mixed-xl", {})
    with pytest.raises(ValueError, match="trained with xl = "):
        check_same_recipe(tmp_path, replace(recipe, xl={"seed": 16}))
