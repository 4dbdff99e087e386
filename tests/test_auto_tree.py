"""Cost-aware trees (`--tree auto`): the policy's arithmetic on hand-made costs, its calibration,
and greedy identity of decoding with it (any tree is verified by the same lossless rule)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cached_model, hf_greedy, prompts
from taps.core.config import DecodeConfig, SpeculationConfig, TreeConfig
from taps.core.decode import generate
from taps.drafter.auto_tree import AutoTree, Calibration, StepCosts
from taps.drafter.fit import fit_linear_head, greedy_sequences
from taps.core.proposer import StepInfo
from taps.propose.factory import build_proposer
from taps.propose.single import SingleProposer
from taps.core.target import Target

FLAT = StepCosts(verify_ms={1: 10.0, 128: 10.0}, level_ms={1: 1.0, 16: 1.0})  # a GPU-like machine
STEEP = StepCosts(verify_ms={1: 10.0, 2: 20.0, 128: 1280.0}, level_ms={1: 1.0, 16: 1.0})  # every token costs a forward


def test_costs_interpolate_and_extrapolate():
    costs = StepCosts(verify_ms={1: 10.0, 16: 25.0, 64: 73.0}, level_ms={4: 2.0})
    assert costs.verify(1) == 10.0 and costs.verify(8.5) == pytest.approx(17.5) and costs.verify(96) == pytest.approx(105.0)
    assert costs.level(10) == 2.0


def test_cheap_verification_keeps_every_useful_node_and_steep_keeps_none():
    scores = torch.log(torch.tensor([0.9, 0.8, 0.5, 0.1, 0.01]))
    flat, steep = AutoTree(FLAT, top_k=4), AutoTree(STEEP, top_k=4)
    assert flat.tree_tokens(scores, levels=2, max_tokens=64) == 6  # verification is free: keep all five
    assert flat.tree_tokens(scores, levels=2, max_tokens=3) == 3  # the cap holds
    # a node adds at most one expected token for a whole forward's cost: nothing pays
    assert steep.tree_tokens(scores, levels=2, max_tokens=64) == 1
    assert flat.chosen == [(2, 6), (2, 3)] and steep.chosen == [(2, 1)]


def test_go_deeper_only_while_the_beams_can_pay():
    policy = AutoTree(FLAT, top_k=2)
    drafted = torch.log(torch.tensor([0.95, 0.9]))
    assert policy.go_deeper(drafted, beam_scores=torch.log(torch.tensor([0.95, 0.9])), levels=1)
    assert not policy.go_deeper(drafted, beam_scores=torch.log(torch.tensor([1e-4, 1e-4])), levels=1)


def test_calibration_learns_the_measured_acceptance():
    cal = Calibration(prior=4.0)
    c = torch.full((200,), 0.5)
    assert float(cal(c[:1])) == pytest.approx(0.5, abs=0.1)  # the prior: a(c) ~ c
    cal.update(c, torch.zeros(200, dtype=torch.bool))  # a head whose 0.5-confident nodes never pass
    assert float(cal(c[:1])) < 0.05
    assert float(cal(torch.tensor([0.001]))) == pytest.approx(0.001, rel=0.5)  # other bins untouched


def setup_llama():
    model = cached_model("llama")
    target = Target(model)
    g = torch.Generator().manual_seed(1)
    data = greedy_sequences(target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32)
    return model, target, fit_linear_head(target, data, seed=3)


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
def test_decoding_with_auto_trees_is_lossless_and_logs_its_choices(costs):
    model, target, head = setup_llama()
    caps = TreeConfig(total_tokens=32, depth=6, top_k=4)
    for prompt in prompts(4, seed=3):
        policy = AutoTree(costs, top_k=caps.top_k)
        result = generate(target, SingleProposer(head, caps, policy=policy), prompt, DecodeConfig(max_new_tokens=20))
        assert result.tokens == hf_greedy(model, prompt, 20)
        assert len(policy.chosen) == len(result.steps)
        for (levels, tokens), step in zip(policy.chosen, result.steps):
            assert 1 <= levels <= caps.depth and 1 <= tokens <= caps.total_tokens
            assert step.info == StepInfo(tree_levels=levels, tree_tokens=tokens) and step.tree_size <= tokens
        if costs is STEEP:
            assert all(tokens == 1 for _, tokens in policy.chosen)  # nothing pays: plain decoding
        assert policy.calibration.seen.sum() > 16 * 4.0 or costs is STEEP  # verified nodes were counted


def test_compositions_take_one_policy_per_head():
    model, target, head = setup_llama()
    made = []

    def factory():
        made.append(AutoTree(FLAT, top_k=4))
        return made[-1]

    proposer = build_proposer("merge", {"a": head, "b": head}, TreeConfig(32, 6, 4), merge_mode="budget",
                              policy=factory)
    prompt = prompts(2, seed=5)[1]
    result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=16))
    assert result.tokens == hf_greedy(model, prompt, 16) and len(made) == 2
    # heads alone keep the budget merge of their own policy-sized trees: no lookup to price against
    assert proposer.first == () and proposer.brief is None and proposer.observe_merge is None


def test_cli_tree_auto(target_dir, tmp_path, monkeypatch, capsys):
    from taps.cli.main import main

    monkeypatch.setenv("TAPS_CACHE_DIR", str(tmp_path))
    head = tmp_path / "head"
    assert main(["drafter", "init", "--target", str(target_dir), "--out", str(head)]) == 0
    base = ["generate", "--target", str(target_dir), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
            "--device", "cpu", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(base + ["--drafter", str(head), "--tree", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert auto["token_ids"] == plain["token_ids"]
    assert all({"tree_levels", "tree_tokens"} <= set(info) for info in auto["step_info"])
    assert list((tmp_path / "profiles").glob("*.json"))  # the costs were measured and cached
    assert main(base + ["--drafter", "lookup", "--tree", "auto"]) == 2
    assert "--tree auto sizes the trees of EAGLE heads" in capsys.readouterr().err


def test_eval_and_study_configs_take_auto_trees(target_dir, tmp_path, monkeypatch):
    from taps.eval.benchmarks import Question
    from taps.eval.records import read_records
    from taps.eval.runner import EvalSettings, ResultsMismatchError, run_eval
    from taps.study import StudyConfigError, study_from_dict
    from taps.propose.spec import parse_variant
    from taps.drafter.checkpoint import write_untrained

    monkeypatch.setenv("TAPS_CACHE_DIR", str(tmp_path / "cache"))
    head = write_untrained(target_dir, tmp_path / "head")
    target = Target.load(target_dir, device="cpu", dtype="float32")
    variants = [parse_variant("base=baseline"), parse_variant(f"one={head}"), parse_variant(f"mix=merge-budget:h={head},lookup")]
    questions = [Question("toy", "1", "x", ("hello there",))]
    auto = EvalSettings(max_new_tokens=8, speculation=SpeculationConfig(TreeConfig(32, 6, 4), "auto"), warmup=False)
    run_eval(target, str(target_dir), variants, questions, tmp_path / "out", auto, progress=False)
    records = read_records(tmp_path / "out" / "records.jsonl")
    assert {r["variant"] for r in records} == {"base", "one", "mix"}
    assert json.loads((tmp_path / "out" / "run.json").read_text())["tree_mode"] == "auto"
    fixed = EvalSettings(max_new_tokens=8, speculation=SpeculationConfig(TreeConfig(32, 6, 4)), warmup=False)
    with pytest.raises(ResultsMismatchError):  # one results directory keeps one tree mode
        run_eval(target, str(target_dir), variants, questions, tmp_path / "out", fixed, progress=False)
    config = {"name": "t", "out": str(tmp_path / "s"), "target": {"path": str(target_dir)},
              "drafters": {"out": str(tmp_path)}, "variants": {"base": "baseline"},
              "eval": {"tree": {"total_tokens": 32, "depth": 6, "top_k": 4, "mode": "auto"}}}
    assert study_from_dict(config).settings.speculation == SpeculationConfig(TreeConfig(32, 6, 4), "auto")
    config["eval"]["tree"]["mode"] = "dynamic"
    with pytest.raises(StudyConfigError, match="eval.tree.mode must be fixed or auto"):
        study_from_dict(config)


def test_noisy_costs_are_made_monotone_and_real_dips_kept():
    costs = StepCosts(verify_ms={1: 80.0, 8: 78.0, 16: 90.0}, level_ms={1: 5.0, 8: 4.0})
    assert costs.verify(8) == 80.0 and costs.verify(4) == 80.0 and costs.verify(16) == 90.0  # 2.5 %: noise
    assert costs.level(8) == 5.0  # more beams never cost less
    # a CPU whose matmuls favour multiples of 4 rows: 3 tree tokens cost more than 4
    costs = StepCosts(verify_ms={1: 60.0, 2: 96.0, 3: 117.0, 4: 84.0, 5: 112.0}, level_ms={1: 5.0})
    assert [costs.verify(n) for n in range(1, 6)] == [60.0, 96.0, 117.0, 84.0, 117.0]


def test_trees_are_sized_to_the_row_counts_that_run_fast():
    """The best prefix reads a real dip as what it is: more nodes for less time."""
    measured = {1: 60.0, 2: 96.0, 3: 117.0, 4: 84.0, 5: 130.0}
    fast4 = AutoTree(StepCosts(verify_ms=measured, level_ms={1: 1.0, 16: 1.0}), top_k=4)
    flat4 = AutoTree(StepCosts(verify_ms={**measured, 4: 120.0}, level_ms={1: 1.0, 16: 1.0}), top_k=4)
    scores = torch.log(torch.tensor([0.4, 0.3, 0.2]))  # ~0.42 + 0.24 + 0.24 expected tokens (the prior)
    # three nodes in a 4-token forward pay (1.9 tokens in 85 ms against 1 in 61); at 121 ms nothing does
    assert fast4.tree_tokens(scores, levels=1, max_tokens=64) == 4
    assert flat4.tree_tokens(scores, levels=1, max_tokens=64) == 1


def _chain(tokens, probs, drafter):
    """A one-path tree under root 0 whose nodes have these confidences."""
    from taps.core.tree import DraftTree

    n = len(tokens)
    return DraftTree.drafted(tokens=torch.tensor([0] + tokens), parents=torch.tensor([-1] + list(range(n))),
                             logp=torch.log(torch.tensor([1.0] + probs)), entropy=torch.zeros(n + 1), drafter=drafter)


def test_a_budget_merge_under_auto_trees_adds_lookup_nodes_only_where_they_pay():
    from taps.drafter.auto_tree import merge_budget_by_cost
    from taps.core.tree import merge_budget

    head = _chain([5, 6, 7], [0.9, 0.6, 0.2], drafter=0)  # 6, 7: priced by policy.alone (fresh: a(c) = c)
    lookup = _chain([5, 8, 9, 10], [0.8, 0.5, 0.3, 0.001], drafter=1)  # shares node 5 with the head
    flat = merge_budget_by_cost([head, lookup], 32, AutoTree(FLAT, top_k=4), sized=0b01)
    assert flat.tokens.tolist() == merge_budget([head, lookup], 32).tokens.tolist()  # free nodes: all of them
    # verification that costs 1 ms per tree token past the first: a node pays once its expected
    # tokens beat (expected so far) / (time so far) per ms
    linear = StepCosts(verify_ms={1: 10.0, 128: 137.0}, level_ms={1: 1.0, 16: 1.0})
    cut = merge_budget_by_cost([head, lookup], 32, AutoTree(linear, top_k=4), sized=0b01)
    paths = sorted(tuple(p) for p in _paths(cut))
    assert (5, 6, 7) in paths and (5, 8, 9) in paths and (5, 8, 9, 10) not in paths
    steep = merge_budget_by_cost([head, lookup], 32, AutoTree(STEEP, top_k=4), sized=0b01)
    assert steep.tokens.tolist() == [0, 5]  # only the node both proposed: kept whatever it costs
    assert merge_budget_by_cost([head, lookup], 3, AutoTree(FLAT, top_k=4), sized=0b01).size == 3  # the cap holds


def test_a_budget_merge_prices_the_nodes_only_the_head_proposed_by_what_they_earned_in_merges():
    """The head's own nodes that lookup did not propose are priced by `policy.alone`, which
    observe_budget_merge teaches from each verified step over the members' uncut trees: once
    such nodes keep missing, the merge cuts them; the nodes both proposed stay, and the cut set
    is closed under parents."""
    from taps.drafter.auto_tree import merge_budget_by_cost, observe_budget_merge

    linear = StepCosts(verify_ms={1: 10.0, 128: 137.0}, level_ms={1: 1.0, 16: 1.0})
    head = _chain([5, 6, 7], [0.9, 0.6, 0.5], drafter=0)
    lookup = _chain([5, 8], [0.8, 0.5], drafter=1)
    policy = AutoTree(linear, top_k=4)
    fresh = merge_budget_by_cost([head, lookup], 32, policy, sized=0b01)
    assert sorted(tuple(p) for p in _paths(fresh)) == [(5, 6, 7), (5, 8)]
    for _ in range(20):  # the target takes lookup's path every time: 6 and 7 miss, 5 and 8 are accepted
        observe_budget_merge([head, lookup], [5, 8, 3], policy, sized=0b01)
    hits = policy.alone(torch.tensor([0.6, 0.5], dtype=torch.float64))
    assert hits.max() < 0.2  # from the a(c) = c it started at
    assert policy.calibration.seen.sum() == Calibration().seen.sum()  # the head's own calibration untouched
    cut = merge_budget_by_cost([head, lookup], 32, policy, sized=0b01)
    assert sorted(tuple(p) for p in _paths(cut)) == [(5, 8)]
    for _ in range(60):  # now the head's path is the one taken (7 by the bonus): its nodes come back
        observe_budget_merge([head, lookup], [5, 6, 7], policy, sized=0b01)
    assert sorted(tuple(p) for p in _paths(merge_budget_by_cost([head, lookup], 32, policy, sized=0b01))) == \
        [(5, 6, 7), (5, 8)]


def test_a_head_in_a_budget_merge_sizes_its_tree_over_what_lookup_already_offers():
    """brief_sized_members hands the heads' policies the expected tokens and node count of the
    model-free members' best-paying share; a head's node must then raise the rate of the whole
    merged tree, so beside a confident lookup chain the head keeps fewer nodes and stops drafting
    sooner; with nothing from lookup it sizes its tree as if alone."""
    from taps.drafter.auto_tree import brief_sized_members

    linear = StepCosts(verify_ms={1: 10.0, 128: 137.0}, level_ms={1: 1.0, 16: 1.0})
    policy = AutoTree(linear, top_k=4)
    scores = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.1]))
    alone = policy.tree_tokens(scores, 2, 32)
    lookup = _chain([5, 8, 9, 10, 11, 12], [0.95, 0.9, 0.85, 0.8, 0.75, 0.7], drafter=1)
    brief_sized_members([lookup], policies=[policy])
    assert policy.given[1] == 6 and policy.given[0] == pytest.approx(4.95)  # every node pays at 1 ms a token
    beside = policy.tree_tokens(scores, 2, 32)
    assert 1 < beside < alone
    beams = torch.log(torch.tensor([0.3, 0.2]))
    assert not policy.go_deeper(scores, beams, 2)
    brief_sized_members([], policies=[policy])
    assert policy.given == (0.0, 0) and policy.tree_tokens(scores, 2, 32) == alone
    assert policy.go_deeper(scores, beams, 2)
    brief_sized_members([lookup], 900, policies=[policy])  # the step's context, as lookup drafted at it
    assert policy.context == 900


def test_a_heads_calibration_counts_a_dropped_node_the_target_agreed_with():
    """A budget merge's cut, the decoder's depth trim or a router may leave a head's node out of the
    verified tree; if the target's next token (the bonus) is that node's token, the head's
    calibration counts it as accepted, not as a miss (a verified node never matches the bonus)."""
    from taps.core.verify import Acceptance

    model, target, head = setup_llama()
    proposer = SingleProposer(head, TreeConfig(16, 4, 4), policy=AutoTree(FLAT, top_k=4))
    prompt = prompts(1, seed=8)[0]
    features = target.encode(torch.tensor([prompt]))[0]
    proposer.start(features[:-1], torch.tensor(prompt))
    tree = _chain([5, 6, 7], [0.9, 0.8, 0.7], drafter=0)
    before = proposer.policy.calibration.hits.sum().item()
    accepted = Acceptance(nodes=torch.tensor([0, 1]), tokens=torch.tensor([0, 5]), bonus=6)  # node 2 was dropped
    proposer.observe(tree, accepted, features[-2:])
    assert proposer.policy.calibration.hits.sum().item() - before == pytest.approx(2.0)  # 5, and 6 by the bonus


def _paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    leaves = set(range(1, tree.size)) - set(parents)
    for leaf in leaves:
        path, node = [], leaf
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        yield path[::-1]


def test_head_and_lookup_merged_by_cost_decode_losslessly():
    from taps.propose.factory import LookupSpec

    model, target, head = setup_llama()
    linear = StepCosts(verify_ms={1: 10.0, 128: 137.0}, level_ms={1: 1.0, 16: 1.0})
    for costs in (FLAT, linear, STEEP):
        proposer = build_proposer("merge", {"head": head, "lookup": LookupSpec()}, TreeConfig(32, 6, 4),
                                  merge_mode="budget", policy=lambda costs=costs: AutoTree(costs, top_k=4))
        prompt = prompts(2, seed=9)[0] * 2  # a repeat, so prompt lookup has something to offer
        result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=24))
        assert result.tokens == hf_greedy(model, prompt, 24)
        assert proposer.first == (1,)  # lookup drafts first, and the head hears what it offers
        if costs is FLAT:  # (this tiny head drafts nothing where tokens cost more)
            # the verified steps taught the merge what the head's nodes alone are worth
            assert proposer.proposers[0].policy.alone.seen.sum() > Calibration().seen.sum()


def test_a_priced_budget_merge_lets_lookup_chains_run_past_the_heads_depth_cap():
    """Under --tree auto a budget merge prices every lookup node, so its lookup member drafts up to
    AUTO_LOOKUP_DEPTH levels (and AUTO_STORE_NODES datastore nodes); a prompt that repeats a long
    span then gets steps that accept more than the heads' depth cap, still token for token greedy."""
    from taps.propose.factory import AUTO_LOOKUP_DEPTH, AUTO_STORE_NODES, LookupSpec

    model, target, head = setup_llama()
    caps = TreeConfig(32, 4, 4)
    members = {"head": head, "lookup": LookupSpec()}
    priced = build_proposer("merge", members, caps, merge_mode="budget", policy=lambda: AutoTree(FLAT, top_k=4))
    lookup = priced.proposers[1]
    assert lookup.tree.depth == min(AUTO_LOOKUP_DEPTH, caps.total_tokens - 1) > caps.depth
    assert lookup.store_nodes == max(LookupSpec().store_nodes, AUTO_STORE_NODES)
    for strategy, mode, policy in (("merge", "trie", lambda: AutoTree(FLAT, top_k=4)), ("merge", "budget", None),
                                   ("route", "disjoint", lambda: AutoTree(FLAT, top_k=4))):
        other = build_proposer(strategy, members, caps, merge_mode=mode, policy=policy)  # verified whole: caps kept
        assert other.proposers[1].tree.depth == caps.depth and other.proposers[1].store_nodes == LookupSpec().store_nodes
    prompt = prompts(1, seed=3)[0][:12] * 4  # a 12-token span repeated: prompt lookup can copy it whole
    result = generate(target, priced, prompt, DecodeConfig(max_new_tokens=40))
    assert result.tokens == hf_greedy(model, prompt, 40)
    assert max(s.accepted for s in result.steps) > caps.depth  # a step the old cap could not have accepted


