"""The composition grammar (propose/spec.py): every SPEC form parses to the intended spec, the\ngenerate sugar builds the same spec, every mistake is one line naming the spec and what was\nexpected, and the factory implements exactly the names of the table."""

from __future__ import annotations

import pytest

from taps.propose import spec as grammar
from taps.propose.spec import VariantSpecError, parse_spec, parse_variant, spec_from_options, variant_from_config


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
    bandit = parse_spec("r", "route-bandit-turn:a,b")
    assert (bandit.strategy, bandit.signal, bandit.granularity) == ("route", "bandit", "turn")
    assert parse_spec("r", "route-bandit:a,b").granularity == "step"
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
    ("x=merge:m=a,m=b", "names must be distinct"),
    ("x=single:a,b", "exactly one drafter"),
    ("x=single-trie:a", "takes none"),
])
def test_mistakes_are_named(text, message):
    with pytest.raises(VariantSpecError, match=message) as err:
        parse_variant(text)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"--variant {text!r}" if message == "expected NAME=SPEC" else f"variant {text}: ")


@pytest.mark.parametrize("text, expected", [
    ("route-fast:a,b", "expected one of confidence, entropy, bandit, step, turn"),
    ("merge-union:a,b", "expected one of disjoint, trie, budget"),
    ("baseline:a", "baseline takes no drafters"),
    ("single:=b", "drafter '=b' is not [name=]DIR"),
    ("average-0.5-0.6:a,b", "weights must sum to 1"),
    ("route:a,a", "drafter names must be distinct, got a, a"),
    ("vote:a,b", "vote:a,b"),  # not a strategy: one directory of that name (loading it names it)
])
def test_generate_spec_mistakes_name_the_spec(text, expected):
    if text == "vote:a,b":
        assert parse_spec("generate", text).drafters == (("vote:a,b", "vote:a,b"),)
        return
    with pytest.raises(VariantSpecError) as err:
        parse_spec("generate", text, where=f"--variant {text}")
    assert str(err.value).startswith(f"--variant {text}: ") and expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("options, text", [
    (dict(), "DIR"),
    (dict(strategy="route", signal="entropy", granularity="turn"), "route-entropy-turn:math=DIR,chat=DIR2"),
    (dict(strategy="merge", merge_mode="budget"), "merge-budget:math=DIR,chat=DIR2"),
    (dict(strategy="average", weights=[0.3, 0.7]), "average-0.3-0.7:math=DIR,chat=DIR2"),
    (dict(strategy="average"), "average:math=DIR,chat=DIR2"),
])
def test_generate_sugar_builds_the_same_spec(options, text):
    drafters = [("math", "DIR")] if "," not in text else [("math", "DIR"), ("chat", "DIR2")]
    if text == "DIR":
        drafters = [("DIR", "DIR")]
    assert spec_from_options(drafters, **options) == parse_spec("generate", text)
    assert spec_from_options([]) == parse_spec("generate", "baseline")
    with pytest.raises(VariantSpecError, match="--strategy merge needs --drafter"):
        spec_from_options([], strategy="merge")


def test_one_name_table():
    from taps.propose.factory import MERGES, ROUTING_SIGNALS

    assert list(ROUTING_SIGNALS) == list(grammar.SIGNALS) and list(MERGES) == list(grammar.MERGE_MODES)
    assert grammar.DEFAULTS == {"signal": "confidence", "granularity": "step", "merge_mode": "disjoint"}
    for table in (grammar.STRATEGIES, grammar.SIGNALS, grammar.GRANULARITIES, grammar.MERGE_MODES):
        assert all(name in grammar.SPEC_HELP for name in table if name not in ("single",))


def test_config_mappings():
    v = variant_from_config("r", {"strategy": "route", "drafters": {"math": "a", "chat": "b"},
                                  "granularity": "turn"}, "cfg")
    assert v.drafters == (("math", "a"), ("chat", "b")) and v.granularity == "turn"
    with pytest.raises(VariantSpecError, match="unknown keys mode"):
        variant_from_config("r", {"strategy": "merge", "drafters": ["a", "b"], "mode": "trie"}, "cfg")
    with pytest.raises(VariantSpecError, match="SPEC string or a mapping"):
        variant_from_config("r", 3, "cfg")
