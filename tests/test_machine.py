"""taps.core.machine: `--dtype auto` on a CPU is the faster dtype of a measured verify step, cached
per machine, target and threads, pinned by TAPS_CPU_DTYPE; a bad pin is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import taps.core.machine as machine
from taps.core.machine import choose, cpu_dtype


def test_the_faster_dtype_wins_and_a_tie_keeps_float32():
    assert choose(fp32_ms=120.0, bf16_ms=60.0) == torch.bfloat16
    assert choose(fp32_ms=60.0, bf16_ms=120.0) == torch.float32
    assert choose(fp32_ms=80.0, bf16_ms=80.0) == torch.float32


def test_choice_is_measured_once_then_read_from_the_cache(target_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TAPS_CPU_DTYPE")
    with caplog.at_level("WARNING", logger="taps.core.machine"):
        first = cpu_dtype(target_dir, "tiny", root=tmp_path)
    [written] = list(tmp_path.glob("dtype-tiny-*.json"))
    record = json.loads(written.read_text())
    assert record["bf16_ms"] > 0 and record["float32_ms"] > 0
    assert first == choose(record["float32_ms"], record["bf16_ms"])  # the choice follows the recorded timings
    assert record["dtype"] == str(first).removeprefix("torch.") and "bf16" in record["why"]
    assert any("--dtype auto: chose" in r.getMessage() for r in caplog.records)

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(machine, "tree_step_ms", no_timing)
    assert cpu_dtype(target_dir, "tiny", root=tmp_path) == first


def test_the_step_timed_is_a_tree_forward_of_the_unchanged_model():
    from taps.core.testing import tiny_model

    model = tiny_model("llama", seed=2)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        before = model(ids).logits
        assert machine.tree_step_ms(model, context=40, nodes=4, repeats=1) > 0
        assert torch.equal(model(ids).logits, before)


def test_pin_and_bad_pin(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CPU_DTYPE", "bfloat16")
    assert cpu_dtype(target_dir, "tiny", root=tmp_path) == torch.bfloat16 and not list(tmp_path.iterdir())
    monkeypatch.setenv("TAPS_CPU_DTYPE", "fp8")
    with pytest.raises(ValueError, match="TAPS_CPU_DTYPE='fp8'"):
        cpu_dtype(target_dir, "tiny", root=tmp_path)
