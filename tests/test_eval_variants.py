"""Variant SPEC strings: every form parses to the intended spec; every mistake is named."""

from __future__ import annotations

import pytest

from taps.eval.variants import VariantSpecError, parse_spec, parse_variant, variant_from_config


def test_forms():
    assert parse_variant("base=baseline").strategy == "baseline"
    single = parse_variant("m=models/d/hass-math")
    assert single.strategy == "single" and single.drafters == (("hass-math", "models/d/hass-math"),)
    assert parse_spec("m", "single:math=a/b").drafters == (("math", "a/b"),)
    avg = parse_spec("a", "average-0.3:math=a,chat=b")
    assert avg.weights == pytest.approx((0.3, 0.7)) and avg.member_names == ["math", "chat"]
    assert parse_spec("a", "average:x/a,y/b").weights is None
    three = parse_spec("a", "average-0.2-0.3-0.5:a,b,c")
    assert three.weights == (0.2, 0.3, 0.5) and three.member_names == ["a", "b", "c"]
    route = parse_spec("r", "route-entropy-turn:a,b")
    assert (route.strategy, route.signal, route.granularity) == ("route", "entropy", "turn")
    assert parse_spec("r", "route:a,b").signal == "confidence"
    assert parse_spec("g", "merge-budget:a,b,c").merge_mode == "budget"
    assert parse_spec("g", "merge:a,b").merge_mode == "disjoint"
    assert avg.describe()["weights"] == pytest.approx([0.3, 0.7])


@pytest.mark.parametrize("text, message", [
    ("nospec", "expected NAME=SPEC"),
    ("a/b=baseline", "expected NAME=SPEC"),
    ("x=route-fast:a,b", "unknown option 'fast' for route; expected one of"),
    ("x=merge-trie-entropy:a,b", "unknown option 'entropy' for merge"),
    ("x=average-half:a,b", "weights \\(numbers\\)"),
    ("x=average-0.2-0.2:a,b", "weights"),
    ("x=route:a", "at least two drafters"),
    ("x=merge:m=a,m=b", "member names must differ"),
    ("x=single:a,b", "exactly one drafter"),
    ("x=single-trie:a", "takes none"),
])
def test_mistakes_are_named(text, message):
    with pytest.raises(VariantSpecError, match=message):
        parse_variant(text)


def test_config_mappings():
    v = variant_from_config("r", {"strategy": "route", "drafters": {"math": "a", "chat": "b"},
                                  "granularity": "turn"}, "cfg")
    assert v.drafters == (("math", "a"), ("chat", "b")) and v.granularity == "turn"
    with pytest.raises(VariantSpecError, match="unknown keys mode"):
        variant_from_config("r", {"strategy": "merge", "drafters": ["a", "b"], "mode": "trie"}, "cfg")
    with pytest.raises(VariantSpecError, match="SPEC string or a mapping"):
        variant_from_config("r", 3, "cfg")
