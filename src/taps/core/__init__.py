"""The core layer: the target, trees, verification, the cache, the decode loop and the Proposer
protocol (docs/architecture.md). Imports nothing, so importing one module never loads its siblings."""
