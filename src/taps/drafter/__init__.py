"""The EAGLE draft head: module (head.py), its view of the context (context.py), EAGLE-2 tree
expansion (expand.py) and the checkpoint format (checkpoint.py)."""
