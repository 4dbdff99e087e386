"""The English filter of `taps data mix --english` and of a head family's chat data: a heuristic on
the text alone (no language model), documented in is_english so that its errors are predictable.
Records are those of data/sources.py (`conversations` of role / content turns).
"""

from __future__ import annotations

import re

_ENGLISH_WORDS = frozenset(
    "the and of to is it this that you what how with for are was be not can your my have has will would "
    "which if but on from by at they we he she i or as".split())
# frequent function words of the other Latin-script languages common in ShareGPT (es, fr, de, it, pt, nl)
_OTHER_WORDS = frozenset(
    "que el los las del por para una con y les des est une pour dans pas qui sur avec et der und ist nicht "
    "das ein eine mit auf ich sie não com os da em di che è sono het een van niet zijn ik".split())
_NON_LETTER_BYTES = bytes(b for b in range(128) if not chr(b).isalpha())
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _ascii_letter_share(text: str) -> float:
    """Share of ASCII letters among the letters of text (1.0 without letters), at C speed: the
    bundled ShareGPT file has 125 MB of text."""
    if text.isascii():  # O(1) in CPython: most turns take this path
        return 1.0
    ascii_letters = len(text.encode("ascii", "ignore").translate(None, _NON_LETTER_BYTES))
    other_letters = sum(ch.isalpha() for run in _NON_ASCII.findall(text) for ch in run)
    letters = ascii_letters + other_letters
    return 1.0 if letters == 0 else ascii_letters / letters


def is_english(conversations: list[dict], min_ascii_share: float = 0.9) -> bool:
    """A heuristic, documented so its errors are predictable: a conversation is English when
    (1) in every turn at least `min_ascii_share` of the letters are ASCII (drops other scripts, even a
    Chinese question answered with code), and (2) among the whitespace-separated words of the user
    turns, English function words are at least as frequent as those of Spanish, French, German,
    Italian, Portuguese and Dutch (drops Latin-script languages; code and one-word turns like
    "continue" tie at zero and count as English).
    On the bundled ShareGPT file it keeps 16,967 of the 17,324 usable conversations."""
    if any(_ascii_letter_share(turn["content"]) < min_ascii_share for turn in conversations):
        return False
    english = other = 0
    for turn in conversations:
        if turn["role"] == "user":
            words = turn["content"].lower().split()
            english += sum(map(_ENGLISH_WORDS.__contains__, words))
            other += sum(map(_OTHER_WORDS.__contains__, words))
    return english >= other


def english_only(records: list[dict], min_ascii_share: float = 0.9) -> list[dict]:
    """The records whose conversation `is_english`."""
    return [r for r in records if is_english(r["conversations"], min_ascii_share)]
