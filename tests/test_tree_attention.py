"""taps.core.attention: the tree path is taken, equals the dense-mask path and the library's own eager
and SDPA attention in float32 at long context (100, 1,000 and 2,000 committed tokens), covers
sliding windows (Mistral, Qwen2's hybrid layers), and falls back with one log line where it does
not apply."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest
import torch

import taps.core.attention as attention
from conftest import hf_greedy
from taps.core.config import DecodeConfig
from taps.core.decode import generate
from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.core.tree import DraftTree

ATOL = 1e-5
LONG = 2200  # max_position_embeddings of the long-context models
PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4, 7, 8]  # depth 5: a chain below a bushy top


@pytest.fixture(autouse=True)
def matmul_path_on_short_contexts_too(monkeypatch):
    """Trees on short contexts take the dense mask by rule (attention.dense_tree): here the matmul
    path is what is tested, at every context; test_short_trees_take_the_dense_mask tests the rule."""
    monkeypatch.setattr(attention, "DENSE_TREE_BELOW", 0)


@functools.lru_cache(maxsize=None)
def long_model(arch: str, attn: str, **kwargs):
    return tiny_model(arch, seed=5, attn_implementation=attn, max_positions=LONG, **dict(kwargs))


def tree(tokens: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree.drafted(tokens=torch.tensor(tokens), parents=torch.tensor(PARENTS[:n]), logp=torch.zeros(n),
                             entropy=torch.zeros(n), drafter=0)


def context(length: int, vocab: int = 384, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def tree_out(model, prefix: list[int], nodes: list[int], tree_path: bool):
    target = Target(model)
    target.tree_attention = tree_path and target.tree_attention
    target.prefill(torch.tensor(prefix))
    return target.forward_tree(tree(nodes))


def sequential_last(model, ids: list[int]):
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of the tree path (so a silent fallback fails the test)."""
    calls = []
    real = attention.tree_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "tree_attention", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("prefix", [100, 1000, 2000])
def test_tree_path_equals_dense_mask_and_sequential(arch, attn, prefix, spy):
    model = long_model(arch, attn)
    ids = context(prefix)
    nodes = [7, 40, 41, 42, 43, 44, 45, 46, 47, 48]
    mine = tree_out(model, ids, nodes, tree_path=True)
    assert len(spy) == model.config.num_hidden_layers  # one tree-path call per layer, no fallback
    dense = tree_out(model, ids, nodes, tree_path=False)
    assert len(spy) == model.config.num_hidden_layers  # the dense path does not use it
    assert torch.allclose(mine.logits, dense.logits, atol=ATOL)
    assert torch.allclose(mine.features, dense.features, atol=ATOL)
    t = tree(nodes)
    for node in (0, 3, 6, 9):  # the library's own forward over each node's path (its own attention)
        logits, feats = sequential_last(model, ids + t.tokens[t.path_to(node)].tolist())
        assert torch.allclose(mine.logits[node], logits, atol=ATOL), f"node {node} logits differ"
        assert torch.allclose(mine.features[node], feats, atol=ATOL), f"node {node} features differ"


@pytest.mark.parametrize("arch_kwargs", [
    ("mistral", (("sliding_window", 6),)),
    ("mistral", (("sliding_window", 300),)),
    ("qwen2", (("use_sliding_window", True), ("sliding_window", 6), ("max_window_layers", 1))),
])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_windows_are_exact(arch_kwargs, attn, spy):
    """Windows smaller than the tree's depth and smaller than the context: the band each query
    loses is masked, keys before every window are not read."""
    arch, kwargs = arch_kwargs
    model = long_model(arch, attn, **dict(kwargs))
    ids = context(400, seed=3)
    nodes = [7, 40, 41, 42, 43, 44, 45, 46, 47, 48]
    mine = tree_out(model, ids, nodes, tree_path=True)
    assert len(spy) == model.config.num_hidden_layers
    dense = tree_out(model, ids, nodes, tree_path=False)
    assert torch.allclose(mine.logits, dense.logits, atol=ATOL)
    t = tree(nodes)
    for node in range(t.size):
        logits, _ = sequential_last(model, ids + t.tokens[t.path_to(node)].tolist())
        assert torch.allclose(mine.logits[node], logits, atol=ATOL), f"node {node} logits differ"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("arch_kwargs", [("llama", ()), ("mistral", (("sliding_window", 300),))])
