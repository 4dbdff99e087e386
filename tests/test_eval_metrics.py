"""Metrics (docs/spec.md §5) on hand-made records with known answers, and on a record of a real decode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import cached_model, prompts
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.drafter.checkpoint import init_head
from taps.eval import records as rec_mod
from taps.eval.metrics import (acceptance_by_depth, acceptance_length, accepted_length_histogram,
                               add_benchmark_average, entropy_summary, load_results, per_question_acceptance,
                               posthoc_decisions, posthoc_routing, routing_counts, routing_shares, speedup,
                               summarize, tokens_per_second, turn_routing_shares)
from taps.eval.records import (ENTROPY_BIN_EDGES, ENTROPY_BINS, RecordFormatError, TurnIdentity, check_record,
                               turn_record)
from taps.core.proposer import StepInfo
from taps.propose.routed import RoutedProposer
from taps.propose.single import SingleProposer
from taps.core.target import Target


def make(accepted=(), *, variant="v", bench="gsm8k", qid="0", turn=0, temperature=0.0, wall_s=1.0,
         new_tokens=None, drafters=(), **per_step) -> dict:
    """A record with every required field; per-step fields default to untraced (None)."""
    accepted = list(accepted)
    steps = len(accepted)
    emitted = [a + 1 for a in accepted]
    if new_tokens is not None and steps:  # a stop / budget cut shortened the last step
        emitted[-1] = new_tokens - 1 - sum(emitted[:-1])
    record = {
        "version": rec_mod.RECORD_VERSION, "variant": variant, "bench": bench, "question_id": str(qid),
        "turn": turn, "temperature": float(temperature), "category": "c", "seed": 0, "drafters": list(drafters),
        "new_tokens": 1 + sum(emitted) if new_tokens is None else new_tokens, "verifier_calls": steps + 1,
        "prompt_tokens": 10, "reused_prefix": 0, "stop_reason": "max_new_tokens", "output": "",
        "accepted": accepted, "emitted": emitted, "tree_size": [20] * steps, "source": [0] * steps,
        "step_info": [{} for _ in range(steps)],
        "sources": [1] * steps, **{k: [None] * steps for k in rec_mod.TRACED},
        "draft_entropy_hist": {"accepted": [0] * ENTROPY_BINS, "rejected": [0] * ENTROPY_BINS},
        "wall_s": wall_s, "prefill_s": 0.0, "draft_s": 0.0, "target_s": 0.0, "other_s": 0.0,
    }
    record.update(per_step)
    return check_record(record, "test")


def routed(chosen, **kw) -> dict:
    return make([1] * len(chosen), drafters=("math", "chat"),
                step_info=[{"route_chosen": c, "route_scores": None} for c in chosen], **kw)


# ---- acceptance ----------------------------------------------------------------------------------
def test_bonus_convention():
    r = make([2, 0, 3])  # the prefill's token, then 3, 1 and 4 tokens per step
    assert r["new_tokens"] == 9 and r["verifier_calls"] == 4
    assert acceptance_length([r]) == 2.25


def test_plain_decoding_scores_exactly_one():
    assert acceptance_length([make([0] * 7)]) == 1.0
    assert acceptance_length([make([])]) == 1.0  # a turn the prefill alone finished
    assert per_question_acceptance([make([0] * 3), make([0] * 5, qid="1")]) == 1.0


def test_acceptance_counts_budget_cuts_through_new_tokens():
    # the last step accepted 3 but the budget kept only 2 tokens: new_tokens, not accepted, counts
    r = make([3, 3], new_tokens=1 + 4 + 2)
    assert acceptance_length([r]) == 7 / 3


def test_pooled_and_per_question_means_differ():
    q0 = [make([3, 3], qid="0", turn=0), make([0], qid="0", turn=1)]  # 9/3 and 2/2 -> pooled 11/5
    q1 = [make([0, 0, 0], qid="1")]  # 4/4
    records = q0 + q1
    assert acceptance_length(records) == pytest.approx(15 / 9)
    assert per_question_acceptance(records) == pytest.approx((11 / 5 + 1.0) / 2)
    with pytest.raises(ValueError, match="no records"):
        acceptance_length([])


def test_acceptance_by_depth_on_a_known_histogram():
    records = [make([0, 1, 1]), make([2, 3, 3], qid="1")]
    assert accepted_length_histogram(records) == [1, 2, 1, 2]
    assert acceptance_by_depth(records) == pytest.approx([5 / 6, 3 / 5, 2 / 3])
    deeper = acceptance_by_depth(records, depth=5)
    assert deeper[:4] == pytest.approx([5 / 6, 3 / 5, 2 / 3, 0.0])
    assert math.isnan(deeper[4])  # no step reached depth 4, so alpha_5 is undefined
    assert acceptance_by_depth([make([])]) == []
    assert all(math.isnan(a) for a in acceptance_by_depth([make([])], depth=2))
    assert accepted_length_histogram([make([])]) == []


# ---- entropy -------------------------------------------------------------------------------------
def test_entropy_means_with_known_numbers():
    hist_a = {"accepted": [0] * ENTROPY_BINS, "rejected": [0] * ENTROPY_BINS}
    hist_a["accepted"][2], hist_a["rejected"][8] = 2, 4
    traced = make([2, 0, 1], draft_entropy_hist=hist_a,
                  accepted_entropy=[[0.5, 1.0], [], None],  # the third step is untraced
                  rejected_count=[3, 1, None], rejected_entropy_mean=[2.0, 4.0, None],
                  verifier_entropy_accepted=[[0.1, 0.3], [], None],
                  verifier_entropy_rejected=[0.5, None, None])  # the second step ended at a leaf
    no_rejects = make([1], qid="1", accepted_entropy=[[1.5]], rejected_count=[0], rejected_entropy_mean=[None],
                      verifier_entropy_accepted=[[0.6]], verifier_entropy_rejected=[None])
    plain = make([0, 0], variant="baseline", qid="2")
    s = entropy_summary([traced, no_rejects, plain])
    assert s["draft_entropy_accepted"] == pytest.approx(3.0 / 3) and s["n_draft_accepted"] == 3
    assert s["draft_entropy_rejected"] == pytest.approx((3 * 2.0 + 1 * 4.0) / 4) and s["n_draft_rejected"] == 4
    assert s["verifier_entropy_accepted"] == pytest.approx(1.0 / 3) and s["n_verifier_accepted"] == 3
    assert s["verifier_entropy_rejected"] == pytest.approx(0.5) and s["n_verifier_rejected"] == 1
    assert s["hist_accepted"][2] == 2 and sum(s["hist_accepted"]) == 2
    assert s["hist_rejected"][8] == 4 and sum(s["hist_rejected"]) == 4
    assert s["bin_edges"] == ENTROPY_BIN_EDGES and len(s["bin_edges"]) == ENTROPY_BINS + 1


def test_entropy_of_untraced_records_is_nan():
    s = entropy_summary([make([0, 0])])
    assert all(math.isnan(s[k]) for k in ("draft_entropy_accepted", "draft_entropy_rejected",
                                          "verifier_entropy_accepted", "verifier_entropy_rejected"))
    assert s["n_draft_accepted"] == s["n_draft_rejected"] == s["n_verifier_rejected"] == 0


# ---- routing -------------------------------------------------------------------------------------
def test_causal_routing_shares_count_steps():
    records = [routed([0, 0, 1, None]), routed([1, 1], qid="1"), make([0, 0], variant="baseline")]
    assert routing_counts(records) == {"math": 2, "chat": 3}
    assert routing_shares(records) == pytest.approx({"math": 0.4, "chat": 0.6})
    assert routing_shares(records, names=["chat", "math", "other"]) == pytest.approx(
        {"chat": 0.6, "math": 0.4, "other": 0.0})
    with pytest.raises(ValueError, match="not among names"):
        routing_shares(records, names=["math"])
    assert all(math.isnan(v) for v in routing_shares([make([1])], names=["math"]).values())
    with pytest.raises(ValueError, match="route_chosen 2"):
        routing_shares([routed([2])])


def test_per_turn_routing_shares_count_turns():
    records = [routed([0, 0, 0]), routed([1], qid="1"), routed([1, 1], qid="2"), routed([], qid="3")]
    assert turn_routing_shares(records) == pytest.approx({"math": 1 / 3, "chat": 2 / 3})
    assert routing_shares(records) == pytest.approx({"math": 0.5, "chat": 0.5})  # steps, not turns
    with pytest.raises(ValueError, match="not per-turn routed"):
        turn_routing_shares([routed([0, 1])])


def scored(head, qid, conf, ent, sizes, turn=0) -> dict:
    """A single-head record whose steps have the given tree means and sizes."""
    return make([0] * len(sizes), variant=head, qid=qid, turn=turn, tree_size=list(sizes),
                tree_confidence_mean=list(conf), tree_entropy_mean=list(ent))


@pytest.fixture
def by_head() -> dict[str, list[dict]]:
    math_records = [
        # q0: turn 0 alone would score 0.42 (node-weighted; the unweighted mean of step means is 0.6), the
        # whole generation (turn 1 too) scores (1.8 + 2.4 + 7.0) / 20 = 0.56; entropy (2 + 16 + 15) / 20 = 1.65
        scored("math", "0", [0.9, 0.3, None], [1.0, 2.0, None], [3, 9, 7]),  # the None step is untraced
        scored("math", "0", [0.7], [1.5], [11], turn=1),
        scored("math", "1", [0.7], [2.0], [5]),  # q1: ties on both signals
        scored("math", "2", [0.2], [3.0], [5]),
        scored("math", "3", [0.9], [0.1], [5]),  # q3: the other head never ran it, so it does not count
    ]
    chat_records = [
        scored("chat", "0", [0.5], [1.0], [5]),
        scored("chat", "1", [0.7], [2.0], [9]),
        scored("chat", "2", [0.6], [0.5], [5]),
    ]
    return {"math": math_records, "chat": chat_records}


def test_posthoc_table2_shares(by_head):
    conf = posthoc_decisions(by_head, "confidence")
    assert conf == {("gsm8k", 0.0, "0"): "math", ("gsm8k", 0.0, "1"): "math", ("gsm8k", 0.0, "2"): "chat"}
    assert posthoc_routing(by_head, "confidence") == pytest.approx({"math": 2 / 3, "chat": 1 / 3})
    ent = posthoc_decisions(by_head, "entropy")
    assert list(ent.values()) == ["chat", "math", "chat"]  # lowest entropy wins; the tie goes to math
    assert posthoc_routing(by_head, "entropy") == pytest.approx({"math": 1 / 3, "chat": 2 / 3})
    flipped = {"chat": by_head["chat"], "math": by_head["math"]}  # ties go to the first head
    assert posthoc_decisions(flipped, "confidence")[("gsm8k", 0.0, "1")] == "chat"
    assert posthoc_decisions(flipped, "entropy")[("gsm8k", 0.0, "1")] == "chat"


def test_posthoc_errors(by_head):
    with pytest.raises(ValueError, match="unknown routing signal"):
        posthoc_routing(by_head, "mean")
    with pytest.raises(ValueError, match="decode with trace"):
        posthoc_routing({"math": by_head["math"], "plain": [make([0], variant="plain", qid="0")]}, "confidence")
    with pytest.raises(ValueError, match="no question"):
        posthoc_routing({"math": by_head["math"], "chat": [scored("chat", "9", [0.5], [1.0], [5])]}, "confidence")


def test_posthoc_head_without_nodes_on_a_question_loses():
    heads = {"a": [scored("a", "0", [], [], []), scored("a", "1", [0.1], [9.0], [3])],
             "b": [scored("b", "0", [0.01], [9.0], [3]), scored("b", "1", [0.1], [9.0], [3])]}
    assert posthoc_decisions(heads, "confidence")[("gsm8k", 0.0, "0")] == "b"
    assert posthoc_decisions(heads, "entropy")[("gsm8k", 0.0, "0")] == "b"


# ---- speed ---------------------------------------------------------------------------------------
def test_speedup_over_the_overlap_only():
    spec = [make([2, 0, 3], qid="0", turn=0, wall_s=1.0),  # 9 tokens
            make([1], qid="0", turn=1, wall_s=0.5),  # 3 tokens
            make([5] * 20, qid="1", wall_s=1.0)]  # not in the baseline
    base = [make([0] * 8, variant="baseline", qid="0", turn=0, wall_s=3.0),
            make([0] * 2, variant="baseline", qid="0", turn=1, wall_s=1.0),
            make([0], variant="baseline", qid="2", wall_s=100.0)]  # not in the speculative run
    assert tokens_per_second(spec[:2]) == 8.0
    assert speedup(spec, base) == pytest.approx(8.0 / 3.0)
    with pytest.raises(ValueError, match="share no"):
        speedup(spec, [make([0], variant="baseline", qid="0", temperature=1.0)])


# ---- loading -------------------------------------------------------------------------------------
def write(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def test_load_results_merges_shards_and_drops_identical_duplicates(tmp_path):
    r0, r1, r2 = make([1], qid="2"), make([2], qid="0"), make([0], qid="1")
    write(tmp_path / "records.jsonl", [r0, r1])
    write(tmp_path / "shards" / "a.jsonl", [dict(r1, wall_s=9.0), r2])  # r1 merged but its shard is still there
    (tmp_path / "shards" / "b.jsonl").write_text(json.dumps(make([3], qid="3"))[:20])  # torn: skipped
    out = load_results(tmp_path)
    assert [r["question_id"] for r in out] == ["0", "1", "2"]
    assert out[0]["wall_s"] == 1.0  # records.jsonl's copy is kept


def test_load_results_rejects_conflicting_duplicates(tmp_path):
    write(tmp_path / "records.jsonl", [make([1], qid="0")])
    write(tmp_path / "shards" / "w1.jsonl", [make([2], qid="0")])
    with pytest.raises(ValueError, match="conflicting") as err:
        load_results(tmp_path)
    assert "records.jsonl" in str(err.value) and "w1.jsonl" in str(err.value)


def test_load_results_without_records(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results records"):
        load_results(tmp_path / "missing")
    (tmp_path / "shards").mkdir()
    (tmp_path / "records.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="no results records"):
        load_results(tmp_path)


def test_malformed_line_is_reported_with_its_line_number(tmp_path):
    write(tmp_path / "shards" / "s.jsonl", [make([1], qid="0"), make([1], qid="1"), "{not json", make([1], qid="2")])
    with pytest.raises(RecordFormatError, match=r"s\.jsonl: line 3"):
        load_results(tmp_path)
    bad = make([1], qid="1")
    del bad["wall_s"]
    write(tmp_path / "shards" / "s.jsonl", [make([1], qid="0"), bad])
    with pytest.raises(RecordFormatError, match=r"line 2: missing field 'wall_s'"):
        load_results(tmp_path)


# ---- tables --------------------------------------------------------------------------------------
def test_summarize_rows_and_the_benchmark_average():
    records = [
        make([0, 0, 0], variant="baseline", bench="gsm8k", qid="0", wall_s=2.0),  # 4 tokens, 2 tok/s
        make([0], variant="baseline", bench="mt_bench", qid="0", wall_s=1.0),  # 2 tokens
        make([3, 3], variant="spec", bench="gsm8k", qid="0", wall_s=1.0),  # 9 tokens over 3 calls
        make([1], variant="spec", bench="mt_bench", qid="0", turn=0, wall_s=0.5),  # 3 over 2
        make([1, 1, 1], variant="spec", bench="mt_bench", qid="0", turn=1, wall_s=1.0),  # not in the baseline
        make([2], variant="spec", bench="mt_bench", qid="1", temperature=1.0, wall_s=1.0),  # no baseline at T=1
    ]
    rows = summarize(records)
    keyed = {(r["variant"], r["bench"], r["temperature"]): r for r in rows}
    assert [(r["variant"], r["bench"], r["temperature"]) for r in rows] == sorted(keyed)
    g = keyed[("spec", "gsm8k", 0.0)]
    assert (g["questions"], g["records"], g["steps"], g["new_tokens"]) == (1, 1, 2, 9)
    assert g["acceptance_length"] == 3.0 and g["tokens_per_second"] == 9.0 and g["speedup"] == 4.5
    m = keyed[("spec", "mt_bench", 0.0)]
    assert (m["questions"], m["records"], m["steps"], m["new_tokens"]) == (1, 2, 4, 10)
    assert m["acceptance_length"] == pytest.approx(10 / 6) and m["per_question_acceptance"] == pytest.approx(10 / 6)
    assert m["speedup"] == pytest.approx((3 / 0.5) / 2.0)  # turn 1 has no baseline, so it is left out
    assert keyed[("baseline", "gsm8k", 0.0)]["speedup"] == 1.0
    assert keyed[("baseline", "gsm8k", 0.0)]["acceptance_length"] == 1.0
    assert keyed[("spec", "mt_bench", 1.0)]["speedup"] is None
    assert all(set(r) == set(rows[0]) for r in rows)  # tidy: the same columns in every row

    table = add_benchmark_average(rows)
    avg = {(r["variant"], r["temperature"]): r for r in table if r["bench"] == "average"}
    assert len(table) == len(rows) + 3
    spec0 = avg[("spec", 0.0)]
    assert spec0["acceptance_length"] == pytest.approx((3.0 + 10 / 6) / 2)  # unweighted over benchmarks
    assert spec0["speedup"] == pytest.approx((4.5 + 3.0) / 2) and spec0["new_tokens"] == 19
    assert avg[("spec", 1.0)]["speedup"] is None
    assert set(spec0) == set(rows[0])
    both = add_benchmark_average(rows, benches=["gsm8k", "mt_bench"])
    assert {(r["variant"], r["temperature"]) for r in both if r["bench"] == "average"} == {
        ("spec", 0.0), ("baseline", 0.0)}  # spec at T=1 lacks gsm8k


def test_summarize_by_other_fields():
    records = [make([1], variant="a", qid="0"), make([3], variant="a", qid="1", temperature=1.0)]
    rows = summarize(records, by=("variant",))
    assert len(rows) == 1 and rows[0]["variant"] == "a" and rows[0]["questions"] == 2
    assert rows[0]["acceptance_length"] == pytest.approx(8 / 4) and rows[0]["speedup"] is None


def test_step_info_is_written_as_records_always_held_it():
    """A record's step_info entry: only the fields its proposer reports, in the order and with the
    values records written before StepInfo hold, so earlier results directories read and resume alike."""
    assert StepInfo().as_json() == {}  # plain decoding, prompt lookup, a head with a fixed tree
    written = [
        (StepInfo(route_chosen=1, route_scores=(0.5, 0.25)), '{"route_chosen": 1, "route_scores": [0.5, 0.25]}'),
        (StepInfo(route_chosen=0), '{"route_chosen": 0, "route_scores": null}'),  # per turn, after the decision
        (StepInfo(route_chosen=1, route_scores=(2.0, 3.0), route_prior=(1.5, 1.25), route_context=0),
         '{"route_chosen": 1, "route_scores": [2.0, 3.0], "route_prior": [1.5, 1.25], "route_context": 0}'),
        (StepInfo(merge_input_sizes=(5, 7), merge_size=11), '{"merge_input_sizes": [5, 7], "merge_size": 11}'),
        (StepInfo(tree_levels=3, tree_tokens=12), '{"tree_levels": 3, "tree_tokens": 12}'),
    ]
    for info, line in written:
        assert json.dumps(info.as_json()) == line


# ---- real decodes --------------------------------------------------------------------------------
def test_record_of_a_real_decode():
    model = cached_model("llama")
    target = Target(model)
    head = init_head(model.config, seed=3).bind(target.embed_tokens, target.lm_head)
    result = generate(target, SingleProposer(head, TreeConfig(20, 4, 4)), prompts(1, seed=11)[0],
                      DecodeConfig(max_new_tokens=20, trace=True))
    record = turn_record(result, TurnIdentity(variant="single", bench="gsm8k", question_id="7", turn=0, temperature=0.0,
                                              category="math", seed=0, drafters=["single"]), output="")
    record = check_record(json.loads(json.dumps(record)), "round trip")  # what a results file gives back
    assert acceptance_length([record]) == result.acceptance_length
    assert acceptance_by_depth([record], depth=1)[0] == pytest.approx(
        sum(s.accepted >= 1 for s in result.steps) / len(result.steps))
    traces = [s.trace for s in result.steps]
    s = entropy_summary([record])
    assert s["n_draft_accepted"] == sum(len(t.accepted_entropy) for t in traces) == sum(record["accepted"])
    assert s["n_draft_rejected"] == sum(len(t.rejected_entropy) for t in traces)
    assert s["n_draft_accepted"] + s["n_draft_rejected"] == sum(n - 1 for n in record["tree_size"])
    assert s["n_verifier_accepted"] == sum(len(t.verifier_entropy_accepted) for t in traces)
    assert s["n_verifier_rejected"] == sum(t.verifier_entropy_rejected is not None for t in traces)
    assert sum(s["hist_accepted"]) == s["n_draft_accepted"] and sum(s["hist_rejected"]) == s["n_draft_rejected"]
    rejected = [e for t in traces for e in t.rejected_entropy]
    assert s["draft_entropy_rejected"] == pytest.approx(sum(rejected) / len(rejected))
    # the post-hoc score of a whole generation is the mean confidence over every logged node:
    # a rival head whose trees all score just below / above that mean loses / wins
    nodes = [c for t in traces for c in t.accepted_confidence + t.rejected_confidence]
    node_mean = sum(nodes) / len(nodes)
    for delta, winner in ((-1e-9, "single"), (1e-9, "rival")):
        rival = dict(record, variant="rival", tree_confidence_mean=[node_mean + delta] * len(traces))
        assert posthoc_decisions({"single": [record], "rival": [rival]}, "confidence") == {
            ("gsm8k", 0.0, "7"): winner}


def test_routing_shares_of_a_real_routed_decode():
    model = cached_model("llama")
    target = Target(model)
    heads = [init_head(model.config, seed=s).bind(target.embed_tokens, target.lm_head) for s in (3, 4)]
    router = RoutedProposer([SingleProposer(h, TreeConfig(12, 3, 3), drafter=i) for i, h in enumerate(heads)],
                            names=["math", "chat"])
    result = generate(target, router, prompts(1, seed=5)[0], DecodeConfig(max_new_tokens=24))
    record = turn_record(result, TurnIdentity(variant="routed", bench="mt_bench", question_id="81", turn=0,
                                              temperature=0.0, category="writing", seed=0, drafters=router.names),
                         output="")
    counts = routing_counts([record])
    assert counts == {"math": router.chosen.count(0), "chat": router.chosen.count(1)}
    assert sum(counts.values()) == len(result.steps)
    assert sum(routing_shares([record]).values()) == pytest.approx(1.0)
