"""`taps adapt --focus lookup-misses` (serve/adapt_focus.py): the loss drops exactly the answer
tokens the lookup member would have drafted as its first choice, replayed as the server saw each
record (prompt lookup over the context so far, the datastore of the answers logged before it)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from taps.data.chat import answer_spans
from taps.serve.adapt_focus import covered_mask, focus_features

SPECIAL = {0}  # id 0 ends the role header in these records, as ChatML's <|im_start|> does


def record(prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    return [*prompt, *answer], [0] * len(prompt) + [1] * len(answer)


def test_answer_spans_are_the_runs_of_ones():
    assert answer_spans([0, 1, 1, 0, 0, 1]) == [(1, 3), (5, 6)]
    assert answer_spans([0, 0]) == [] and answer_spans([1, 1]) == [(0, 2)]


def test_prompt_lookup_covers_a_copied_span_after_its_first_token():
    """The answer copies the prompt's 21 22 23 24: from the second copied token on, the context's
    last token occurs in the prompt followed by the answer's next token. 90 91 occur nowhere."""
    ids, mask = record([0, 5, 21, 22, 23, 24, 6, 0, 7], [21, 22, 23, 24, 90, 91])
    covered = covered_mask([(ids, mask)], SPECIAL)[0]
    assert covered[:9] == [False] * 9  # the prompt: never in the loss anyway
    assert covered[9:] == [False, True, True, True, False, False]


def test_the_datastore_covers_what_earlier_answers_said_and_never_the_record_itself():
    """The second record repeats the first's answer, which its prompt does not hold: covered by
    the datastore of earlier answers (from its second token on: the first has no context match in
    it); the first record, with nothing logged before it, is not covered by its own answer."""
    answer = [40, 41, 42, 43, 44]
    first = record([0, 5, 6, 0, 7], answer)
    second = record([0, 8, 9, 0, 7], answer)
    covered = covered_mask([first, second], SPECIAL)
    assert covered[0][5:] == [False] * 5
    assert covered[1][5:] == [True] * 5  # the header token 7 precedes 40 in the stored segment


def test_focus_features_drop_covered_tokens_from_the_loss_only(target_dir, tmp_path):
    from taps.core.target import Target
    from taps.data.chat import special_ids
    from taps.data.features import FeatureSettings, extract_features

    target = Target.load(target_dir, device="cpu", dtype="float32")
    data = tmp_path / "data.jsonl"
    answer = "one two three four five six seven"
    rows = [{"conversations": [{"role": "user", "content": f"Say {answer} please, {i}"},
                               {"role": "assistant", "content": f"{answer}, {i}"}]} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extract_features(target, data, tmp_path / "f", FeatureSettings(max_len=64), progress=None)
    focus = focus_features(tmp_path / "f", tmp_path / "focus", special_ids(target.tokenizer))
    before, after = load_file(tmp_path / "f" / "shard-00000.safetensors"), \
        load_file(tmp_path / "focus" / "shard-00000.safetensors")
    for key in ("input_ids", "hidden", "offsets"):
        assert torch.equal(before[key], after[key])
    kept, was = after["loss_mask"] != 0, before["loss_mask"] != 0
    assert bool((kept <= was).all())  # only drops
    assert focus["answer_tokens"] == int(was.sum()) and focus["covered"] == int((was & ~kept).sum())
    assert 0 < focus["covered"] < focus["answer_tokens"]  # the answers copy their prompts, in part
    ids, mask, offsets = before["input_ids"].tolist(), before["loss_mask"].tolist(), before["offsets"].tolist()
    covered = covered_mask([(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])],
                           special_ids(target.tokenizer))
    assert [bool(m) and not c for c, m in zip((c for r in covered for c in r), mask)] == kept.tolist()
    manifest = json.loads((tmp_path / "focus" / "manifest.json").read_text())
    assert manifest["data_digest"].endswith("+lookup-misses") and manifest["focus"] == focus
    assert focus_features(tmp_path / "f", tmp_path / "focus", set()) == focus  # complete: read, not rebuilt
    assert not list(tmp_path.glob(".focus.*"))


@pytest.mark.parametrize("bad", ["none", "misses"])
def test_an_unknown_focus_is_refused(bad):
    from taps.serve.adapt import AdaptSettings

    with pytest.raises(ValueError, match="--focus"):
        AdaptSettings(focus=bad)
