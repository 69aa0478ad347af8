"""The one definition of every percentile the project prints or judges (docs/testing.md): nearest rank, the
ceil(p/100 * n)-th smallest value, always one that was measured; no interpolation between samples."""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction


def percentile(values: Iterable[float], p: float) -> float | None:
    """The nearest-rank p-th percentile (p in 0-100: 50 is the median, 100 the maximum); None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"a percentile is between 0 and 100, not {p}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = math.ceil(Fraction(str(p)) * len(ordered) / 100)  # exact: 99.9% of 1000 values is rank 999, not 1000
    return ordered[max(rank, 1) - 1]


def median(values: Iterable[float]) -> float:
    """percentile(values, 50), for figures that always have values (a benchmark's repeated timings)."""
    found = percentile(values, 50)
    if found is None:
        raise ValueError("the median of no values")
    return found
