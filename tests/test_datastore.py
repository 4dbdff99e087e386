"""The lookup drafter's datastore (REST retrieval, propose/rest.py; built by data/datastore.py):
the index and its most-frequent-continuation tries, the lookup tree that merges prompt lookup with
the datastore, the build / load round trip through `taps lookup build`, and losslessness alone and
inside routed and merged compositions (greedy identity in float32, sampling)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import cached_model, hf_greedy, llama_with_head
from taps.cli.main import main
from taps.core.config import DecodeConfig, TreeConfig
from taps.data.datastore import assistant_segments, build_datastore
from taps.core.decode import chat_ids, generate
from taps.propose.rest import SEP, Datastore, build_index, trie_nodes
from taps.propose.factory import HeadPool, LookupSpec, build_proposer, load_member
from taps.propose.lookup import LookupProposer
from taps.propose.spec import parse_spec, parse_variant
from taps.core.target import Target
from taps.core.testing import tiny_model, tiny_tokenizer
from taps.core.verify import Acceptance

TREE = TreeConfig(total_tokens=16, depth=5, top_k=4)


def started(seq, store, tree=TREE, **kw):
    proposer = LookupProposer(tree, LookupSpec(datastore=store, **{"store_nodes": None, **kw}))
    proposer.start(torch.zeros(len(seq) - 1, 4), torch.tensor(seq))
    return proposer


def paths_of(tree) -> list[list[int]]:
    return sorted([tree.tokens[i].item() for i in row if i >= 0][1:] for row in tree.paths())


# ---- the index ----------------------------------------------------------------------------------
def test_index_sorts_positions_by_what_follows_and_never_crosses_a_segment():
    store = Datastore.of_segments([[5, 6, 7], [5, 6, 8], [6, 7, 9]], depth=3)
    tokens = store.tokens.tolist()
    assert tokens == [SEP, 5, 6, 7, SEP, 5, 6, 8, SEP, 6, 7, 9, SEP]
    keys = [tokens[p:p + 3] for p in store.index.tolist()]
    assert keys == sorted(keys) and len(keys) == 9  # every token position, none of the separators
    assert store.match([1, 5, 6], max_ngram=3, min_ngram=1)[0] == 2  # "5 6" twice; "1 5 6" never
    n, lo, hi = store.match([4, 6], 3, 1)
    assert (n, hi - lo) == (1, 3)  # "6" three times
    rows = store.continuations(n, lo, hi, depth=3, max_matches=10)
    assert sorted(r.tolist() for r in rows) == [[7, SEP, SEP], [7, 9, SEP], [8, SEP, SEP]]
    assert store.match([3], 3, 1) == (0, 0, 0)


def test_trie_keeps_the_most_frequent_continuations_parents_first():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 3], [7, 8, SEP]], dtype=np.int32)
    nodes = trie_nodes(rows, budget=10)
    assert [(n.parent, n.token, n.share) for n in nodes[:3]] == [(-1, 1, 0.75), (0, 2, 0.75), (1, 3, 0.5)]
    assert all(n.parent < i for i, n in enumerate(nodes))
    assert len(nodes) == 6 and {n.token for n in nodes} == {1, 2, 3, 4, 7, 8}
    assert [n.token for n in trie_nodes(rows, budget=2)] == [1, 2]


def test_a_suffix_found_only_at_segment_ends_falls_back_to_a_shorter_one():
    """The online datastore's answers end where a request's context often stands (a closing brace,
    say): the longest suffix then occurs only where its segment ends, with nothing to draft."""
    assert trie_nodes(np.array([[SEP, SEP], [SEP, SEP]], dtype=np.int32), budget=4) == []
    store = Datastore.of_segments([[5, 6, 7], [6, 7, 8]], depth=4)
    assert [n.token for n in store.draft([9, 5, 6, 7], budget=4, depth=2, max_ngram=3)] == [8]
    assert store.draft([9, 8], budget=4, depth=2, max_ngram=3) == []  # "8" ends its only segment


def test_sampling_the_occurrences_keeps_their_proportions():
    segments = [[1, 2, 3]] * 300 + [[1, 2, 4]] * 100
    store = Datastore.of_segments(segments, depth=4)
    nodes = store.draft([9, 1, 2], budget=4, depth=2, max_ngram=2, max_matches=40)
    assert [n.token for n in nodes] == [3, 4]
    assert nodes[0].share == pytest.approx(0.75, abs=0.05)


# ---- the lookup tree with a datastore -----------------------------------------------------------
def test_the_longest_matching_suffix_is_the_one_a_scan_finds():
    """match() searches the suffix length by bisection: on random contexts over a small alphabet
    (many matches, some none) it finds the same length as scanning every segment."""
    rng = np.random.default_rng(0)
    segments = [rng.integers(0, 6, 30).tolist() for _ in range(5)]
    store = Datastore.of_segments(segments, depth=8)

    def occurs(gram):
        return any(seg[i:i + len(gram)] == gram for seg in segments for i in range(len(seg) - len(gram) + 1))

    for _ in range(300):
        context = rng.integers(0, 7, int(rng.integers(1, 13))).tolist()  # 6 never occurs
        for min_ngram in (1, 3):
            top = min(8, len(context))
            longest = next((n for n in range(top, min_ngram - 1, -1) if occurs(context[-n:])), 0)
            assert store.match(context, 8, min_ngram)[0] == longest


def test_the_datastore_drafts_from_the_longest_shared_context():
    """A context of 12 tokens seen once before outweighs its last 3 tokens seen three times
    elsewhere: the store matches the longest suffix it holds (up to 16 tokens), as a store of one
    task's templated answers needs."""
    context = list(range(1, 13))
    store = Datastore.of_segments([context + [100]] + [[50, 51] + context[-3:] + [200]] * 3)
    assert store.depth == 16
    first = started([7] + context, store, prompt=False).propose()
    assert paths_of(first)[0][0] == 100 and [200] not in paths_of(first)
    three = started([7] + context, store, prompt=False, store_max_ngram=3)
    paths = paths_of(three.propose())
    assert [100] in paths and [200] in paths
    assert three._proposed[(200,)] == pytest.approx(0.75) and three._proposed[(100,)] == pytest.approx(0.25)


