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
