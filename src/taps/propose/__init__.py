"""Proposers: one drafter (single.py), or compositions of several: routing (routed.py) and merged
trees (merged.py). factory.py maps strategy names to them. base.py holds the Proposer protocol,
the only thing the decoding core (decode.py) knows about drafting.

This package file imports nothing: importing the protocol (taps.core.proposer) must not load
every proposer (tests/test_import_graph.py)."""
