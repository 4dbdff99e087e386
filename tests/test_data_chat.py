"""Assistant loss masks through chat templates: Llama-3 and ChatML styles, with and without
generation markers, checked exactly by decoding the masked tokens."""

from __future__ import annotations

import functools

import pytest
import torch

from taps.data.chat import ChatTemplateError, answer_spans, encode_conversation, special_ids
from taps.core.testing import CHATML_TEMPLATE, tiny_tokenizer

torch.set_num_threads(1)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# markers around the content only: the end-of-turn token lies outside the block and must still be masked
LLAMA3_MARKED = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# markers around content + <|im_end|>, as Hugging Face's documented ChatML example
CHATML_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"  # a bare newline after a tag is trimmed
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOT = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "How many clips did Natalia sell?"},
    {"role": "assistant", "content": "She sold 48/2 = 24 clips in May, 72 in all. #### 72"},
    {"role": "user", "content": "Write a short poem about the sea."},
    {"role": "assistant", "content": "The wind and the stars above the harbour, café ✓"},
]


@functools.lru_cache(maxsize=None)
def llama3_tokenizer():
    """A byte-level BPE with Llama-3's special tokens; <|eot_id|> is an added special token only (not
    a named one), as in some Llama-3 releases."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([turn["content"] for turn in CONVERSATION] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def make_tokenizer(style: str, marked: bool):
    if style == "llama3":
        tok = llama3_tokenizer()
        tok.chat_template = LLAMA3_MARKED if marked else LLAMA3_TEMPLATE
    else:
        tok = tiny_tokenizer()
        tok.chat_template = CHATML_MARKED if marked else CHATML_TEMPLATE
    return tok


STYLES = [("llama3", False), ("llama3", True), ("chatml", False), ("chatml", True)]


def masked_text(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize("style,marked", STYLES)
def test_mask_is_exactly_assistant_content_and_end_of_turn(style, marked):
    tok = make_tokenizer(style, marked)
    ids, mask = encode_conversation(tok, CONVERSATION)
    eot = EOT[style]
    assistants = [t["content"] for t in CONVERSATION if t["role"] == "assistant"]
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert masked_text(tok, ids, mask) == "".join(a + eot for a in assistants)
    spans = answer_spans(mask)
    assert len(spans) == 2  # one contiguous run per assistant turn
    eot_id = tok.convert_tokens_to_ids(eot)
    for (start, end), content in zip(spans, assistants):
        assert ids[end - 1] == eot_id  # each run closes on the end-of-turn token
        assert tok.decode(ids[start:end - 1]) == content
    # the ids are the rendered text tokenized without extra special tokens
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_llama3_bos_comes_once_from_the_template():
    tok = make_tokenizer("llama3", False)
    ids, mask = encode_conversation(tok, CONVERSATION)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert mask[0] == 0


def test_end_of_turn_found_among_added_special_tokens():
    tok = make_tokenizer("llama3", False)
    eot_id = tok.convert_tokens_to_ids("<|eot_id|>")
    assert eot_id not in tok.all_special_ids  # the case the added-tokens lookup exists for
    assert eot_id in special_ids(tok)


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_markers_and_prefix_diff_agree(style):
    assert encode_conversation(make_tokenizer(style, True), CONVERSATION) == \
        encode_conversation(make_tokenizer(style, False), CONVERSATION)


@pytest.mark.parametrize("style,marked", STYLES)
def test_trailing_user_turn_is_context_only(style, marked):
    tok = make_tokenizer(style, marked)
    ids, mask = encode_conversation(tok, CONVERSATION[:4])
    assert masked_text(tok, ids, mask) == CONVERSATION[2]["content"] + EOT[style]


@pytest.mark.parametrize("style,marked", STYLES)
def test_truncation_cuts_ids_and_mask_together(style, marked):
    tok = make_tokenizer(style, marked)
    ids, mask = encode_conversation(tok, CONVERSATION)
    cut = len(ids) - 7
    short_ids, short_mask = encode_conversation(tok, CONVERSATION, max_len=cut)
    assert (short_ids, short_mask) == (ids[:cut], mask[:cut])
    assert encode_conversation(tok, CONVERSATION, max_len=len(ids) + 10) == (ids, mask)


def test_template_that_is_not_prefix_stable_is_an_error():
    tok = tiny_tokenizer()
    # the last message is rendered differently from the same message followed by others
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 2"):
        encode_conversation(tok, CONVERSATION)


def test_assistant_turn_without_special_end_is_an_error():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ChatTemplateError, match="no end-of-turn special token"):
        encode_conversation(tok, CONVERSATION[1:3])


def test_missing_chat_template_is_an_error():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_conversation(tok, CONVERSATION)
