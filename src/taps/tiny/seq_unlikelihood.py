"""Sequence-level unlikelihood (Welleck et al., 2019, section 5.2) for the tiny target.

Why: token-level unlikelihood trains on the corpus, but a greedy loop is a property of the model's
own continuations. Here the model answers questions from the batch greedily, and every token of a
4-gram that already occurred earlier in its answer is pushed down, on the answer it produced.
Greedy decoding is deterministic, so a resumed run still reaches the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeated_ngram_mask(tokens: list[int], n: int = 4) -> list[bool]:
    """Which tokens lie in an n-gram that occurred (whole) earlier in the same sequence."""
    first: dict[tuple[int, ...], int] = {}
    mask = [False] * len(tokens)
    for s in range(len(tokens) - n + 1):
        gram = tuple(tokens[s:s + n])
        if gram in first and first[gram] + n <= s:
            mask[s:s + n] = [True] * n
        first.setdefault(gram, s)
    return mask


def answer_prompts(blocks: torch.Tensor, assistant_id: int, rows: int, max_prompt: int) -> list[list[int]]:
    """Up to `rows` prompts from training blocks [B, T]: each evenly picked block up to and
    including the token after its first assistant marker (the newline that opens the answer)."""
    prompts = []
    for row in blocks[:: max(1, len(blocks) // rows)][:rows].tolist():
        if assistant_id in row:
            end = row.index(assistant_id) + 2
            if end <= min(max_prompt, len(row)):
                prompts.append(row[:end])
    return prompts


def sequence_unlikelihood(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], new_tokens: int,
                          n: int = 4) -> tuple[torch.Tensor, dict]:
    """Greedy answers to `prompts`, then -sum log(1 - p) over their tokens in repeated n-grams,
    per answer token. Returns (loss, {"seq_repeat_share": share of answer tokens penalised})."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # [B, P] left-padded
    mask = (torch.arange(width, device=device) >= torch.tensor([width - len(p) for p in prompts],
                                                                 device=device)[:, None]).long()  # [B, P]
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=pad_id)  # [B, P + K]
    model.train()
    answers = out[:, width:].tolist()
    answer_mask, penalised = [], []
    for answer in answers:  # answer tokens up to and including the first stop token
        length = next((i + 1 for i, t in enumerate(answer) if t in stop_ids), len(answer))
        answer_mask.append([True] * length + [False] * (len(answer) - length))
        penalised.append(repeated_ngram_mask(answer[:length], n) + [False] * (len(answer) - length))
    answer_mask = torch.tensor(answer_mask, device=device)  # [B, K]
    penalised = torch.tensor(penalised, device=device)  # [B, K]
    full_mask = torch.cat([mask, answer_mask.long()], dim=1)  # [B, P + K]
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=out, attention_mask=full_mask, position_ids=positions).logits  # [B, P + K, V]
    logp = F.log_softmax(logits[:, width - 1:-1].float(), dim=-1)  # [B, K, V]: predicts each answer token
    logp_taken = logp.gather(2, out[:, width:].unsqueeze(2)).squeeze(2)  # [B, K]
    one_minus_p = (1.0 - logp_taken.exp()).clamp_min(1e-5)
    tokens = answer_mask.sum().clamp_min(1)
    loss = -(torch.log(one_minus_p) * penalised).sum() / tokens
    return loss, {"seq_repeat_share": float(penalised.sum() / tokens)}
