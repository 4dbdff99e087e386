"""The SmolLM2-135M-Instruct heads shipped so far (models/smollm2-135m-instruct/drafters, staged
while the rest train): each loads strictly, holds bf16 weights with no embedding and no LM head,
drafts over its recorded vocabulary, and decodes greedily token-identical to plain decoding
(float32). Once all eight ship, test_embedded_default checks the whole default."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from taps.config import DecodeConfig, TreeConfig
from taps.decode import chat_ids, generate
from taps.drafter.checkpoint import load_head
from taps.propose.single import SingleProposer
from taps.target import Target

DRAFTERS = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct" / "drafters"
HEADS = sorted(p.name for p in DRAFTERS.glob("*") if (p / "model.safetensors").is_file()) if DRAFTERS.is_dir() else []
PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?",
           "Give me three tips for staying focused while studying."]


@pytest.fixture(scope="module")
def target():
    return Target.load("smollm2-135m-instruct", device="cpu", dtype="float32")


def test_heads_are_staged():
    assert HEADS, f"{DRAFTERS}: no heads staged"


@pytest.mark.parametrize("name", HEADS)
def test_head_loads_strictly_and_is_lossless(target, name):
    with safe_open(DRAFTERS / name / "model.safetensors", "pt") as f:
        assert not any(k.startswith(("embed", "lm_head")) for k in f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    head, info = load_head(DRAFTERS / name, target)
    assert info.backbone == name.split("-")[0] and info.training_data == name.split("-", 1)[1]
    assert head.draft_vocab_size == 8192
    cfg = DecodeConfig(max_new_tokens=24, stop_token_ids=target.stop_token_ids())
    for prompt in PROMPTS:
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": prompt}])
        plain = generate(target, None, ids, cfg).tokens
        assert generate(target, SingleProposer(head, TreeConfig()), ids, cfg).tokens == plain
