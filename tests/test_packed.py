"""Linear weights packed for oneDNN (taps.core.packed): the same outputs as F.linear, a dense weight
every reader still sees, gradients through the unpacked path, no stale copy after a change, and
a memory gate."""

import pytest
import torch
from torch import nn

from taps.core import packed
from taps.core.target import Target
from taps.core.testing import tiny_model

pytestmark = pytest.mark.skipif(not packed.available(), reason="this PyTorch has no oneDNN packed linear")


def _linear(dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(48, 80, bias=bias).to(dtype)
    plain = nn.Linear(48, 80, bias=bias).to(dtype)
    plain.load_state_dict(layer.state_dict())
    assert packed.pack_linears(layer) == 1 and isinstance(layer, packed.PackedLinear)
    return layer, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [True, False])
def test_same_outputs_as_f_linear(dtype, rows, bias):
    layer, plain = _linear(dtype, bias)
    x = torch.randn(1, rows, 48).to(dtype)  # [B, M, in]
    with torch.inference_mode():
        got, want = layer(x), plain(x)
    assert got.shape == want.shape == (1, rows, 80) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_gradients_take_the_dense_path():
    layer, plain = _linear(torch.float32)
    x = torch.randn(4, 48, requires_grad=True)
    layer(x).square().sum().backward()
    want_x = x.grad.clone()
    x.grad = None
    plain(x).square().sum().backward()
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def test_a_changed_weight_is_repacked():
    layer, _ = _linear(torch.float32)
    x = torch.randn(2, 48)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # in place: same storage, new version
        after = layer(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, layer.weight, layer.bias))
    layer.to(torch.bfloat16)  # a cast: new storage
    with torch.no_grad():
        cast = layer(x.bfloat16())
    torch.testing.assert_close(cast.float(), torch.nn.functional.linear(x.bfloat16(), layer.weight, layer.bias).float(),
                               rtol=1e-2, atol=1e-2)


def test_target_packs_its_linears_and_keeps_ties_and_state():
    model = tiny_model(tie_word_embeddings=True)
    keys = set(model.state_dict())
    reference = tiny_model(tie_word_embeddings=True)
    target = Target(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert target.packed_linears == len(linears) > 0
    assert all(type(m) is packed.PackedLinear for m in linears)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # the tie survives
    assert set(model.state_dict()) == keys  # nothing added to what is saved
    ids = torch.randint(0, 300, (1, 12))
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_is_skipped_when_memory_is_short(monkeypatch, caplog):
    monkeypatch.setattr(packed, "_free_bytes", lambda: 1024)
    model = tiny_model()
    with caplog.at_level("WARNING"):
        assert packed.pack_linears(model) == 0
    assert not any(isinstance(m, packed.PackedLinear) for m in model.modules())
    assert "packed linear weights: skipped" in caplog.text


def test_packing_twice_converts_nothing_more():
    model = tiny_model()
    first = packed.pack_linears(model)
    assert first > 0 and packed.pack_linears(model) == 0


def test_a_copy_repacks_and_matches():
    import copy
    layer, plain = _linear(torch.float32)
    twin = copy.deepcopy(layer)  # the opaque packed tensor is not copied; the twin packs its own
    x = torch.randn(3, 48)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), plain(x), rtol=1e-5, atol=1e-5)
    assert twin.packed_weight() is not layer.packed_weight()


