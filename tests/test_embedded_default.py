"""The shipped embedded default (models/taps-tiny), and the next one while it is built in
models/taps-tiny-next: each loads strictly, its chat template gives the right assistant mask, and
speculative decoding on it is token-identical to plain decoding with every drafter it has so far."""

from pathlib import Path

import pytest
import torch

from taps.config import DecodeConfig, TreeConfig
from taps.data.chat import encode_conversation
from taps.decode import chat_ids, generate
from taps.drafter.checkpoint import init_head, load_head
from taps.propose.single import SingleProposer
from taps.target import Target
from taps.tiny.tokenizer import END_OF_TURN

MODELS = Path(__file__).resolve().parents[1] / "models"
# the shipped default, and the staged next one (committed piece by piece while it is built) if present
ROOTS = [MODELS / "taps-tiny"] + [p for p in [MODELS / "taps-tiny-next"] if (p / "target" / "config.json").is_file()]
PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?",
           "Write a short poem about the sea."]


@pytest.fixture(scope="module", params=ROOTS, ids=[p.name for p in ROOTS])
def root(request) -> Path:
    return request.param


@pytest.fixture(scope="module")
def target(root):
    return Target.load(root / "target", device="cpu", dtype="float32")


def test_loads_with_transformers_alone(root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(root / "target")
    tok = AutoTokenizer.from_pretrained(root / "target")
    assert model.config.model_type == "llama" and len(tok) == model.config.vocab_size
    assert (root / "target" / "model.safetensors").stat().st_size < 25 * 2**20


def test_chat_template_round_trip(target):
    tok = target.tokenizer
    convo = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2+3 = <<2+3=5>>5\n#### 5"},
             {"role": "user", "content": "And 2 + 4?"}, {"role": "assistant", "content": "#### 6"}]
    ids, mask = encode_conversation(tok, convo)
    assert tok.decode(ids) == tok.apply_chat_template(convo, tokenize=False)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == f"2+3 = <<2+3=5>>5\n#### 5{END_OF_TURN}#### 6{END_OF_TURN}"
    assert tok.convert_tokens_to_ids(END_OF_TURN) in target.stop_token_ids()


def heads(root, target):
    yield "untrained", init_head(target.model.config, seed=0).bind(target.embed_tokens, target.lm_head)
    for path in sorted(p for p in (root / "drafters").glob("*") if (p / "model.safetensors").is_file()):
        yield path.name, load_head(path, target)[0]  # strict load of every shipped drafter


def test_speculative_equals_plain(root, target):
    cfg = DecodeConfig(max_new_tokens=48, stop_token_ids=target.stop_token_ids())
    for prompt in PROMPTS:
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": prompt}])
        plain = generate(target, None, ids, cfg).tokens
        with torch.inference_mode():
            ref = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
        assert plain == ref[:len(plain)]
        for name, head in heads(root, target):
            assert generate(target, SingleProposer(head, TreeConfig()), ids, cfg).tokens == plain, name


def test_the_shipped_default_has_every_head_and_its_measured_row():
    """All eight heads ship, and the model card's acceptance table was measured with these weights."""
    import json

    from taps.drafter.checkpoint import weights_digest

    root = MODELS / "taps-tiny"
    names = {f"{b}-{d}" for b in ("eagle2", "hass") for d in ("chat", "math", "mixed-small", "mixed-large")}
    shipped = {p.name for p in (root / "drafters").iterdir() if p.is_dir()}
    assert shipped == names
    assert set(json.loads((root / "drafters" / "drafters.json").read_text())["drafters"]) == names
    table = json.loads((root / "drafter-table.json").read_text())
    assert set(table["drafters"]) == names
    for name in names:
        assert table["weights"][name] == weights_digest(root / "drafters" / name), name
