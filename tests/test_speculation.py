"""The speculation settings (config.SpeculationConfig): one set of defaults and checks for the
command line, study configs and library callers, and one place that builds the auto policy
(profile.tree_policy), with one rule for when auto is refused."""

from __future__ import annotations

import pytest

from taps.cli.main import main
from taps.core.config import AUTO_TREE_CAPS, FIXED_TREE, SpeculationConfig, TreeConfig
from taps.drafter.profile import tree_policy
from taps.propose.lookup import LookupSpec
from taps.study import StudyConfigError, study_from_dict


def test_a_depth_the_budget_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="depth must be below total_tokens.*depth 5 and total_tokens 3"):
        TreeConfig(3, 5)
    with pytest.raises(ValueError, match="depth must be below total_tokens"):
        TreeConfig(5, 5, 1)
    assert TreeConfig(6, 5, 1).depth == 5  # one node per level fits
    with pytest.raises(ValueError, match="top_k must be a positive integer, got 0"):
        TreeConfig(60, 5, 0)
    with pytest.raises(ValueError, match="total_tokens must be a positive integer, got True"):
        TreeConfig(True, 5, 1)


def test_each_mode_fills_in_its_own_defaults():
    assert SpeculationConfig() == SpeculationConfig.of() == SpeculationConfig(FIXED_TREE, "fixed")
    assert SpeculationConfig.of("fixed").tree == TreeConfig(60, 5, 10)
    assert SpeculationConfig.of("auto").tree == AUTO_TREE_CAPS == TreeConfig(96, 8, 8)
    assert SpeculationConfig.of("auto", depth=6).tree == TreeConfig(96, 6, 8)
    assert SpeculationConfig.of("fixed", total_tokens=16, top_k=4).tree == TreeConfig(16, 5, 4)
    assert SpeculationConfig.of("auto").auto and not SpeculationConfig.of("fixed").auto
    assert SpeculationConfig.of("auto", 32, 6, 4).describe() == "auto, caps 32/6/4"
    assert SpeculationConfig.of("fixed").describe() == "60/5/10"
    with pytest.raises(ValueError, match="mode must be fixed or auto, got 'dynamic'"):
        SpeculationConfig.of("dynamic")
    with pytest.raises(ValueError, match="mode must be fixed or auto"):
        SpeculationConfig(FIXED_TREE, "Auto")
    with pytest.raises(ValueError, match="depth must be below total_tokens"):  # auto's depth 8 over a cap of 8
        SpeculationConfig.of("auto", total_tokens=8)


def _study(tree: dict, tmp_path) -> dict:
    return {"name": "t", "out": str(tmp_path / "s"), "target": {"path": "T"}, "drafters": {"out": str(tmp_path)},
            "variants": {"base": "baseline"}, "eval": {"tree": tree}}


def test_a_study_config_gets_the_same_settings_as_the_command_line(tmp_path):
    # before, `mode: auto` without a shape ran with the fixed trees' 60/5/10 as its caps
    assert study_from_dict(_study({"mode": "auto"}, tmp_path)).settings.speculation == SpeculationConfig.of("auto")
    assert study_from_dict(_study({"mode": "auto", "top_k": 4}, tmp_path)).settings.speculation.tree == \
        TreeConfig(96, 8, 4)
    assert study_from_dict(_study({}, tmp_path)).settings.speculation == SpeculationConfig.of("fixed")
    with pytest.raises(StudyConfigError, match=r"^<dict>: eval\.tree\.depth must be below total_tokens"):
        study_from_dict(_study({"total_tokens": 3, "depth": 5}, tmp_path))
    with pytest.raises(StudyConfigError, match=r"eval\.tree\.top_k must be a positive integer, got '4'"):
        study_from_dict(_study({"top_k": "4"}, tmp_path))
    config = _study({"mode": "auto", "total_tokens": 32}, tmp_path)
    assert study_from_dict(config).settings.speculation.as_config() == \
        {"total_tokens": 32, "depth": 8, "top_k": 8, "mode": "auto"}


def test_the_command_line_refuses_a_bad_shape_in_one_line(target_dir, capsys):
    base = ["generate", "--target", str(target_dir), "--prompt-ids", "5,6,7", "--device", "cpu"]
    assert main(base + ["--total-tokens", "3", "--depth", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "depth must be below total_tokens" in err and "--depth" in err
    assert main(base + ["--tree", "auto", "--total-tokens", "8"]) == 2  # auto's default depth 8 is a cap of 8
    assert "depth 8 and total_tokens 8" in capsys.readouterr().err


class _Unloadable:
    """Stands for the heads of a run: the policy must not load any for fixed trees."""

    def __iter__(self):
        raise AssertionError("fixed trees load no head")


def test_the_policy_is_none_for_fixed_trees_and_auto_needs_a_head(target, target_dir, capsys):
    assert tree_policy(target, _Unloadable(), SpeculationConfig.of("fixed")) is None
    for heads in ([], [LookupSpec()]):  # plain decoding, prompt lookup: no tree to size
        with pytest.raises(ValueError, match="--tree auto sizes the trees of EAGLE heads"):
            tree_policy(target, heads, SpeculationConfig.of("auto"))
    # the same rule on every path: `taps generate` without a drafter (before: auto was ignored)
    assert main(["generate", "--target", str(target_dir), "--prompt-ids", "5,6,7", "--device", "cpu",
                 "--tree", "auto"]) == 2
    assert "--tree auto sizes the trees of EAGLE heads" in capsys.readouterr().err