def _ungrouped(model):
    """The same model packed layer by layer (no sibling groups): what the code before groups ran."""
    for m in model.modules():
        if isinstance(m, packed.PackedLinear):
            m._group = None
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # qwen2: q / k / v with biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_siblings_multiply_their_input_once_with_the_same_products(arch, dtype, monkeypatch):
    model = tiny_model(arch).to(dtype)
    reference = tiny_model(arch).to(dtype)
    packed.pack_linears(model)
    packed.pack_linears(reference)
    _ungrouped(reference)
    layers = model.config.num_hidden_layers
    groups = {id(m._group): m._group for m in model.modules() if isinstance(m, packed.PackedLinear) and m._group}
    assert len(groups) == 2 * layers  # q / k / v and gate / up in every layer
    assert sorted(len(g.members) for g in groups.values()) == [2] * layers + [3] * layers
    calls = []
    multiply = packed._multiply
    monkeypatch.setattr(packed, "_multiply", lambda *a: calls.append(a[0].shape) or multiply(*a))
    ids = torch.randint(0, 300, (1, 12))
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        grouped_calls = len(calls)
        want = reference(input_ids=ids).logits
    # per layer: one call for q / k / v, one for gate / up, o_proj, down_proj; and the LM head
    assert grouped_calls == 4 * layers + 1 and len(calls) - grouped_calls == 7 * layers + 1
    assert torch.equal(got, want)  # the stacked product's columns are the separate products
    assert all(g._last is None for g in groups.values())  # every sibling took its columns: nothing kept


def test_a_sibling_called_on_another_input_or_twice_multiplies_again():
    model = tiny_model()
    packed.pack_linears(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, attn.q_proj.in_features), torch.randn(1, 3, attn.q_proj.in_features)
    with torch.inference_mode():
        q = attn.q_proj(x)
        k_other = attn.k_proj(y)  # not the input the group multiplied last
        q_again = attn.q_proj(y)  # q already took its columns of y's product: multiplies again
        v = attn.v_proj(y)
    for got, layer, inp in ((q, attn.q_proj, x), (k_other, attn.k_proj, y), (q_again, attn.q_proj, y),
                            (v, attn.v_proj, y)):
        torch.testing.assert_close(got, torch.nn.functional.linear(inp, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_a_changed_sibling_weight_repacks_the_group_and_a_copy_repacks_its_own():
    import copy
    model = tiny_model("qwen2")
    packed.pack_linears(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 2, attn.q_proj.in_features)
    with torch.no_grad():
        attn.v_proj.weight.mul_(3.0)
        attn.k_proj.bias.add_(1.0)
        outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for got, layer in zip(outs, (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)
    twin_attn = twin.model.layers[0].self_attn
    assert twin_attn.q_proj._group is twin_attn.k_proj._group is not attn.q_proj._group
    assert twin_attn.q_proj._group.members[1] is twin_attn.k_proj
    ids = torch.randint(0, 300, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_layers_that_cannot_share_one_product_stay_apart():
    model = tiny_model(kv_heads=4)  # k_proj as wide as q_proj
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight = attn.q_proj.weight  # one weight twice: its columns cannot be told apart
    mlp = model.model.layers[0].mlp
    mlp.up_proj.bias = nn.Parameter(torch.zeros(mlp.up_proj.out_features))  # gate has none
    packed.pack_linears(model)
    assert all(m._group is None for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    assert all(isinstance(m, packed.PackedLinear) for m in (attn.q_proj, mlp.up_proj))  # packed, alone
    assert model.model.layers[1].self_attn.q_proj._group is not None
    assert model.model.layers[1].mlp.gate_proj._group is not None
    ids = torch.randint(0, 300, (1, 5))
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


def test_a_sibling_cast_alone_multiplies_by_its_own_copy():
    model = tiny_model()
    packed.pack_linears(model)
    attn = model.model.layers[0].self_attn
    attn.v_proj.to(torch.bfloat16)  # the group's weights no longer share a dtype
    x = torch.randn(1, 4, attn.q_proj.in_features)
    with torch.inference_mode():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x.bfloat16())
    assert v.dtype == torch.bfloat16
    for got, layer, inp in ((q, attn.q_proj, x), (k, attn.k_proj, x), (v, attn.v_proj, x.bfloat16())):
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(inp, layer.weight, layer.bias).float(),
                                   rtol=1e-2, atol=1e-2)
