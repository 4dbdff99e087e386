"""Proposers: one drafter (single.py) or, in later issues, compositions of several."""

from taps.propose.base import Proposer
from taps.propose.single import SingleProposer

__all__ = ["Proposer", "SingleProposer"]
