"""The decode loop: greedy speculative output is token-identical to Hugging Face's own greedy
generate, for three architectures and several tree shapes, with a random head and with oracle
proposers; sampling preserves the target's distribution end to end; stop tokens, the context
window and multi-turn chat behave."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import cached_model, hf_greedy, prompts
from taps.core.config import DecodeConfig, SamplingConfig, TreeConfig
from taps.core.decode import ChatSession, ContextWindowError, Decoder, generate
from taps.drafter.checkpoint import init_head
from taps.drafter.fit import fit_linear_head, greedy_sequences
from taps.core.proposer import Proposer, StepInfo
from taps.propose.single import SingleProposer
from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.core.tree import DraftTree

SHAPES = {
    "default": TreeConfig(60, 5, 10),
    "chain": TreeConfig(60, 5, 1),
    "wide": TreeConfig(60, 2, 10),
    "deep": TreeConfig(40, 9, 3),
    "tiny-budget": TreeConfig(2, 1, 10),  # one draft node a step
}
NEW = 24


class CallbackProposer:
    """Test proposer: builds each tree from the whole sequence so far (pending token last)."""

    def __init__(self, build):
        self.build, self.seq = build, []

    def start(self, features, tokens):
        self.seq = tokens.tolist()

    def propose(self) -> DraftTree:
        return self.build(self.seq)

    def observe(self, tree, acceptance, features):
        self.seq += acceptance.new_tokens

    def step_info(self):
        return StepInfo()


def tree_from(parents, tokens):
    n = len(tokens)
    return DraftTree.drafted(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                             logp=-torch.arange(n, dtype=torch.float), entropy=torch.zeros(n), drafter=0)


def oracle_chain(reference: list[int], depth: int):
    """Proposes exactly the target's own greedy continuation."""
    def build(seq):
        nxt = reference[len(seq):len(seq) + depth]
        return tree_from(list(range(-1, len(nxt))), [seq[-1]] + nxt)
    return build


def noisy_oracle(reference: list[int], depth: int, vocab: int, seed: int):
    """The true continuation hidden among decoys, corrupted from a random depth on: accepted
    lengths vary and accepted nodes are not contiguous in the tree."""
    g = torch.Generator().manual_seed(seed)

    def build(seq):
        true = reference[len(seq):len(seq) + depth]
        cut = int(torch.randint(0, len(true) + 1, (1,), generator=g))
        parents, tokens, parent = [-1], [seq[-1]], 0
        for d, tok in enumerate(true):
            decoy = (tok + 1 + int(torch.randint(0, vocab - 1, (1,), generator=g))) % vocab
            parents.append(parent)
            tokens.append(decoy)  # a wrong sibling first
            parents.append(parent)
            tokens.append(tok if d < cut else (tok + 1) % vocab)
            parent = len(tokens) - 1
        return tree_from(parents, tokens)
    return build


def random_head_proposer(model, target, shape, seed=0):
    head = init_head(model.config, seed=seed).bind(target.embed_tokens, target.lm_head)
    return SingleProposer(head, shape)


# ---- greedy losslessness --------------------------------------------------------------------------
CASES = [(arch, shape, i) for arch in ("llama", "qwen2", "mistral") for shape in SHAPES for i in range(2)]


