"""The learned router (propose/bandit.py): the bandit converges to the better head on a synthetic
reward, uses the confidence prior before any reward, is deterministic given the rewards' seed,
keeps its statistics per context, and its state rebuilt from records equals the live one; decoding
through it, it learns across conversations to overrule an overconfident head."""

from __future__ import annotations

import random

import pytest

from conftest import hf_greedy, prompts
from taps.core.config import DecodeConfig
from taps.core.decode import generate
from taps.propose.bandit import BanditRouter, BanditState, expected_tokens
from taps.propose.factory import HeadPool, build_proposer
from taps.propose.single import SingleProposer
from taps.propose.spec import parse_spec
from test_compose_decode import TREE
from test_compose_decode import setup as heads_of


def synthetic(seed: int, true=(2.0, 3.0), prior=(3.0, 2.0), n: int = 300, noise: float = 0.5) -> tuple[list, BanditState]:
    """n decisions of a bandit over two heads whose pulls earn `true` tokens per call on average
    (Gaussian noise, rounded to whole accepted tokens), while the prior says the opposite."""
    rng = random.Random(seed)
    state = BanditState(["a", "b"], depth=5)
    chosen = []
    for _ in range(n):
        context, arm, _ = state.choose(prior)
        chosen.append(arm)
        pull = state.pull(context, arm)
        for _ in range(4):  # four verified steps per pull
            pull.step(round(min(5.0, max(0.0, rng.gauss(true[arm] - 1, noise)))))
    return chosen, state


def test_it_converges_to_the_better_head_against_its_prior():
    chosen, state = synthetic(seed=0)
    assert chosen[0] == 0  # the prior's favourite first
    assert sum(chosen[-100:]) >= 95  # then, nearly always, the head that earns more
    (stats,) = state.stats.values()  # one context: the prior favours the same head every time
    assert stats[1].pulls > 4 * stats[0].pulls
    rows = {r["head"]: r for r in state.summary()}
    assert rows["b"]["tokens_per_call"] == pytest.approx(3.0, abs=0.15)
    assert rows["a"]["tokens_per_call"] == pytest.approx(2.0, abs=0.3)
    close, _ = synthetic(seed=0, true=(2.0, 2.5))  # a smaller gap takes longer, and gets there
    assert sum(close[-100:]) >= 75


@pytest.mark.parametrize("prior", [(1.5, 4.0, 2.0), (3.0, 1.0, 3.0), (2.0, 2.0, 2.0)])
def test_the_prior_decides_before_any_reward(prior):
    state = BanditState(["a", "b", "c"], depth=5)
    context, arm, index = state.choose(prior)
    favourite = max(range(3), key=lambda i: prior[i])  # the first on ties, as the confidence router
    assert arm == context == favourite
    assert [round(i, 9) for i in index] == [round((p - 1) / 5, 9) for p in prior]  # no bonus yet: the prior alone


def test_decisions_are_deterministic_given_the_seed():
    assert synthetic(seed=7)[0] == synthetic(seed=7)[0]
    assert synthetic(seed=7)[0] != synthetic(seed=8)[0]