def test_prompt_lookup_and_the_datastore_share_the_tree_by_score():
    store = Datastore.of_segments([[3, 4, 10, 11], [3, 4, 10, 12], [3, 4, 20]], depth=4)
    seq = [3, 4, 10, 13, 14, 3, 4]  # prompt lookup: after "3 4" came "10 13 14 3 4"
    proposer = started(seq, store)
    tree = proposer.propose()
    assert paths_of(tree) == [[10, 11], [10, 12], [10, 13, 14, 3, 4], [20]]
    assert tree.size == 1 + 5 + 2 + 1  # the shared "10" is one node
    # scores: prompt lookup's d log q - log(rank + 1); the datastore's log(r * share), the share
    # already a probability of the whole path (no depth term)
    log_r = math.log(0.5)
    node_20 = next(i for i in range(tree.size) if tree.tokens[i].item() == 20)
    assert tree.logp[node_20].item() == pytest.approx(log_r + math.log(1 / 3))
    node_11 = next(i for i in range(tree.size) if tree.tokens[i].item() == 11)
    assert tree.logp[node_11].item() == pytest.approx(log_r + math.log(1 / 3))
    node_10 = next(i for i in range(tree.size) if tree.tokens[i].item() == 10)
    assert tree.logp[node_10].item() == pytest.approx(math.log(0.5))  # shared with prompt lookup: its score
    alone = started(seq, store, prompt=False).propose()
    assert paths_of(alone) == [[10, 11], [10, 12], [20]]
    # a budget keeps the best scores of either source: prompt lookup's "10" (log q) and "13"
    # (2 log q), the datastore's three nodes (log(r / 3)), then "14" (3 log q) before "3" and "4"
    small = started(seq, store, tree=TreeConfig(total_tokens=7, depth=5, top_k=4)).propose()
    assert small.size == 7 and paths_of(small) == [[10, 11], [10, 12], [10, 13, 14], [20]]
    capped = started(seq, store, store_nodes=1).propose()
    assert paths_of(capped) == [[10, 13, 14, 3, 4], [20]]


