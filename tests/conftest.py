"""Shared fixtures: tiny random fp32 targets of three architectures, built in code (no hub)."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from taps.drafter.checkpoint import init_head
from taps.core.target import Target
from taps.core.testing import ARCHITECTURES, tiny_model, tiny_tokenizer, write_tiny_target

torch.set_num_threads(1)  # the machines have 2 cores; keep results deterministic and leave one free
# --dtype auto on a CPU times float32 against bf16 (taps.core.machine); pinned here so that no test's
# outcome depends on a timing (an environment variable, so --jobs worker processes see it too)
os.environ["TAPS_CPU_DTYPE"] = "float32"


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, attn: str = "sdpa", seed: int = 0):
    return tiny_model(arch, seed=seed, attn_implementation=attn)


def llama_with_head(seed: int = 1):
    """(model, Target, an untrained head bound to it) on the cached tiny Llama: the setting of the
    lossless-composition tests of the model-free drafters."""
    model = cached_model("llama")
    target = Target(model)
    return model, target, init_head(model.config, seed=seed).bind(target.embed_tokens, target.lm_head)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session", params=ARCHITECTURES)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """A tiny Llama target saved as a Hugging Face directory (safetensors + tokenizer)."""
    return write_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    """target_dir loaded as a float32 Target, once per test module (a module may define its own)."""
    return Target.load(target_dir, device="cpu", dtype="float32")


def prompts(n: int, vocab: int = 384, seed: int = 0) -> list[list[int]]:
    """n random prompts of varied lengths (3..40 tokens), reproducible."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 41, (1,), generator=g))
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: Hugging Face's own greedy generate."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        # explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()



TOY_WORDS = "the a cat dog sells buys apples pens each day week more less than twice half".split()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A toy data directory: 40 GSM8K-style problems and 40 ShareGPT-style conversations."""
    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    with (root / "gsm8k" / "train.jsonl").open("w") as f:
        for i in range(40):
            a, b = i + 2, 3 * i + 1
            f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many?",
                                "answer": f"He has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}) + "\n")
    convs = []
    for i in range(40):
        words = " ".join(TOY_WORDS[(i + k) % len(TOY_WORDS)] for k in range(30))
        convs.append({"id": f"s{i}", "conversations": [{"from": "human", "value": f"Tell me about {TOY_WORDS[i % 15]}."},
                                                       {"from": "gpt", "value": words}]})
    (root / "sharegpt.json").write_text(json.dumps(convs))
    return root