# ---- the verify cost at the step's committed context ----------------------------------------------
BY_CONTEXT = StepCosts(verify_ms={1: 10.0, 64: 20.0}, level_ms={1: 1.0, 16: 1.0},
                       verify_by_context={128: {1: 10.0, 16: 11.0, 64: 14.0}, 1024: {1: 10.0, 16: 30.0, 64: 90.0}})


def test_costs_at_a_context_interpolate_between_the_measured_ones():
    assert BY_CONTEXT.at(128).verify(16) == pytest.approx(11.0)
    assert BY_CONTEXT.at(576).verify(16) == pytest.approx(20.5)  # half way from 128 to 1024
    assert BY_CONTEXT.at(1920).verify(16) == pytest.approx(49.0)  # linear past the last two
    assert BY_CONTEXT.at(100) is BY_CONTEXT.at(120)  # one bucket of 64 tokens: one table
    assert FLAT.at(5000) is FLAT  # no measurement by context: the costs themselves
    profile = {"target_forward_ms": {"1": 10.0}, "draft_level_ms": {"1": 1.0},
               "verify_ms_by_context": {"128": {"1": 10.0, "16": 11.0}}}
    assert StepCosts.from_profile(profile).verify_by_context == {128: {1: 10.0, 16: 11.0}}


