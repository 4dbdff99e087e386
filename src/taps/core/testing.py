"""Tiny random targets and tokenizers, built from configs in code (no hub): for tests, benchmarks
and trying the API. Never for real use: a random model has no domains.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

ARCHITECTURES = ("llama", "qwen2", "mistral")

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SAMPLE_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? 48/2 = <<48/2=24>>24 #### 72",
    "Write a short poem about the sea, the wind and the stars above the harbour.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > # @ ! ? , . ; : ' \" \n",
]


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer with ChatML special tokens and chat template."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SAMPLE_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 384, hidden_size: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, intermediate: int = 128, max_positions: int = 512, **extra):
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {', '.join(classes)}")
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kwargs.update(extra)
    return classes[arch](**kwargs)


def tiny_model(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **config_kwargs):
    config = tiny_config(arch, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def bench_model(arch: str = "llama", hidden: int = 512, layers: int = 8, vocab: int = 8192, seed: int = 0):
    """A random target of a size where the target's forward dominates a step (for bench/)."""
    heads = max(1, hidden // 64)
    return tiny_model(arch, seed=seed, vocab_size=vocab, hidden_size=hidden, layers=layers, heads=heads,
                      kv_heads=max(1, heads // 4) if heads % 4 == 0 else heads, intermediate=hidden * 3,
                      max_positions=4096)


def write_tiny_target(out_dir: str | Path, arch: str = "llama", seed: int = 0, **config_kwargs) -> Path:
    """Save a tiny random model + tokenizer as a Hugging Face directory (safetensors)."""
    out = Path(out_dir)
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, seed=seed, **config_kwargs)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":  # python -m taps.core.testing OUT_DIR [ARCH]: write a random tiny target
    import sys

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m taps.core.testing OUT_DIR [llama|qwen2|mistral]")
    print(write_tiny_target(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "llama"))