def test_statistics_are_kept_per_context():
    state = BanditState(["a", "b"], depth=4)
    context, arm, _ = state.choose((3.0, 1.0))
    state.pull(context, arm).step(3)
    assert set(state.stats) == {0}
    other = state.choose((1.0, 3.0))  # requests the prior calls "b": nothing learned there yet
    assert other[:2] == (1, 1)
    running = state.pull(0, 1)
    for accepted in (0, 4, 2):  # one pull, three steps: one rewarded pull of mean 3 tokens per call
        running.step(accepted)
    assert state.stats[0][1].pulls == 1 and state.stats[0][1].mean == pytest.approx((3 - 1) / 4)
    with pytest.raises(ValueError, match="3 prior scores for 2 heads"):
        state.choose((1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="depth"):
        BanditState(["a"], depth=0)


def test_decoding_learns_to_overrule_an_overconfident_head_and_stays_lossless():
    """`sharp` (a random head made far more confident) wins every confidence decision and is
    seldom accepted; the bandit starts where the confidence router is, then learns, across
    conversations, that the fitted head earns more."""
    model, target, heads = heads_of("llama")
    names = ["sharp", "fit-a"]
    members = {n: heads[n] for n in names}
    state = BanditState(names, TREE.depth)
    cfg = DecodeConfig(max_new_tokens=24)
    confidence_accepted, bandit_accepted, bandit_chosen = 0, 0, []
    for k, prompt in enumerate(prompts(12, seed=3)):
        router = build_proposer("route", members, TREE, granularity="turn")
        confidence_accepted += sum(s.accepted for s in generate(target, router, prompt, cfg).steps)
        assert router.decisions[0].chosen == 0
        bandit = BanditRouter([SingleProposer(heads[n], TREE, drafter=i) for i, n in enumerate(names)], state,
                              per_turn=True, names=names)
        result = generate(target, bandit, prompt, cfg)
        assert result.tokens == hf_greedy(model, prompt, 24)
        (decision,) = bandit.decisions
        assert decision.signal == "bandit" and decision.context == 0  # the prior favours sharp every time
        assert decision.prior[0] > decision.prior[1]
        if k == 0:
            assert decision.chosen == 0 and decision.scores[0] > decision.scores[1]  # the prior, before any reward
        assert bandit.step_info().route_chosen == decision.chosen
        bandit_chosen.append(decision.chosen)
        bandit_accepted += sum(s.accepted for s in result.steps)
    assert sum(bandit_chosen) >= 3 and bandit_accepted > confidence_accepted


def test_records_replay_to_the_live_state_and_the_pool_keeps_one_per_variant():
    """What a resumed `taps eval` does: the records' decisions and accepted tokens rebuild the state."""
    from taps.eval.records import TurnIdentity, turn_record

    _, target, heads = heads_of("llama")
    spec = parse_spec("learned", "route-bandit-step:sharp=S,fit-a=F")
    pool = HeadPool(target)
    pool._heads.update({pool_key(p): heads[n] for n, p in (("sharp", "S"), ("fit-a", "F"))})
    live = pool.bandit(spec, TREE)
    records = []
    for prompt in prompts(4, seed=5):
        proposer = pool.proposer(spec, TREE)
        assert isinstance(proposer, BanditRouter) and proposer.state is live  # one state per variant, shared
        result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=16))
        records.append(turn_record(result, TurnIdentity(variant="learned", bench="b", question_id=str(len(records)),
                                                        turn=0, temperature=0.0, category="", seed=0,
                                                        drafters=spec.member_names), output=""))
        assert all(info["route_context"] in (0, 1) and len(info["route_prior"]) == 2 for info in records[-1]["step_info"])
    rebuilt = BanditState(spec.member_names, TREE.depth)
    assert rebuilt.replay(records) == sum(len(r["step_info"]) for r in records)  # one decision per step
    assert rebuilt.stats == live.stats and rebuilt.stats
    other = parse_spec("other", "route-bandit-step:sharp=S,fit-a=F")
    assert pool.bandit(other, TREE) is not live and pool.bandit(parse_spec("c", "route:S,F"), TREE) is None
    pool.forget(spec)
    assert pool.bandit(spec, TREE) is not live


def pool_key(path: str) -> str:
    from pathlib import Path

    return str(Path(path).resolve())


def test_expected_tokens_is_one_plus_the_summed_confidences():
    _, target, heads = heads_of("llama")
    import torch

    proposer = SingleProposer(heads["fit-a"], TREE)
    prompt = prompts(1, seed=2)[0]
    features = target.encode(torch.tensor([prompt]))[0]
    proposer.start(features[:-1], torch.tensor(prompt))
    tree = proposer.propose()
    assert expected_tokens(tree) == pytest.approx(1 + float(tree.logp[1:].exp().sum()))
    assert 1.0 < expected_tokens(tree) <= 1 + TREE.depth + 1e-4  # at most one node per level is accepted