def test_long_contexts_get_smaller_trees():
    scores = torch.log(torch.tensor([0.9, 0.6, 0.5, 0.45, 0.4, 0.3, 0.3, 0.2, 0.2, 0.1]))
    short, long_ = AutoTree(BY_CONTEXT, top_k=4, context=128), AutoTree(BY_CONTEXT, top_k=4, context=1024)
    assert short.tree_tokens(scores, levels=3, max_tokens=64) > long_.tree_tokens(scores, levels=3, max_tokens=64)


def test_the_proposer_tells_its_policy_the_context():
    model, target, head = setup_llama()
    seen = []

    class Recording(AutoTree):
        def tree_tokens(self, scores, levels, max_tokens):
            seen.append((self.context, target.length))
            return super().tree_tokens(scores, levels, max_tokens)

    prompt = prompts(1, seed=8)[0]
    generate(target, SingleProposer(head, TreeConfig(16, 4, 4), policy=Recording(BY_CONTEXT, top_k=4)), prompt,
             DecodeConfig(max_new_tokens=12))
    assert seen and all(context == length for context, length in seen)
    assert seen[0][0] == len(prompt) and seen[-1][0] > seen[0][0]  # the prompt is committed, then the answer grows


# ---- a lookup drafter verified alone: its tree cut by cost ------------------------------------------
def test_a_lookup_tree_verified_alone_keeps_the_nodes_that_pay():
    from taps.drafter.auto_tree import size_by_cost

    chain = _chain([5, 8, 9, 10], [0.8, 0.5, 0.3, 0.001], drafter=0)  # exp(score): the nodes' acceptance
    assert size_by_cost(chain, AutoTree(FLAT, top_k=4)).size == 5  # free nodes: all of them
    linear = StepCosts(verify_ms={1: 10.0, 128: 137.0}, level_ms={1: 1.0, 16: 1.0})  # +1 ms per tree token
    policy = AutoTree(linear, top_k=4)
    # expected tokens / ms: 1/10, 1.8/11, 2.3/12, 2.6/13 (best), 2.601/14
    assert size_by_cost(chain, policy).tokens.tolist() == [0, 5, 8, 9]
    assert policy.chosen[-1] == (0, 4)
    assert size_by_cost(chain, AutoTree(STEEP, top_k=4)).size == 1  # every node costs a forward: plain step
    assert size_by_cost(_chain([], [], drafter=0), policy).size == 1 and policy.chosen[-1] == (0, 1)


