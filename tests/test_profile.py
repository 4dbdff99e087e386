"""`taps profile`: measured target and draft-level costs, cached per machine, target, dtype and
threads, reused unless asked to measure again."""

from __future__ import annotations

import json

import pytest

from taps.cli.main import main
from taps.core.config import SpeculationConfig, TreeConfig
from taps.drafter.checkpoint import init_head
from taps.drafter.profile import profile, time_target


def test_target_costs_cover_every_size_and_leave_the_cache_empty(target):
    times = time_target(target, sizes=(1, 4, 16), prefix=12, repeats=2)
    assert set(times) == {1, 4, 16} and all(ms > 0 for ms in times.values())
    assert target.length == 0  # the profile leaves no rows behind


def test_profile_is_cached_and_remeasured_on_request(target, tmp_path):
    head = init_head(target.config, seed=0).bind(target.embed_tokens, target.lm_head)
    first = profile(target, head, "sha256:x", repeats=1, prefix=8, root=tmp_path)
    assert set(first["target_forward_ms"]) >= {"1", "16", "64", "128"} and set(first["draft_level_ms"]) >= {"1", "10"}
    saved = json.loads(open(first["path"]).read())
    assert saved["target_forward_ms"] == first["target_forward_ms"] and saved["machine"]["cores"] >= 1
    again = profile(target, head, "sha256:x", repeats=1, prefix=8, root=tmp_path)
    assert again["measured_at"] == first["measured_at"] and again["path"] == first["path"]
    other = profile(target, None, None, repeats=1, prefix=8, root=tmp_path)  # no drafter: another file
    assert other["path"] != first["path"] and "draft_level_ms" not in other


