"""The study harness: benchmarks, runner, metrics, the report (its tables and figures)."""