@pytest.mark.parametrize("arch, shape, i", CASES)
def test_greedy_random_head_is_lossless(arch, shape, i):
    model = cached_model(arch)
    target = Target(model)
    prompt = prompts(len(SHAPES) * 2, seed=sum(map(ord, arch)))[list(SHAPES).index(shape) * 2 + i]
    reference = hf_greedy(model, prompt, NEW)
    cfg = DecodeConfig(max_new_tokens=NEW)
    spec = generate(target, random_head_proposer(model, target, SHAPES[shape], seed=i), prompt, cfg)
    assert spec.tokens == reference
    assert all(s.tree_size <= SHAPES[shape].total_tokens for s in spec.steps)
    plain = generate(target, None, prompt, cfg)
    assert plain.tokens == reference and plain.acceptance_length == 1.0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_eager_attention_is_lossless(arch):
    model = cached_model(arch, "eager")
    target = Target(model)
    for prompt in prompts(2, seed=11):
        spec = generate(target, random_head_proposer(model, target, SHAPES["default"]), prompt,
                        DecodeConfig(max_new_tokens=NEW))
        assert spec.tokens == hf_greedy(model, prompt, NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("depth", [1, 3, 5])
def test_oracle_accepts_every_node(arch, depth):
    model = cached_model(arch)
    target = Target(model)
    for prompt in prompts(2, seed=depth):
        reference = prompt + hf_greedy(model, prompt, NEW)
        result = generate(target, CallbackProposer(oracle_chain(reference, depth)), prompt,
                          DecodeConfig(max_new_tokens=NEW))
        assert result.tokens == reference[len(prompt):]
        # every step accepts the whole chain (depth + 1 tokens) until the budget trims the last one
        assert [s.accepted for s in result.steps[:-1]] == [depth] * (len(result.steps) - 1)
        assert result.steps[-1].accepted == result.steps[-1].emitted - 1
        assert result.verifier_calls == 1 + math.ceil((NEW - 1) / (depth + 1))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_noisy_oracle_partial_acceptance_is_lossless(arch):
    model = cached_model(arch)
    target = Target(model)
    for j, prompt in enumerate(prompts(3, seed=21)):
        reference = prompt + hf_greedy(model, prompt, 40)
        build = noisy_oracle(reference, depth=5, vocab=model.config.vocab_size, seed=j)
        result = generate(target, CallbackProposer(build), prompt, DecodeConfig(max_new_tokens=40))
        assert result.tokens == reference[len(prompt):]
        assert len({s.accepted for s in result.steps}) >= 3  # the test did exercise partial acceptance


# ---- a reduced draft vocabulary (EAGLE-3): drafts are target ids, verification is unchanged ---------
def drafted_tokens(result) -> list[int]:
    """The accepted draft tokens of every step (each step emits its accepted drafts, then a bonus)."""
    out, at = [], 1  # tokens[0] comes from the prefill
    for s in result.steps:
        out += result.tokens[at:at + s.accepted]
        at += s.emitted
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_reduced_vocab_head_is_lossless(arch):
    """A head fitted on the target's greedy continuations, restricted to the 32 tokens most frequent
    there: output identical to plain greedy, drafts get accepted and every accepted draft is a
    target id of the draft vocabulary (the tree was mapped from draft indices). The same head over
    the 32 LEAST frequent tokens (drafts nearly always rejected) is just as lossless."""
    model = cached_model(arch)
    target = Target(model)
    g = torch.Generator().manual_seed(1)
    seqs = greedy_sequences(target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32)
    counts = torch.bincount(seqs[:, 6:].flatten(), minlength=model.config.vocab_size)  # [V]
    order = torch.sort(counts, descending=True, stable=True).indices  # [V]
    frequent, rare = order[:32].sort().values, order[-32:].sort().values
    accepted = 0
    for ids in (frequent, rare):
        head = fit_linear_head(target, seqs, seed=3).set_draft_vocab(ids)
        for prompt in prompts(4, seed=3):
            result = generate(target, SingleProposer(head, SHAPES["default"]), prompt, DecodeConfig(max_new_tokens=NEW))
            assert result.tokens == hf_greedy(model, prompt, NEW)
            drafted = drafted_tokens(result)
            assert set(drafted) <= set(ids.tolist())
            accepted += len(drafted) if ids is frequent else 0
    assert accepted >= 4  # the frequent-token head did get drafts accepted


# ---- stop tokens, window, errors ------------------------------------------------------------------
def test_stop_token_cuts_output_identically():
    model = cached_model("llama")
    target = Target(model)
    prompt = prompts(1, seed=5)[0]
    reference = prompt + hf_greedy(model, prompt, NEW)
    stop = reference[len(prompt) + 7]
    expected = reference[len(prompt):]
    expected = expected[:expected.index(stop) + 1]
    cfg = DecodeConfig(max_new_tokens=NEW, stop_token_ids=(stop,))
    for proposer in (None, CallbackProposer(oracle_chain(reference, 5))):
        result = generate(target, proposer, prompt, cfg)
        assert result.tokens == expected and result.stop_reason == "stop_token"
    assert generate(target, None, prompt, DecodeConfig(max_new_tokens=NEW)).stop_reason == "max_new_tokens"


class Hook:
    """An on_step hook that records its calls and asks to stop at call number `stop_at` (1-based;
    the prefill's first token is call 1)."""

    def __init__(self, stop_at: int | None = None):
        self.calls, self.stop_at = [], stop_at

    def __call__(self, tokens, step):
        self.calls.append((list(tokens), step))
        return len(self.calls) == self.stop_at


class CountingProposer(CallbackProposer):
    def __init__(self, build):
        super().__init__(build)
        self.observed = 0

    def observe(self, tree, acceptance, features):
        self.observed += 1
        super().observe(tree, acceptance, features)


def test_the_per_step_hook_sees_every_token_once_and_can_stop_between_steps():
    model = cached_model("llama")
    target = Target(model)
    prompt = prompts(1, seed=12)[0]
    reference = hf_greedy(model, prompt, NEW)

    def proposer():  # the same trees on every run
        return CountingProposer(noisy_oracle(prompt + reference, 4, model.config.vocab_size, seed=3))

    hook = Hook()
    full = generate(target, proposer(), prompt, DecodeConfig(max_new_tokens=NEW), on_step=hook)
    assert full.tokens == reference and full.stop_reason == "max_new_tokens"
    assert hook.calls[0] == ([reference[0]], None)  # the prefill's token, before any step
    assert [t for tokens, _ in hook.calls for t in tokens] == full.tokens  # each token once, in order
    assert [step for _, step in hook.calls[1:]] == full.steps and len(full.steps) > 3
    assert all(len(tokens) == step.emitted for tokens, step in hook.calls[1:])

    for stop_at in (1, 2, 4):  # after the prefill, after the first step, after the third
        decoder = Decoder(target, proposer())
        hook = Hook(stop_at)
        part = decoder.run(prompt, DecodeConfig(max_new_tokens=NEW), on_step=hook)
        assert part.stop_reason == "cancelled" and len(part.steps) == stop_at - 1 and len(hook.calls) == stop_at
        assert part.tokens == reference[:len(part.tokens)] == [t for tokens, _ in hook.calls for t in tokens]
        assert part.verifier_calls == stop_at
        assert decoder.proposer.observed == max(stop_at - 2, 0)  # the step that stops is not observed
        assert target.length == len(prompt) + len(part.tokens) - 1  # the cache holds exactly what was kept
        # the decoder goes on from there: the next turn reuses the cache and stays lossless
        follow = prompt + part.tokens
        assert decoder.run(follow, DecodeConfig(max_new_tokens=8), reuse_prefix=True).tokens == \
            hf_greedy(model, follow, 8)
    # asked to stop on the step that ends decoding anyway: the budget, not the hook, ended it
    ends = generate(target, proposer(), prompt, DecodeConfig(max_new_tokens=NEW), on_step=Hook(len(full.steps) + 1))
    assert ends.stop_reason == "max_new_tokens" and [s.emitted for s in ends.steps] == [s.emitted for s in full.steps]


def test_context_window_refused_before_decoding():
    model = cached_model("llama")
    target = Target(model)
    with pytest.raises(ContextWindowError, match=r"500 tokens and max_new_tokens is 20: 520 exceeds .* 512"):
        generate(target, None, [i % 300 + 1 for i in range(500)], DecodeConfig(max_new_tokens=20))
    assert target.length == 0  # nothing was decoded
    # right at the limit it works, and the tree is trimmed so no position passes the window
    head = random_head_proposer(model, target, SHAPES["deep"])
    result = generate(target, head, [i % 300 + 1 for i in range(490)], DecodeConfig(max_new_tokens=22))
    assert len(result.tokens) == 22 and target.length == 511


def test_out_of_vocabulary_prompt_is_refused():
    with pytest.raises(ValueError, match="token id 999 at index 1 is outside the target's vocabulary of 384"):
        generate(Target(cached_model("llama")), None, [1, 999], DecodeConfig(max_new_tokens=5))


def test_bad_proposer_root_is_an_error():
    model = cached_model("llama")
    target = Target(model)
    with pytest.raises(RuntimeError, match="rooted at"):
        generate(target, CallbackProposer(lambda seq: DraftTree.root_only(seq[-1] + 1)), [1, 2, 3],
                 DecodeConfig(max_new_tokens=5))


def test_step_stats_and_time_split():
    model = cached_model("llama")
    target = Target(model)
    prompt = prompts(1, seed=8)[0]
    reference = prompt + hf_greedy(model, prompt, NEW)
    result = generate(target, CallbackProposer(oracle_chain(reference, 3)), prompt, DecodeConfig(max_new_tokens=NEW))
    assert sum(s.emitted for s in result.steps) + 1 == len(result.tokens)
    assert result.acceptance_length == len(result.tokens) / result.verifier_calls
    assert all(s.credited_drafter == 0 for s in result.steps if s.accepted)
    split = result.time_split()
    assert set(split) == {"prefill_s", "draft_s", "target_s", "other_s"}
    assert all(v >= 0 for v in split.values()) and sum(split.values()) <= result.total_s + 1e-6


def test_proposers_satisfy_protocol():
    model = cached_model("llama")
    target = Target(model)
    assert isinstance(random_head_proposer(model, target, SHAPES["default"]), Proposer)
    assert isinstance(CallbackProposer(None), Proposer)


# ---- multi-turn chat ------------------------------------------------------------------------------
def test_chat_second_turn_continues_and_is_lossless(tokenizer):
    model = cached_model("qwen2")
    target = Target(model, tokenizer)
    cfg = DecodeConfig(max_new_tokens=16, stop_token_ids=target.stop_token_ids())
    replies = {}
    for name, proposer in (("plain", None), ("spec", random_head_proposer(model, target, SHAPES["default"]))):
        chat = ChatSession(target, proposer, cfg)
        first, r1 = chat.send("How many clips did Natalia sell?")
        second, r2 = chat.send("And in May?")
        assert r1.reused_prefix == 0 and r2.reused_prefix > r1.prompt_tokens // 2
        assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
        replies[name] = (r1.tokens, r2.tokens)
        # the second turn equals decoding the whole conversation from scratch
        full = tokenizer(tokenizer.apply_chat_template(chat.messages[:3], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
        assert generate(target, None, full, cfg).tokens == r2.tokens
    assert replies["plain"] == replies["spec"]


# ---- sampling end to end --------------------------------------------------------------------------
def test_sampling_is_seeded():
    model = cached_model("llama")
    target = Target(model)
    proposer = random_head_proposer(model, target, SHAPES["default"])
    cfg = lambda seed: DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(1.0), seed=seed)  # noqa: E731
    a = generate(target, proposer, [1, 2, 3], cfg(1)).tokens
    assert a == generate(target, proposer, [1, 2, 3], cfg(1)).tokens
    assert a != generate(target, proposer, [1, 2, 3], cfg(2)).tokens


SAMPLING_VOCAB = 16


def sampling_model():
    return tiny_model("llama", seed=5, vocab_size=SAMPLING_VOCAB, hidden_size=32, layers=1, heads=2, kv_heads=1,
                      intermediate=64)


def check_second_token_distribution(model, proposer, prompt, n=2000):
    """Second new token (the first one a tree verification emits) over n seeds against the exact
    marginal sum_a p(a) p(. | a); returns how many first steps accepted a draft."""
    vocab = model.config.vocab_size
    target = Target(model)

    def probs(seq):
        with torch.inference_mode():
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)

    p1 = probs(prompt)
    exact = sum(p1[a] * probs(prompt + [a]) for a in range(vocab))
    seconds, accepted, drafter = [], 0, proposer(target)
    for seed in range(n):
        result = generate(target, drafter, prompt,
                          DecodeConfig(max_new_tokens=3, sampling=SamplingConfig(1.0), seed=seed))
        seconds.append(result.tokens[1])
        accepted += result.steps[0].accepted
    counts = torch.bincount(torch.tensor(seconds), minlength=vocab).double() / n
    tv = 0.5 * float((counts - exact).abs().sum())
    bound = 0.5 * math.sqrt(2 * (vocab * math.log(2) + math.log(1e6)) / n)
    assert tv < bound
    wrong = 0.5 * exact + 0.5 * torch.nn.functional.one_hot(exact.argmax(), vocab).double()
    assert 0.5 * float((counts - wrong).abs().sum()) > 2 * bound
    return accepted


def test_sampling_end_to_end_matches_target_distribution():
    """With a drafter that proposes the target's own top tokens (so drafts are often accepted)."""
    model = sampling_model()

    def probs(seq):
        with torch.inference_mode():
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)

    def top_tokens_tree(seq):
        top = torch.topk(probs(seq), 3).indices.tolist()
        parents, tokens = [-1] + [0] * 3, [seq[-1]] + top
        for j, a in enumerate(top):  # a second level under each child
            for b in torch.topk(probs(seq + [a]), 2).indices.tolist():
                parents.append(j + 1)
                tokens.append(b)
        return tree_from(parents, tokens)

    n = 2000
    accepted = check_second_token_distribution(model, lambda target: CallbackProposer(top_tokens_tree), [3, 7, 1], n)
    assert n // 4 < accepted < n  # drafts were accepted and rejected: both paths were exercised