def test_cli_profile_and_bad_options(target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAPS_CACHE_DIR", str(tmp_path))
    assert main(["profile", "--target", str(target_dir), "--device", "cpu", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| tree tokens | target forward ms |" in out and str(tmp_path) in out
    assert "| committed context | one-token forward ms | 16-node tree ms | ratio |" in out
    assert "16-node tree forward, tree attention: where the time goes" in out and "| cache append |" in out
    assert main(["profile", "--target", str(target_dir), "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_cli_profile_of_a_drafter_is_the_one_tree_auto_reads(target, target_dir, tmp_path, monkeypatch, capsys):
    """`taps profile --drafter D --measure` writes the profile --tree auto uses for every head of
    D's shape: before, the CLI keyed it by D's weights and --tree auto never saw it."""
    from taps.drafter.checkpoint import DrafterInfo, save_head
    from taps.drafter.profile import head_shape_key, profile_path, tree_policy

    monkeypatch.setenv("TAPS_CACHE_DIR", str(tmp_path))
    head = init_head(target.config, seed=0)
    save_head(head, tmp_path / "d", DrafterInfo(backbone="eagle2", training_data="unit",
                                                tokenizer_fingerprint=target.fingerprint()))
    assert main(["profile", "--target", str(target_dir), "--drafter", str(tmp_path / "d"), "--device", "cpu",
                 "--dtype", "float32", "--repeats", "1", "--threads", "1", "--measure"]) == 0
    written = capsys.readouterr().out.split("profile: ")[1].split()[0]
    bound = head.bind(target.embed_tokens, target.lm_head)
    assert written == str(profile_path(target.name, "float32", 1, head_shape_key(bound), tmp_path / "profiles"))
    before = json.loads(open(written).read())["measured_at"]
    tree_policy(target, [bound], SpeculationConfig(TreeConfig(16, 4, 4), "auto"))  # reads it, measures nothing
    assert json.loads(open(written).read())["measured_at"] == before


def test_profile_times_contexts_and_splits_a_verify_step(target, tmp_path):
    result = profile(target, None, None, repeats=1, prefix=8, root=tmp_path)
    # the tiny target holds 512 positions: only 128 leaves room for a 64-node tree
    assert list(result["verify_ms_by_context"]) == ["128"]
    assert set(result["verify_ms_by_context"]["128"]) >= {"1", "16", "64"}
    assert set(result["verify_split"]) == {"tree attention", "dense mask"}
    for path in result["verify_split"].values():
        parts = path["128"]
        assert parts["total"] > 0 and parts["attention"] > 0 and parts["cache append"] > 0 and parts["mask"] > 0
        # each of the five figures is rounded to 3 decimals on its own: they may disagree by 5 x 0.0005
        assert parts["other"] == pytest.approx(parts["total"] - parts["mask"] - parts["attention"]
                                               - parts["cache append"], abs=2.5e-3 + 1e-9)
    assert target.tree_attention and target.length == 0  # the comparison left the Target as it was


def test_split_hooks_see_every_layer_and_leave_nothing_behind(target):
    import torch

    from taps.core import attention, kv
    from taps.core.tree import DraftTree

    target.reset()
    target.prefill(torch.tensor([1, 2, 3]))
    layers = target.config.num_hidden_layers
    with attention.timed() as attend, kv.timed_updates(target.cache, target.device) as append:
        target.forward_tree(DraftTree.root_only(4))
    assert len(attend) == layers and len(append) == layers
    assert "update" not in vars(target.cache)  # the method is the class's again
    target.commit(torch.tensor([0]))
    target.prefill(torch.tensor([5]))
    assert len(attend) == layers and len(append) == layers  # nothing recorded outside the block
    target.reset()


def test_speed_change_is_reported(target, tmp_path, caplog):
    from taps.drafter.profile import speed_changed

    assert speed_changed(now_ms=140.0, profiled_ms=100.0) and speed_changed(now_ms=60.0, profiled_ms=100.0)
    assert not speed_changed(now_ms=125.0, profiled_ms=100.0) and not speed_changed(now_ms=75.0, profiled_ms=100.0)
    first = profile(target, None, None, repeats=1, prefix=8, root=tmp_path)
    saved = json.loads(open(first["path"]).read())
    saved["target_forward_ms"]["1"] = 1e6  # a machine a million times slower measured it
    open(first["path"], "w").write(json.dumps(saved))
    with caplog.at_level("WARNING", logger="taps.drafter.profile"):
        again = profile(target, None, None, repeats=1, prefix=8, root=tmp_path)
    assert again["speed_check"]["changed"] and again["measured_at"] == first["measured_at"]
    assert any("taps profile --measure" in r.getMessage() for r in caplog.records)
    import torch

    target.prefill(torch.tensor([1, 2, 3]))  # a Target in use is not re-timed (that would reset it)
    assert profile(target, None, None, repeats=1, prefix=8, root=tmp_path)["speed_check"]["changed"] is None
    assert target.length == 3
    target.reset()


def test_one_slow_moment_is_not_a_speed_change(target, tmp_path, caplog, monkeypatch):
    """The start-up check warns only when a second, longer timing agrees: a cold first forward or a
    burst of load beside the process is not the machine's speed."""
    import taps.drafter.profile as prof

    first = profile(target, None, None, repeats=1, prefix=8, root=tmp_path)
    profiled = float(first["target_forward_ms"]["1"])
    timings = iter([{1: profiled * 3}, {1: profiled * 1.05}])  # slow once, then as profiled
    monkeypatch.setattr(prof, "time_target", lambda *a, **k: next(timings))
    with caplog.at_level("WARNING", logger="taps.drafter.profile"):
        again = profile(target, None, None, repeats=1, prefix=8, root=tmp_path)
    assert again["speed_check"]["changed"] is False and again["speed_check"]["one_token_ms"] == round(profiled * 1.05, 3)
    assert not any("taps profile --measure" in r.getMessage() for r in caplog.records)
    timings = iter([{1: profiled * 3}, {1: profiled * 2.5}])  # slow both times: told
    with caplog.at_level("WARNING", logger="taps.drafter.profile"):
        assert profile(target, None, None, repeats=1, prefix=8, root=tmp_path)["speed_check"]["changed"]
    assert any("taps profile --measure" in r.getMessage() for r in caplog.records)
