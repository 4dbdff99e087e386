"""TAPS: task-aware speculative decoding with EAGLE-2 / HASS draft heads.

Data flows one way: context -> proposer -> DraftTree -> Target.forward_tree -> verify -> commit.
"""

__version__ = "0.1.0"