def test_sampling_with_a_reduced_vocab_head_matches_target_distribution():
    """An EAGLE head drafting over 6 of the 16 tokens, including the target's most likely next
    tokens and leaving out others it samples often: still the target's distribution exactly."""
    model = sampling_model()
    prompt = [3, 7, 1]
    with torch.inference_mode():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    ranked = torch.sort(p1, descending=True, stable=True).indices
    ids = torch.cat([ranked[:3], ranked[5:8]]).sort().values  # the 4th and 5th most likely are left out

    def proposer(target):
        head = init_head(model.config, seed=1).bind(target.embed_tokens, target.lm_head).set_draft_vocab(ids)
        return SingleProposer(head, TreeConfig(12, 2, 4))

    n = 2000
    accepted = check_second_token_distribution(model, proposer, prompt, n)
    assert n // 4 < accepted < n  # drafts were accepted and rejected: both paths were exercised


@pytest.mark.parametrize("signal", ["confidence", "bandit"])
def test_sampling_with_a_router_matches_target_distribution(signal):
    """Two heads routed per step, by confidence or by the learned bandit (its state shared by
    every decode here, so its choices change as it learns): still the target's distribution."""
    from taps.propose.factory import build_proposer

    model = sampling_model()
    routers = []

    def proposer(target):
        heads = {f"h{seed}": init_head(model.config, seed=seed).bind(target.embed_tokens, target.lm_head)
                 for seed in (1, 3)}
        routers.append(build_proposer("route", heads, TreeConfig(16, 2, 6), signal=signal))
        return routers[-1]

    n = 2000
    accepted = check_second_token_distribution(model, proposer, [3, 7, 1], n)
    assert n // 4 < accepted < n  # drafts were accepted and rejected: both paths were exercised
    (router,) = routers
    assert {d.chosen for d in router.decisions} == {0, 1} and {d.signal for d in router.decisions} == {signal}
    if signal == "bandit":
        # it learned from every step the decoder fed back (the last step of a decode is not)
        assert sum(arm.pulls for arms in router.state.stats.values() for arm in arms) > n // 4


def test_plain_decoder_is_reusable():
    model = cached_model("llama")
    decoder = Decoder(Target(model))
    prompt = prompts(1, seed=9)[0]
    a = decoder.run(prompt, DecodeConfig(max_new_tokens=8))
    b = decoder.run(prompt, DecodeConfig(max_new_tokens=8), reuse_prefix=True)
    assert a.tokens == b.tokens == hf_greedy(model, prompt, 8)
    assert b.reused_prefix == len(prompt) - 1
