"""A byte-level BPE tokenizer for the tiny target, trained with `tokenizers` on its corpora.

Role and end-of-turn markers are special tokens; the chat template (with generation markers, so
`return_assistant_tokens_mask` works) is stored in tokenizer_config.json.
"""

from __future__ import annotations

from typing import Iterable

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS.values(), END_OF_TURN]

# <|bos|><|user|>\n{question}<|end|>\n<|assistant|>\n{answer}<|end|>\n ...
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train byte-level BPE (digits split one by one, which helps arithmetic) on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[*ROLE_TOKENS.values(), END_OF_TURN])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out_dir) -> None:
    """Save with the chat template inside tokenizer_config.json (readable by older loaders too)."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
