"""Study configs: the shipped configs parse and dry-run; templates expand; bad keys are named; a
toy study runs every stage (target, drafters, eval, report) end to end in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taps.cli.main import main
from taps.core.config import SpeculationConfig, TreeConfig
from taps.eval.metrics import load_results
from taps.study import (PAPER_VARIANTS, StudyConfigError, expand_variants, load_study, plan, run_study,
                             study_from_dict)

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog sells buys apples pens each day week more less than twice half".split()


def test_paper_config_parses_and_dry_runs(capsys):
    study = load_study(REPO / "configs" / "paper-llama3-8b.yaml")
    names = [v.name for v in study.variants]
    for backbone in ("eagle2", "hass"):
        for suffix in ("math", "chat", "mixed-small", "mixed-large", "averaged", "routed", "merged"):
            assert f"{backbone}-{suffix}" in names
    assert names.count("baseline") == 1
    assert study.drafter_recipe["n_per_domain"] == 70000 and study.drafter_recipe["epochs"] == 20
    assert study.drafter_recipe["lr"] == pytest.approx(3e-5) and study.drafter_recipe["max_len"] == 2048
    assert study.settings.temperatures == (0.0, 1.0)
    tree = study.settings.speculation.tree
    assert (tree.total_tokens, tree.depth, tree.top_k) == (60, 5, 10)
    assert study.benches == ["mt_bench", "gsm8k", "math500", "svamp"] and study.limit is None
    routed = next(v for v in study.variants if v.name == "hass-routed")
    assert routed.strategy == "route" and routed.signal == "confidence" and routed.granularity == "step"
    assert routed.drafters == (("math", "runs/paper-llama3-8b/drafters/hass-math"),
                               ("chat", "runs/paper-llama3-8b/drafters/hass-chat"))
    sweep = [v for v in study.variants if v.name.startswith("eagle2-average-")]
    assert [v.weights[0] for v in sweep] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9])
    assert main(["reproduce", str(REPO / "configs" / "paper-llama3-8b.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "MISSING" in out  # the 8B target is not on this machine, and the dry run says so
    assert "hass-merged: merge" in out


def test_smollm2_config_parses():
    study = load_study(REPO / "configs" / "smollm2.yaml")
    assert str(study.target) == "smollm2-135m-instruct"
    assert len([v for v in study.variants if v.name.startswith("hass-")]) == 11 + 2  # paper 7 + 4 extra + 2 lambdas
    assert any("target: smollm2-135m-instruct exists" in line for line in plan(study))
    recipe = study.drafter_recipe
    assert recipe["regenerate"] and recipe["draft_vocab"] == 8192 and recipe["n_per_domain"] == 2000
    # the three backbones: their variants, and the recipe trains them (it names none itself)
    assert len([v for v in study.variants if v.name.startswith("eagle3-")]) == 11 + 2
    assert recipe["backbones"] == ["eagle2", "hass", "eagle3"]
    assert any("'backbones': ['eagle2', 'hass', 'eagle3']" in line for line in plan(study, ("drafters",)))


def test_templates_and_bad_keys():
    specs = expand_variants({"{backbone}-avg-{lambda}": "average-{lambda}:a={drafters}/{backbone}-a,b=x/b"},
                            ["eagle2", "hass"], [0.25, 0.75], Path("D"), "cfg")
    assert [v.name for v in specs] == ["eagle2-avg-0.25", "eagle2-avg-0.75", "hass-avg-0.25", "hass-avg-0.75"]
    assert specs[1].weights == (0.75, 0.25) and specs[1].drafters[0] == ("a", "D/eagle2-a")
    base = {"name": "x", "out": "o", "target": {"path": "t"}, "drafters": {"out": "d"}, "variants": PAPER_VARIANTS}
    study_from_dict(base)
    with pytest.raises(StudyConfigError, match="unknown key.*evals"):
        study_from_dict({**base, "evals": {}})
    with pytest.raises(StudyConfigError, match="eval: unknown key.*temperature"):
        study_from_dict({**base, "eval": {"temperature": [0]}})
    with pytest.raises(StudyConfigError, match="drafters.recipe: unknown key.*epoch"):
        study_from_dict({**base, "drafters": {"out": "d", "recipe": {"epoch": 3}}})
    with pytest.raises(StudyConfigError, match="drafters.recipe.xl: unknown key.*chat_limt"):
        study_from_dict({**base, "drafters": {"out": "d", "recipe": {"xl": {"chat_limt": 3}}}})
    assert study_from_dict({**base, "drafters": {"out": "d", "recipe": {"xl": {"chat_limit": 3}}}}) \
        .drafter_recipe["xl"] == {"chat_limit": 3}
    with pytest.raises(StudyConfigError, match="drafters.jobs must be an integer >= 1, got 0"):
        study_from_dict({**base, "drafters": {"out": "d", "jobs": 0}})
    with pytest.raises(StudyConfigError, match="missing key 'variants'"):
        study_from_dict({k: v for k, v in base.items() if k != "variants"})
    with pytest.raises(StudyConfigError, match="placeholder"):
        study_from_dict({**base, "variants": {"{backbon}-x": "baseline"}})
    assert study_from_dict(base).settings.acceptance == "verify"
    assert study_from_dict({**base, "eval": {"acceptance": "replay"}}).settings.acceptance == "replay"
    with pytest.raises(StudyConfigError, match="eval: acceptance must be one of verify, replay"):
        study_from_dict({**base, "eval": {"acceptance": "guess"}})
    with pytest.raises(StudyConfigError, match="eval: acceptance replay measures greedy acceptance"):
        study_from_dict({**base, "eval": {"acceptance": "replay", "temperatures": [0, 1]}})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    for split, n in (("train", 40), ("test", 4)):
        with (root / "gsm8k" / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                a, b = i + 2, 3 * i + 1
                f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many?",
                                    "answer": f"He has {a}+{b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"}) + "\n")
    convs = [{"id": f"s{i}", "conversations": [
        {"from": "human", "value": f"Tell me about {WORDS[i % 15]}."},
        {"from": "gpt", "value": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(30))}]} for i in range(40)]
    (root / "sharegpt.json").write_text(json.dumps(convs))
    (root / "mt_bench").mkdir()
    (root / "mt_bench" / "question.jsonl").write_text("".join(
        json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"Write about {w}.", "Shorter."]}) + "\n"
        for i, w in enumerate(WORDS[:3])))
    return root


def test_toy_study_runs_every_stage(tmp_path, data_dir):
    from taps.core.testing import write_tiny_target

    out = tmp_path / "study"
    config = {
        "name": "toy", "out": str(out),
        "target": {"path": str(write_tiny_target(out / "target", "llama", seed=0))},
        "drafters": {"out": str(out / "drafters"), "recipe": dict(
            chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}", n_per_domain=6, max_len=48, epochs=1, batch_size=4,
            warmup_steps=1, backbones=["eagle2"])},
        "backbones": ["eagle2"], "lambdas": [0.25],
        "variants": {**PAPER_VARIANTS, "{backbone}-average-{lambda}":
                     "average-{lambda}:math={drafters}/{backbone}-math,chat={drafters}/{backbone}-chat"},
        "eval": {"bench": ["mt_bench", "gsm8k"], "temperatures": [0], "limit": 2, "max_new_tokens": 6,
                 "tree": {"total_tokens": 8, "depth": 3, "top_k": 2}, "device": "cpu", "dtype": "float32"},
    }
    study = study_from_dict(config, "toy", str(data_dir))
    report = run_study(study, progress=False)
    assert (out / "target" / "config.json").is_file()
    assert all((out / "drafters" / f"eagle2-{d}" / "model.safetensors").is_file()
               for d in ("chat", "math", "mixed-small", "mixed-large"))
    records = load_results(study.results)
    assert {r["variant"] for r in records} == {v.name for v in study.variants}
    assert len(records) == len(study.variants) * (2 * 2 + 2)  # 2 MT-Bench questions x 2 turns + 2 GSM8K
    greedy = {}
    for r in records:
        greedy.setdefault((r["bench"], r["question_id"], r["turn"]), set()).add(r["output"])
    assert all(len(v) == 1 for v in greedy.values())  # every variant decodes exactly what the baseline does
    assert (report / "report.md").is_file()
    assert run_study(study, progress=False) == report  # a rerun resumes: nothing left to do
    assert len(load_results(study.results)) == len(records)


def test_demo_study_uses_the_shipped_backbones(tmp_path, capsys):
    from taps.drafter.checkpoint import write_untrained
    from taps.study import DemoSettings, demo_study
    from taps.core.testing import write_tiny_target

    target = write_tiny_target(tmp_path / "m" / "target", num_hidden_layers=8)  # EAGLE-3 fuses three layers
    with pytest.raises(FileNotFoundError, match="train them with `taps reproduce`"):
        demo_study(tmp_path / "m", tmp_path / "out", None, DemoSettings(2, 16))
    for domain in ("chat", "math", "mixed-small", "mixed-large"):
        write_untrained(target, tmp_path / "m" / "drafters" / f"hass-{domain}", seed=1)
    write_untrained(target, tmp_path / "m" / "drafters" / "eagle2-chat", seed=1)  # no math head: left out
    study = demo_study(tmp_path / "m", tmp_path / "out", None, DemoSettings(2, 16))
    names = [v.name for v in study.variants]
    assert names[0] == "baseline" and all(n.startswith("hass-") for n in names[1:])
    said = capsys.readouterr().out
    assert "eagle2-math, eagle2-mixed-small, eagle2-mixed-large; left out" in said
    assert len(names) == 1 + 7 + 4 + 2  # paper variants, extra merges/routing (the bandit too), two sweep points
    assert "hass-routed-bandit" in names
    # both specialists but no mixed heads: the backbone's variants that need only them take part
    for domain in ("chat", "math"):
        write_untrained(target, tmp_path / "m" / "drafters" / f"eagle3-{domain}", seed=1, backbone="eagle3")
    study = demo_study(tmp_path / "m", tmp_path / "out", None, DemoSettings(2, 16))
    eagle3 = [v.name for v in study.variants if v.name.startswith("eagle3-")]
    assert "eagle3-mixed-small, eagle3-mixed-large; its variants without them kept" in capsys.readouterr().out
    assert len(eagle3) == 7 + 4 + 2 - 2 and {"eagle3-math", "eagle3-chat", "eagle3-merged-budget"} <= set(eagle3)
    assert not any("mixed" in n for n in eagle3) and len(study.variants) == 14 + len(eagle3)
    assert study.limit == 2 and study.settings.temperatures == (0.0,) and study.settings.acceptance == "replay"
    assert study.settings.speculation == SpeculationConfig(TreeConfig(60, 5, 10), "fixed")
    small = demo_study(tmp_path / "m", tmp_path / "out", None,
                       DemoSettings(2, 16, speculation=SpeculationConfig(TreeConfig(16, 5, 4))))
    assert (small.settings.speculation.tree.total_tokens, small.settings.speculation.tree.top_k) == (16, 4)
    assert demo_study(tmp_path / "m", tmp_path / "out", None, DemoSettings(2, 16, acceptance="verify")) \
        .settings.acceptance == "verify"  # `taps demo --acceptance verify`: every tree verified, speed measured
    with pytest.raises(FileNotFoundError, match="no embedded target"):
        demo_study(tmp_path / "nothing", tmp_path / "out", None, DemoSettings(2, 16))


def test_demo_on_a_models_directory_named_after_a_known_target(tmp_path):
    """models/smollm2-135m-instruct holds only drafters: the target is the installed package's GGUF file."""
    from taps.drafter.checkpoint import write_untrained
    from taps.study import DemoSettings, demo_study

    models = tmp_path / "smollm2-135m-instruct"
    for domain in ("chat", "math", "mixed-small", "mixed-large"):
        write_untrained("smollm2-135m-instruct", models / "drafters" / f"eagle2-{domain}")
    study = demo_study(models, tmp_path / "out", None, DemoSettings(1, 8, dtype="bfloat16"))
    assert str(study.target) == "smollm2-135m-instruct" and study.dtype == "bfloat16"
    assert {v.name for v in study.variants} >= {"baseline", "eagle2-math", "eagle2-routed", "eagle2-merged"}
    assert not any(v.name.startswith("hass") for v in study.variants)
    with pytest.raises(FileNotFoundError, match="no embedded target here"):
        demo_study(tmp_path / "elsewhere", tmp_path / "out", None, DemoSettings(1, 8))
