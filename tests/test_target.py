"""Target on the unmodified Hugging Face models: tree logits equal sequential evaluation, commit
keeps exactly the accepted rows, features are the LM head's input."""

import pytest
import torch

from conftest import cached_model
from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.core.tree import DraftTree

ATOL = 1e-5

#        0
#      / | \
#     1  2  3
#    / \     \
#   4   5     6
#   |
#   7
PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4]


def hand_tree(tokens):
    n = len(PARENTS)
    return DraftTree.drafted(tokens=torch.tensor(tokens), parents=torch.tensor(PARENTS), logp=torch.zeros(n),
                             entropy=torch.zeros(n), drafter=0)


def sequential(model, ids):
    """Logits and last-layer features of a fresh forward over ids (the library's own causal mask)."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


def check_tree_matches_sequential(model, prefix, tokens):
    target = Target(model)
    target.prefill(torch.tensor(prefix[:-1]))
    tree = hand_tree([prefix[-1]] + tokens)
    out = target.forward_tree(tree)
    for node in range(tree.size):
        path = tree.tokens[tree.path_to(node)].tolist()
        logits, feats = sequential(model, prefix[:-1] + path)
        assert torch.allclose(out.logits[node], logits[-1], atol=ATOL), f"node {node} logits differ"
        assert torch.allclose(out.features[node], feats[-1], atol=ATOL), f"node {node} features differ"
    return target, tree, out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forward_tree_equals_sequential(arch, attn):
    model = cached_model(arch, attn)
    check_tree_matches_sequential(model, [5, 9, 13, 2, 77, 31], [40, 41, 42, 43, 44, 45, 46])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("path", [[0], [0, 1, 4, 7], [0, 2], [0, 3, 6], [0, 1, 5]])
def test_commit_equals_recompute(arch, attn, path):
    model = cached_model(arch, attn)
    prefix = [5, 9, 13, 2, 77, 31]
    target, tree, _ = check_tree_matches_sequential(model, prefix, [40, 41, 42, 43, 44, 45, 46])
    target.commit(torch.tensor(path))
    fresh = Target(model)
    fresh.prefill(torch.tensor(prefix[:-1] + tree.tokens[path].tolist()))
    assert target.length == fresh.length == len(prefix) - 1 + len(path)
    for mine, ref in zip(target.cache.layers, fresh.cache.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=ATOL)
        assert torch.allclose(mine.values, ref.values, atol=ATOL)
    # and decoding goes on correctly from the committed state
    nxt = target.prefill(torch.tensor([3]))
    ref_logits, _ = sequential(model, prefix[:-1] + tree.tokens[path].tolist() + [3])
    assert torch.allclose(nxt.logits[-1], ref_logits[-1], atol=ATOL)


def test_features_are_lm_head_input(arch):
    model = cached_model(arch)
    target = Target(model)
    out = target.prefill(torch.tensor([1, 2, 3, 4]), all_logits=True)
    assert out.features.shape == (4, model.config.hidden_size)
    with torch.inference_mode():
        assert torch.allclose(target.lm_head(out.features), out.logits, atol=ATOL)
    last = target.prefill(torch.tensor([5]))
    assert last.logits.shape == (1, model.config.vocab_size)


@pytest.mark.parametrize("arch_kwargs", [
    ("mistral", {"sliding_window": 6}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
])
def test_sliding_window_tree_mask(arch_kwargs):
    arch, kwargs = arch_kwargs
    model = tiny_model(arch, seed=3, attn_implementation="eager", **kwargs)
    prefix = [5, 9, 13, 2, 77, 31, 8, 19, 23, 4]  # longer than the window
    check_tree_matches_sequential(model, prefix, [40, 41, 42, 43, 44, 45, 46])


def test_protocol_errors():
    target = Target(cached_model("llama"))
    with pytest.raises(RuntimeError, match="commit"):
        target.commit(torch.tensor([0]))
    target.prefill(torch.tensor([1, 2]))
    target.forward_tree(DraftTree.root_only(3))
    with pytest.raises(RuntimeError, match="twice"):
        target.forward_tree(DraftTree.root_only(3))
    with pytest.raises(RuntimeError, match="awaits commit"):
        target.prefill(torch.tensor([1]))
    target.commit(torch.tensor([0]))
    assert target.length == 3


def test_load_from_directory(target_dir):
    target = Target.load(target_dir, device="cpu", dtype="float32")
    assert target.tokenizer is not None and target.fingerprint().startswith("sha256:")
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in target.stop_token_ids()
    assert target.context_window == 512


def test_load_errors(tmp_path, target_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Target.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Target.load(tmp_path)
    bare = tmp_path / "bin-only"
    bare.mkdir()
    (bare / "config.json").write_text((target_dir / "config.json").read_text())
    (bare / "pytorch_model.bin").write_bytes(b"not used")
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        Target.load(bare)
    with pytest.raises(ValueError, match="unknown dtype"):
        Target.load(target_dir, device="cpu", dtype="int3")


def test_auto_dtype_on_a_cpu_is_the_measured_choice(monkeypatch, tmp_path):
    import taps.core.machine as machine
    from taps.core.target import resolve_dtype

    cpu = torch.device("cpu")
    asked = []
    monkeypatch.setattr(machine, "cpu_dtype", lambda *args: asked.append(args) or torch.bfloat16)
    assert resolve_dtype("auto", cpu, (tmp_path, "t", False)) == torch.bfloat16  # what the measurement chose
    assert asked == [(tmp_path, "t", False)]
    assert resolve_dtype("auto", cpu) == torch.float32  # nothing to measure
    assert resolve_dtype("float32", cpu, (tmp_path, "t", False)) == torch.float32  # an explicit dtype is never overridden
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 and len(asked) == 1