def test_lookup_alone_under_auto_trees_drafts_deep_cuts_by_cost_and_stays_lossless():
    """A single lookup drafter with a policy: chains up to AUTO_LOOKUP_DEPTH levels, each tree cut
    by the costs at the step's context, greedy output token for token the library's."""
    from taps.propose.factory import AUTO_LOOKUP_DEPTH, LookupSpec
    from taps.propose.lookup import LookupProposer

    model, target, _ = setup_llama()
    caps = TreeConfig(32, 4, 4)
    prompt = prompts(1, seed=3)[0][:12] * 4  # a 12-token span repeated: prompt lookup can copy it whole
    reference = hf_greedy(model, prompt, 40)
    linear = StepCosts(verify_ms={1: 10.0, 128: 137.0}, level_ms={1: 1.0, 16: 1.0})
    sizes = []
    for costs in (FLAT, linear, STEEP):
        proposer = build_proposer("single", {"lookup": LookupSpec()}, caps, policy=lambda c=costs: AutoTree(c, top_k=4))
        assert isinstance(proposer, LookupProposer) and proposer.tree.depth == min(AUTO_LOOKUP_DEPTH, 31)
        result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=40))
        assert result.tokens == reference
        assert proposer.policy.context > len(prompt)  # told the step's context
        sizes.append(max(s.tree_size for s in result.steps))
        # the size it chose, reported (the decoder trims a tree's depth near the answer's end)
        assert all(s.tree_size <= s.info.tree_tokens for s in result.steps)
        assert result.steps[0].tree_size == result.steps[0].info.tree_tokens
    flat, linear_, steep = sizes
    assert steep == 1 < linear_ <= flat  # dearer verification, smaller trees
    fixed = build_proposer("single", {"lookup": LookupSpec()}, caps)  # no policy: the caps, filled
    assert fixed.policy is None and fixed.tree.depth == caps.depth