def test_each_source_learns_its_own_acceptance():
    """Prompt lookup's q counts only its own nodes; the datastore's r is accepted datastore nodes
    over the shares they promised, so a store that overpromises is priced down, not prompt lookup."""
    store = Datastore.of_segments([[3, 4, 10, 11], [3, 4, 10, 12], [3, 4, 20]], depth=4)
    seq = [3, 4, 10, 13, 14, 3, 4]
    proposer = started(seq, store)
    tree = proposer.propose()  # prompt: 10 13 14 3 4; datastore: 10 -> 11 | 12 (1/3 each), 20 (1/3)
    # the target emitted 10, 12 and then 5: prompt lookup's 10 accepted, its 13 rejected; the
    # datastore's 12 accepted, its 11 and 20 not
    acceptance = Acceptance(nodes=torch.tensor([0, 1, 2]), tokens=torch.tensor([4, 10, 12]), bonus=5)
    proposer.observe(tree, acceptance, torch.zeros(3, 4))
    assert (proposer.accepted, proposer.tried) == (1 + 1, 2 + 1 + 1)
    assert proposer.store_accepted == pytest.approx(1 + 1)
    assert proposer.store_promised == pytest.approx(2 + 3 * (1 / 3))
    after = proposer.propose()  # the sequence now ends "... 10 12 5": nothing repeats, no store match
    assert after.size >= 1 and proposer.r == pytest.approx(2 / 3)
    # a store that overpromises: every datastore node rejected, r falls and q does not move
    proposer = started(seq, store)
    tree = proposer.propose()
    miss = Acceptance(nodes=torch.tensor([0]), tokens=torch.tensor([4]), bonus=7)
    proposer.observe(tree, miss, torch.zeros(1, 4))
    assert proposer.q == pytest.approx(1 / 3)  # prompt lookup's 10 rejected once
    assert proposer.r == pytest.approx(1 / (2 + 1))  # three nodes promised 1/3 each, none accepted


def test_a_datastore_node_deeper_than_the_target_went_is_not_judged():
    store = Datastore.of_segments([[3, 4, 10, 11]], depth=4)
    proposer = started([7, 3, 4], store, prompt=False)
    tree = proposer.propose()  # 10 -> 11, each with share 1
    assert paths_of(tree) == [[10, 11]]
    # a merge kept only the root: the target emitted 10 alone (the bonus); 11 stays unjudged
    proposer.observe(tree, Acceptance(nodes=torch.tensor([0]), tokens=torch.tensor([4]), bonus=10),
                     torch.zeros(1, 4))
    assert (proposer.store_accepted, proposer.store_promised) == pytest.approx((2, 3))


def test_a_lookup_drafter_needs_prompt_lookup_or_a_datastore():
    with pytest.raises(ValueError, match="needs a datastore"):
        LookupProposer(TREE, LookupSpec(prompt=False))


# ---- losslessness -------------------------------------------------------------------------------
ARCH_TREE = TreeConfig(total_tokens=24, depth=5, top_k=4)
PROMPT = [11, 12, 13, 14, 15, 16, 17]


