"""Proposers: one drafter (single.py), or compositions of several: routing (routed.py) and merged
trees (merged.py). factory.py maps strategy names to them."""

from taps.propose.base import Proposer
from taps.propose.merged import MergedProposer
from taps.propose.routed import RoutedProposer
from taps.propose.single import SingleProposer

__all__ = ["MergedProposer", "Proposer", "RoutedProposer", "SingleProposer"]
