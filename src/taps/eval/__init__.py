"""The study harness: benchmarks, runner, metrics, report."""
