"""Averaging weights, checked without torch: the composition grammar (propose/spec.py) checks a
variant's weights when it is parsed, drafter/average.py when it averages."""

from __future__ import annotations

import math
from collections.abc import Sequence

WEIGHT_TOLERANCE = 1e-6


class AverageError(ValueError):
    """Heads that cannot be averaged, or weights that are not a convex combination."""


def check_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """Weights for n heads: uniform when None; else n finite non-negative numbers summing to 1."""
    if n < 1:
        raise AverageError("averaging needs at least one head")
    if weights is None:
        return [1.0 / n] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise AverageError(f"{len(weights)} weight(s) for {n} head(s): give one weight per head")
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        raise AverageError(f"weights must be finite and non-negative, got {weights}")
    if abs(sum(weights) - 1.0) > WEIGHT_TOLERANCE:
        raise AverageError(f"weights must sum to 1, got {weights} (sum {sum(weights):.6g})")
    return weights
