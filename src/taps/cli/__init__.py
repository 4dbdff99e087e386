"""The command line: `taps` (main.py), its option helpers (args.py) and one module per command group.
Imports nothing, so importing one module never loads its siblings."""