def own_answers(model, prompts, new_tokens=40) -> Datastore:
    """A datastore of the model's own greedy answers (as `taps data regenerate` makes them)."""
    return Datastore.of_segments([p + hf_greedy(model, p, new_tokens) for p in prompts])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_the_datastore_is_lossless_and_accepts_its_answers(arch):
    model = cached_model(arch)
    target = Target(model)
    reference = hf_greedy(model, PROMPT, 40)
    store = own_answers(model, [PROMPT, [20, 21, 22]])
    for prompt, least in ((False, 3.0), (True, 1.0)):
        spec = LookupSpec(datastore=store, prompt=prompt, store_nodes=None)
        result = generate(target, LookupProposer(ARCH_TREE, spec), PROMPT, DecodeConfig(max_new_tokens=40))
        assert result.tokens == reference
        assert result.acceptance_length > least  # the datastore holds this very answer
    noise = Datastore.of_segments(torch.randint(0, 384, (30, 20), generator=torch.Generator().manual_seed(0)).tolist())
    spec = LookupSpec(datastore=noise, prompt=False, store_nodes=None)
    result = generate(target, LookupProposer(ARCH_TREE, spec), PROMPT, DecodeConfig(max_new_tokens=40))
    assert result.tokens == reference  # drafts that are (mostly) rejected


@pytest.mark.parametrize("spec", [dict(strategy="route", signal="confidence", granularity="step"),
                                  dict(strategy="route", signal="bandit", granularity="step"),
                                  dict(strategy="merge", merge_mode="disjoint"),
                                  dict(strategy="merge", merge_mode="budget")])
def test_the_datastore_composed_with_a_head_is_lossless(spec):
    model, target, head = llama_with_head()
    store = own_answers(model, [PROMPT[:4], [20, 21, 22]])
    proposer = build_proposer(heads={"head": head, "lookup": LookupSpec(datastore=store)}, tree=ARCH_TREE, **spec)
    result = generate(target, proposer, PROMPT, DecodeConfig(max_new_tokens=32))
    assert result.tokens == hf_greedy(model, PROMPT, 32)