@pytest.mark.parametrize("prefix", [100, 1000])
def test_one_node_forwards_are_exact_on_either_path(fused, arch_kwargs, prefix, monkeypatch):
    """A one-node forward (plain decoding's step) through SDPA's fused kernel or the matmul path
    equals the library's own forward; the kernel runs, in every layer, exactly where the rule says
    so and no key falls outside a window."""
    asked, kernel_calls = [], []
    monkeypatch.setattr(attention, "fused_one_node", lambda p: asked.append(p) or fused)
    arch, kwargs = arch_kwargs
    model = long_model(arch, "sdpa", **dict(kwargs))
    ids = context(prefix, seed=11)
    logits, feats = sequential_last(model, ids + [7])  # the library's own forward, before the count starts
    target = Target(model)
    target.prefill(torch.tensor(ids))
    kernel = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    mine = target.forward_tree(tree([7]))
    assert torch.allclose(mine.logits[0], logits, atol=ATOL)
    assert torch.allclose(mine.features[0], feats, atol=ATOL)
    assert asked == [prefix]  # once per forward
    window = dict(kwargs).get("sliding_window")
    cut = window is not None and prefix >= window  # keys before the window: the matmul path's band
    assert len(kernel_calls) == (model.config.num_hidden_layers if fused and not cut else 0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("prefix", [100, 300])
def test_short_trees_take_the_dense_mask(prefix, attn, monkeypatch):
    """A tree of several nodes below DENSE_TREE_BELOW committed tokens runs the library's SDPA
    with the dense mask (never the matmul path), exactly; above it, the matmul path; one node never.
    An eager base keeps the matmul path at every context (its masked attention is no quicker)."""
    monkeypatch.setattr(attention, "DENSE_TREE_BELOW", 256)
    assert attention.dense_tree(2, 255) and not attention.dense_tree(2, 256) and not attention.dense_tree(1, 0)
    matmul_calls = []
    matmul = attention.tree_attention
    monkeypatch.setattr(attention, "tree_attention", lambda *a: matmul_calls.append(1) or matmul(*a))
    model = long_model("llama", attn)
    ids = context(prefix, seed=3)
    nodes = [7, 40, 41, 42, 43, 44]
    target = Target(model)
    target.prefill(torch.tensor(ids))
    mine = target.forward_tree(tree(nodes))
    dense = prefix < 256 and attn == "sdpa"
    assert len(matmul_calls) == (0 if dense else model.config.num_hidden_layers)
    t = tree(nodes)
    for node in range(t.size):
        logits, _ = sequential_last(model, ids + t.tokens[t.path_to(node)].tolist())
        assert torch.allclose(mine.logits[node], logits, atol=ATOL), f"node {node} logits differ"


@pytest.mark.parametrize("arch_kwargs", [
    ("mistral", (("sliding_window", 6),)),
    ("qwen2", (("use_sliding_window", True), ("sliding_window", 6), ("max_window_layers", 1))),
])
def test_short_trees_on_the_dense_mask_keep_sliding_windows(arch_kwargs, monkeypatch):
    """The dense mask a short tree takes (TreeBlock.dense_mask) cuts each query's window as the
    matmul path's band does: a window smaller than the tree's depth, after 100 tokens."""
    monkeypatch.setattr(attention, "DENSE_TREE_BELOW", 256)
    matmul_calls = []
    matmul = attention.tree_attention
    monkeypatch.setattr(attention, "tree_attention", lambda *a: matmul_calls.append(1) or matmul(*a))
    arch, kwargs = arch_kwargs
    model = long_model(arch, "sdpa", **dict(kwargs))
    ids = context(100, seed=3)
    nodes = [7, 40, 41, 42, 43, 44, 45, 46, 47, 48]
    mine = tree_out(model, ids, nodes, tree_path=True)
    assert not matmul_calls
    t = tree(nodes)
    for node in range(t.size):
        logits, _ = sequential_last(model, ids + t.tokens[t.path_to(node)].tolist())
        assert torch.allclose(mine.logits[node], logits, atol=ATOL), f"node {node} logits differ"


def test_one_node_rule_reads_the_thread_count(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert attention.fused_one_node(639) and not attention.fused_one_node(640)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert attention.fused_one_node(1023) and not attention.fused_one_node(1024)


class NoisyChain:
    """Proposes the reference continuation with a wrong token at a varying depth, so accepted
    lengths vary and the committed context grows by different amounts each step."""

    def __init__(self, reference: list[int], vocab: int):
        self.reference, self.vocab, self.seq, self.step = reference, vocab, [], 0

    def start(self, features, tokens):
        self.seq = tokens.tolist()

    def propose(self) -> DraftTree:
        self.step += 1
        nxt = self.reference[len(self.seq):len(self.seq) + 6]
        cut = self.step % (len(nxt) + 1)
        nxt = [t if d < cut else (t + 1) % self.vocab for d, t in enumerate(nxt)]
        n = len(nxt) + 1
        return DraftTree.drafted(tokens=torch.tensor([self.seq[-1]] + nxt), parents=torch.arange(-1, n - 1),
                                 logp=torch.zeros(n), entropy=torch.zeros(n), drafter=0)

    def observe(self, tree, acceptance, features):
        self.seq += acceptance.new_tokens

    def step_info(self):
        from taps.core.proposer import StepInfo
        return StepInfo()


@pytest.mark.parametrize("prefix", [100, 1000, 2000])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_is_token_identical_at_long_context(prefix, attn, spy):
    """Speculative and plain greedy decoding through the tree path equal the library's own greedy
    generate (its own attention) after 100, 1,000 and 2,000 tokens of prompt."""
    model = long_model("llama", attn)
    prompt = context(prefix, seed=prefix)
    reference = hf_greedy(model, prompt, 32)
    target = Target(model)
    cfg = DecodeConfig(max_new_tokens=32)
    spec = generate(target, NoisyChain(prompt + reference, model.config.vocab_size), prompt, cfg)
    assert spec.tokens == reference
    assert len({s.accepted for s in spec.steps}) >= 3
    assert spy  # the verifier calls took the tree path
    assert generate(target, None, prompt, cfg).tokens == reference


def test_unmodelled_arguments_fall_back_with_one_log_line(caplog):
    """An argument the tree path does not model (attention sinks here) sends the call to the
    library's attention with the dense mask, which gives the same result, and says so once."""
    model = long_model("llama", "eager")
    target = Target(model)
    ids = context(50)
    target.prefill(torch.tensor(ids))
    layer = model.model.layers[0].self_attn
    block = attention.TreeBlock(tree([7, 40, 41]).ancestor_mask(), tree([7, 40, 41]).depth(), len(ids))
    q = torch.randn(1, 4, 3, 16)
    k, v = torch.randn(1, 2, len(ids) + 3, 16), torch.randn(1, 2, len(ids) + 3, 16)
    fn = attention.ALL_ATTENTION_FUNCTIONS["taps_tree_eager"]
    ours, _ = fn(layer, q, k, v, None, scaling=0.25, **{attention.TREE_KWARG: block})
    with caplog.at_level(logging.WARNING, logger="taps.core.attention"):
        fell, _ = fn(layer, q, k, v, None, scaling=0.25, s_aux=torch.zeros(4), **{attention.TREE_KWARG: block})
        fn(layer, q, k, v, None, scaling=0.25, s_aux=torch.zeros(4), **{attention.TREE_KWARG: block})
    assert torch.allclose(ours, fell, atol=ATOL)  # llama's eager ignores sinks: both are plain attention
    lines = [r.getMessage() for r in caplog.records if "tree attention" in r.getMessage()]
    assert len(lines) == 1 and "s_aux" in lines[0] and "dense" in lines[0]


def test_unwrapped_attention_keeps_the_dense_mask(caplog):
    fake = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with caplog.at_level(logging.WARNING, logger="taps.core.attention"):
        assert attention.enable(fake) is False
    assert any("flash_attention_2" in r.getMessage() and "dense" in r.getMessage() for r in caplog.records)


def test_non_tree_forwards_are_the_library_own():
    """After enable(), a plain forward runs the base attention: identical outputs, bit for bit."""
    ids = torch.tensor([context(300, seed=9)])
    for attn in ("sdpa", "eager"):
        fresh = tiny_model("llama", seed=5, attn_implementation=attn, max_positions=LONG)
        with torch.inference_mode():
            before = fresh(ids).logits
            Target(fresh)
            assert fresh.config._attn_implementation == f"taps_tree_{attn}"
            assert attention.base_implementation(fresh) == attn
            assert torch.equal(fresh(ids).logits, before)
