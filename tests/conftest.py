"""Shared fixtures: tiny random fp32 targets of three architectures, built in code (no hub)."""

from __future__ import annotations

import functools

import pytest
import torch

from taps.testing import ARCHITECTURES, tiny_model, tiny_tokenizer, write_tiny_target

torch.set_num_threads(1)  # the machines have 2 cores; keep results deterministic and leave one free


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, attn: str = "sdpa", seed: int = 0):
    return tiny_model(arch, seed=seed, attn_implementation=attn)


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
