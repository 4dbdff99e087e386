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
