"""report/percentiles.py: the nearest-rank definition every printed p50/p99 uses, and who uses it."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from report.percentiles import percentile
from tests.support import ROOT

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton


def test_nearest_rank_is_a_measured_value_with_p_percent_at_or_below_it() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100, shuffled: order does not matter
    shuffled = list(np.random.default_rng(0).permutation(values))
    assert [percentile(shuffled, p) for p in (0, 1, 50, 90, 99, 99.5, 100)] == [1, 1, 50, 90, 99, 100, 100]
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    # 99.9% of 1000 values is rank 999 exactly (floating point alone would give 999.0000000000001 -> 1000)
    assert percentile(range(1, 1001), 99.9) == 999
    # Ten samples: the p99 is the slowest of them, where linear interpolation invents a value none had.
    ten = [10.0] * 9 + [200.0]
    assert percentile(ten, 99) == 200.0 and float(np.percentile(ten, 99)) == pytest.approx(182.9)
    for p in (50, 90, 99):  # what the definition promises: at least p% at or below, and it is one of them
        v = percentile(shuffled, p)
        assert v in values and sum(x <= v for x in values) >= p and sum(x < v for x in values) < p
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_every_percentile_the_project_computes_goes_through_app_percentiles() -> None:
    """No other definition creeps back: no numpy or statistics percentile, median or quantile in the code
    that prints figures (app/, bench/, tools/, tests/hostile/)."""
    others = {"percentile", "quantile", "median", "nanpercentile", "nanquantile", "nanmedian", "quantiles"}
    found = []
    for folder in ("app", "bench", "tools", "tests/hostile"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in others and isinstance(node.value, ast.Name) \
                        and node.value.id in {"np", "numpy", "statistics"}:
                    found.append(f"{Path(path).relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, "use report.percentiles.percentile: " + ", ".join(found)
