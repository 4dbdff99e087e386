"""A conversation as token ids through the target's own chat template, with the loss mask that
trains a drafter on what the target itself would write: 1 on the assistant content tokens and on
the end-of-turn token that closes each assistant turn (`<|eot_id|>`, `<|im_end|>`: the drafter must
learn to propose it), 0 on system and user turns and on every role header.

Two ways to find the assistant tokens:
- templates with generation markers (`{% generation %}...{% endgeneration %}`): the mask transformers
  computes (`return_assistant_tokens_mask=True`), extended by the end-of-turn token when a template
  closes the marked block before it;
- any other template: render successive prefixes of the conversation as text. The assistant turn k
  spans from the end of `render(messages[:k], add_generation_prompt=True)` (history + assistant
  header) to the end of `render(messages[:k + 1])`; it ends in the end-of-turn token (the span's last
  special token) and sometimes a separator after it (ChatML's newline), which stays 0. This needs the
  template to be prefix-stable (each rendering a prefix of the next, checked, an error otherwise);
  working on characters, then mapping to tokens through the tokenizer's offsets, keeps it correct
  where BPE merges across a turn boundary. A token that straddles a span edge counts as inside, as
  in transformers' own mask.
The rendered text is tokenized with add_special_tokens=False: templates carry their own BOS.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A tokenizer whose chat template cannot yield an assistant mask (missing, or not prefix-stable)."""


def encode_conversation(tokenizer, conversations: list[dict], max_len: int | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation (`[{"role", "content"}, ...]`), both cut to max_len."""
    template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
    if not template:
        raise ChatTemplateError("the tokenizer has no chat template; set tokenizer.chat_template")
    messages = [{"role": turn["role"], "content": turn["content"]} for turn in conversations]
    if _GENERATION_TAG.search(template):
        ids, mask = _marked(tokenizer, messages)
    else:
        ids, mask = _diffed(tokenizer, messages)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def answer_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of loss-mask 1s (encode_conversation's mask): the record's answers."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def special_ids(tokenizer) -> set[int]:
    """Ids of every special token: the named ones and the added tokens flagged special (Llama-3's
    `<|eot_id|>` is only the latter in some releases)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return ids


def _marked(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' generation-marker mask; a marked run that ends on an ordinary token and is
    followed by a special one (the template closed the block before its end-of-turn token) takes it."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    special = special_ids(tokenizer)
    for i in range(len(ids) - 1):
        if mask[i] and not mask[i + 1] and ids[i] not in special and ids[i + 1] in special:
            mask[i + 1] = 1
    return ids, mask


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn after its header."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], add_generation_prompt=True)
        after = _render(tokenizer, messages[:k + 1], add_generation_prompt=False)
        if not (after.startswith(before) and full.startswith(after)):
            raise ChatTemplateError(
                f"the chat template is not prefix-stable at message {k}: rendering the conversation up to an "
                "assistant turn is not a prefix of rendering it further, so the assistant tokens cannot be found; "
                "add {% generation %}...{% endgeneration %} markers around the assistant content in the template")
        spans.append((len(before), len(after)))
    return full, spans


def _diffed(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Mask from the prefix renderings (module docstring): tokens overlapping an assistant span, up to
    and including the span's last special token."""
    full, spans = _assistant_spans(tokenizer, messages)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    starts = [start for start, _ in encoded["offset_mapping"]]
    ends = [end for _, end in encoded["offset_mapping"]]
    special = special_ids(tokenizer)
    mask = [0] * len(ids)
    for k, (span_start, span_end) in enumerate(spans):
        first = bisect_right(ends, span_start)     # first token ending after the span starts
        last = bisect_left(starts, span_end) - 1   # last token starting before the span ends
        closers = [i for i in range(first, last + 1) if ids[i] in special]
        if not closers:
            raise ChatTemplateError(f"assistant turn {k} has no end-of-turn special token in the rendered "
                                    f"template: {full[span_start:span_end]!r}")
        for i in range(first, closers[-1] + 1):
            mask[i] = 1
    return ids, mask
