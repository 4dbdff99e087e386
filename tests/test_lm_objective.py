"""The tiny target's objective: cross-entropy as transformers computes it, and token-level
unlikelihood that pushes down exactly the tokens already seen earlier in the block."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from taps.tiny.lm_objective import lm_loss, previous_token_candidates


def test_candidates_are_earlier_targets_except_the_true_one():
    targets = torch.tensor([[3, 1, 3, 2, 1]])
    cand = previous_token_candidates(targets)  # [1, 5, 5] over earlier positions
    as_lists = [sorted(targets[0, cand[0, i]].tolist()) for i in range(5)]
    # position 2's target is 3: only 1 is a negative there; at 4, 3 counts once though it occurred twice
    assert as_lists == [[], [3], [1], [1, 3], [2, 3]]


def test_zero_weight_is_transformers_cross_entropy():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    x = torch.randint(0, 50, (3, 16))
    out = model(input_ids=x, labels=x)
    loss, parts = lm_loss(out.logits, x)
    assert torch.allclose(loss, out.loss, atol=1e-6) and set(parts) == {"ce"}


def test_unlikelihood_lowers_the_probability_of_repeating():
    torch.manual_seed(0)
    vocab = 8
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    logits = torch.zeros(1, 8, vocab, requires_grad=True)
    loss, parts = lm_loss(logits, x, unlikelihood=1.0)
    assert parts["unlikelihood"] > 0 and loss > parts["ce"]
    loss.backward()
    grad = logits.grad[0, 5]  # position 5 predicts 7 after seeing 2..6 as earlier targets
    earlier, future = [2, 3, 4, 5, 6], [0, 1]
    # an earlier token's logit is pushed down harder than a never-seen wrong token's
    assert grad[earlier].min() > grad[future].max() and grad[7] < 0


def test_repeated_ngram_mask_marks_whole_repeats_only():
    from taps.tiny.seq_unlikelihood import repeated_ngram_mask

    assert repeated_ngram_mask([1, 2, 3, 1, 2, 3], n=3) == [False] * 3 + [True] * 3
    assert repeated_ngram_mask([1, 2, 3, 1, 2, 4], n=3) == [False] * 6
    # "a a a a a": the 2-gram (a, a) at 2 repeats the one at 0 (no overlap); at 1 it overlaps, not counted
    assert repeated_ngram_mask([7, 7, 7, 7, 7], n=2) == [False, False, True, True, True]


def test_answer_prompts_end_after_the_assistant_marker():
    from taps.tiny.seq_unlikelihood import answer_prompts

    blocks = torch.tensor([[0, 4, 9, 9, 5, 1, 8, 8], [0, 4, 9, 9, 9, 9, 9, 9], [0, 4, 9, 5, 1, 8, 8, 8]])
    assert answer_prompts(blocks, assistant_id=5, rows=3, max_prompt=8) == [[0, 4, 9, 9, 5, 1], [0, 4, 9, 5, 1]]
    assert answer_prompts(blocks, assistant_id=5, rows=3, max_prompt=5) == [[0, 4, 9, 5, 1]]  # too long: skipped


def test_sequence_unlikelihood_pushes_down_the_models_own_loop():
    from taps.tiny.seq_unlikelihood import sequence_unlikelihood

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():  # a model that loops: every token predicts token 3
        model.lm_head.weight.zero_()
        model.lm_head.weight[3] = 1.0
        model.model.norm.weight.fill_(1.0)
    prompts = [[1, 2], [4, 5, 6]]
    loss, parts = sequence_unlikelihood(model, prompts, pad_id=0, stop_ids=[11], new_tokens=12)
    assert loss > 0 and parts["seq_repeat_share"] > 0.5
    loss.backward()
    assert model.lm_head.weight.grad[3].abs().sum() > 0  # the looped token's logit gets a gradient
    model.zero_grad()
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(20):
        loss, _ = sequence_unlikelihood(model, prompts, pad_id=0, stop_ids=[11], new_tokens=12)
        loss.backward()
        optim.step()
        optim.zero_grad()
    assert sequence_unlikelihood(model, prompts, pad_id=0, stop_ids=[11], new_tokens=12)[1]["seq_repeat_share"] < 0.5