def test_sampling_with_the_datastore_keeps_the_target_distribution():
    from test_decode import check_second_token_distribution

    model = tiny_model("llama", seed=7, vocab_size=8, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    prompt = [1, 2, 3, 1, 2]
    store = Datastore.of_segments([[2, a, b] for a in range(8) for b in range(8)][::3] + [[2, 5, 1]] * 5)
    n = 1500
    spec = LookupSpec(datastore=store, prompt=False, store_nodes=None)
    accepted = check_second_token_distribution(
        model, lambda target: LookupProposer(TreeConfig(8, 3, 4), spec), prompt, n)
    assert accepted > n // 100


# ---- build, load, the CLI -----------------------------------------------------------------------
RECORDS = [{"id": f"r{i}", "conversations": [
    {"role": "user", "content": f"How many clips, {i}?"},
    {"role": "assistant", "content": "Natalia sold 48/2 = 24 clips in May. " * (1 + i % 3)}]} for i in range(6)]


def write_records(path, records=RECORDS):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_segments_are_the_assistant_turns_with_their_role_header():
    tok = tiny_tokenizer()
    conv = RECORDS[0]["conversations"] + [{"role": "user", "content": "and?"},
                                          {"role": "assistant", "content": "The quick brown fox."}]
    segments = assistant_segments(tok, conv)
    assert len(segments) == 2
    prompt = chat_ids(tok, conv[:1])  # every prompt the decoder renders ends with the assistant header
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    k = len(prompt) - max(i for i, t in enumerate(prompt) if t == im_start)
    for segment, turn in zip(segments, (conv[1], conv[3])):
        assert segment[:k] == prompt[-k:] and segment[-1] == im_end
        assert tok.decode(segment[k:-1]) == turn["content"]


def test_build_and_load_round_trip(tmp_path, target_dir):
    records = write_records(tmp_path / "a.jsonl")
    out = tmp_path / "ds"
    summary = build_datastore([records, records], str(target_dir), out, depth=6)
    assert "tokens in 12 assistant segments from 2 file(s)" in summary
    manifest = json.loads((out / "datastore.json").read_text())
    assert (manifest["segments"], manifest["index_depth"]) == (12, 6)
    assert manifest["tokenizer_fingerprint"].startswith("sha256:")
    assert (out / "index-6.npy").is_file()
    store = Datastore.load(out)
    tok = tiny_tokenizer()
    expected = [s for r in RECORDS for s in assistant_segments(tok, r["conversations"])] * 2
    assert store.tokens.tolist() == Datastore.of_segments(expected).tokens.tolist()
    assert np.array_equal(np.asarray(store.index), build_index(np.asarray(store.tokens), 6))
    mtime = (out / "index-6.npy").stat().st_mtime_ns
    again = Datastore.load(out)  # the saved index, memory-mapped
    assert (out / "index-6.npy").stat().st_mtime_ns == mtime and isinstance(again.index, np.memmap)
    target = Target.load(target_dir, device="cpu", dtype="float32")
    member = load_member(f"lookup+{out}", target)
    assert isinstance(member, LookupSpec) and member.prompt and member.datastore.size == store.size
    alone = load_member(str(out), target)
    assert isinstance(alone, LookupSpec) and not alone.prompt


def test_cli_builds_and_decodes_with_the_datastore(tmp_path, target_dir, capsys):
    records = write_records(tmp_path / "a.jsonl")
    out = tmp_path / "ds"
    assert main(["lookup", "build", "--records", str(records), "--target", str(target_dir), "--out", str(out)]) == 0
    assert "6 assistant segments" in capsys.readouterr().out
    base = ["generate", "--target", str(target_dir), "--prompt", "How many clips, 3?", "--max-new-tokens", "24",
            "--device", "cpu", "--dtype", "float32", "--json", "--total-tokens", "16", "--top-k", "4"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    for variant in (f"lookup+{out}", str(out), f"merge-budget:lookup,ds={out}"):
        assert main(base + ["--variant", variant]) == 0, variant
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    # a rebuild into the same directory replaces it, with --force (without: exit 2, it stays)
    rebuild = ["lookup", "build", "--records", f"{records},{records}", "--target", str(target_dir), "--out", str(out)]
    assert main(rebuild) == 2 and "--force" in capsys.readouterr().err
    assert json.loads((out / "datastore.json").read_text())["segments"] == 6
    assert main(rebuild + ["--force"]) == 0
    assert json.loads((out / "datastore.json").read_text())["segments"] == 12


def test_the_grammar_names_lookup_with_a_datastore(tmp_path, target_dir):
    assert parse_spec("g", "lookup+runs/ds").drafters == (("lookup", "lookup+runs/ds"),)
    merged = parse_variant("m=merge-budget:head=models/h,lookup+runs/ds")
    assert merged.drafters == (("head", "models/h"), ("lookup", "lookup+runs/ds"))
    assert parse_spec("g", "route:ds=lookup+runs/ds,lookup").member_names == ["ds", "lookup"]
    out = tmp_path / "ds"
    build_datastore([write_records(tmp_path / "a.jsonl")], str(target_dir), out)
    pool = HeadPool(Target.load(target_dir, device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="prompt lookup or a datastore"):
        pool.proposer(parse_variant(f"avg=average:ds=lookup+{out},lookup"), TREE)
    assert pool.proposer(parse_variant(f"r=route:ds=lookup+{out},lookup"), TREE) is not None


def test_rebuilding_a_datastore_takes_force(tmp_path, target_dir):
    """An existing datastore is a finished result: `taps lookup build` over it is refused, naming
    --out and --force, and leaves it as it was; with --force it is rebuilt."""
    from taps.core.outputs import OutputError

    out = tmp_path / "ds"
    build_datastore([write_records(tmp_path / "a.jsonl")], str(target_dir), out)
    before = (out / "datastore.json").read_bytes()
    with pytest.raises(OutputError, match="--force"):
        build_datastore([write_records(tmp_path / "b.jsonl")], str(target_dir), out)
    assert (out / "datastore.json").read_bytes() == before
    build_datastore([write_records(tmp_path / "b.jsonl")], str(target_dir), out, force=True)
    assert Datastore.load(out).manifest["tokens"] > 0
