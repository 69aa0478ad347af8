"""The migration report's per-image comparison, summary and verdict, on answers made here."""

from __future__ import annotations

import numpy as np
import pytest

from app.contract import Prediction
from report.compare import (
    LEGACY,
    TRITON,
    Agreement,
    Answer,
    Outcome,
    from_logits,
    summarize,
    worst,
)
from report.verdict import Thresholds, judge, percent

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton


def top(*pairs: tuple[int, float]) -> tuple[Prediction, ...]:
    return tuple(Prediction(f"class {c}", c, s) for c, s in pairs)


def outcome(name: str, *, same: bool = True, overlap: float = 1.0, diff: float = 1e-6, legacy_ms: float = 10,
            triton_ms: float = 10, triton_error: str | None = None) -> Outcome:
    legacy = Answer(LEGACY, legacy_ms / 1000, top((1, 0.9), (2, 0.05)))
    triton = Answer(TRITON, triton_ms / 1000, () if triton_error else top((1 if same else 2, 0.9), (3, 0.05)),
                    error=triton_error)
    agreement = None if triton_error else Agreement(same, overlap, diff)
    return Outcome(name, legacy=legacy, triton=triton, agreement=agreement)


def test_logits_compare_as_shadow_mode_does() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    assert from_logits(logits, logits.copy(), 5) == Agreement(True, 1.0, 0.0)
    other = logits.copy()
    best = int(np.argmax(logits))
    other[best] -= 100  # the best class falls out of the top 5
    result = from_logits(logits, other, 5)
    assert not result.same_top1 and result.topk_overlap == pytest.approx(0.8) and result.max_score_diff > 0


def test_everything_within_thresholds_is_go() -> None:
    summary = summarize([outcome(f"{i}.jpg") for i in range(20)] + [Outcome("notes.json", skipped="invalid_image")])
    verdict = judge(summary, Thresholds(), k=5)
    assert verdict.go and verdict.label == "GO" and verdict.failed == []
    assert [c.result for c in verdict.checks] == ["PASS"] * 5
    assert summary.files == 21 and summary.skipped == 1 and summary.images == 20 and summary.compared == 20


@pytest.mark.parametrize(("outcomes", "thresholds", "failing"), [
    ([outcome("a", same=False)] + [outcome(f"{i}") for i in range(99)], Thresholds(min_top1_agreement=0.999),
     "top-1 agreement"),
    ([outcome("a", overlap=0.6)] + [outcome(f"{i}") for i in range(9)], Thresholds(min_topk_overlap=0.99),
     "mean top-5 overlap"),
    ([outcome("a", diff=0.2)] + [outcome(f"{i}") for i in range(9)], Thresholds(max_score_diff=0.01),
     "p99 score difference"),
    ([outcome(f"{i}", triton_ms=30) for i in range(10)], Thresholds(max_p99_ratio=1.2),
     "p99 latency ratio (Triton / legacy)"),
    ([outcome("a", triton_error="503 backend_unavailable: down")] + [outcome(f"{i}") for i in range(9)],
     Thresholds(max_errors=0), "errors"),
])
def test_each_threshold_alone_makes_a_no_go(outcomes: list[Outcome], thresholds: Thresholds, failing: str) -> None:
    verdict = judge(summarize(outcomes), thresholds, k=5)
    assert not verdict.go and verdict.label == "NO-GO"
    assert verdict.failed == [failing], [(c.name, c.measured, c.threshold) for c in verdict.checks]


def test_thresholds_that_allow_it_make_it_go_again() -> None:
    outcomes = [outcome("a", same=False, triton_error=None)] + [outcome(f"{i}", triton_ms=11) for i in range(9)]
    assert not judge(summarize(outcomes), Thresholds(), k=5).go
    assert judge(summarize(outcomes), Thresholds(min_top1_agreement=0.9), k=5).go


def test_nothing_compared_is_never_a_go() -> None:
    outcomes = [outcome(f"{i}", triton_error="503 backend_unavailable: down") for i in range(3)]
    verdict = judge(summarize(outcomes), Thresholds(max_errors=100), k=5)
    assert not verdict.go
    assert set(verdict.failed) == {"top-1 agreement", "mean top-5 overlap", "p99 score difference",
                                   "p99 latency ratio (Triton / legacy)"}
    assert all("n/a" in c.measured for c in verdict.checks if not c.passed)


def test_the_measured_share_never_rounds_across_the_threshold() -> None:
    assert percent(0.99899) == "99.899%" and percent(0.999) == "99.9%" and percent(1.0) == "100%"
    assert percent(0.29) == "29%" and percent(0.0) == "0%"
    outcomes = [outcome("a", same=False)] + [outcome(f"{i}") for i in range(998)]  # 998 of 999 = 99.8999%
    check = judge(summarize(outcomes), Thresholds(min_top1_agreement=0.999), k=5).checks[0]
    assert not check.passed and check.measured == "99.899% (998 of 999)" and check.threshold == ">= 99.9%"


def test_p99_ratio_is_triton_over_legacy() -> None:
    summary = summarize([outcome(f"{i}", legacy_ms=10, triton_ms=12) for i in range(10)])
    assert summary.p99_ratio == pytest.approx(1.2)
    assert summary.latency[LEGACY].percentile(50) == pytest.approx(0.010)


def test_failed_calls_count_per_backend_and_have_no_latency() -> None:
    summary = summarize([outcome("a", triton_error="fallback: legacy answered a request for triton"), outcome("b")])
    assert summary.errors == {LEGACY: 0, TRITON: 1} and summary.error_total == 1
    assert len(summary.latency[TRITON].samples) == 1 and len(summary.latency[LEGACY].samples) == 2


@pytest.mark.parametrize("bad", [{"min_top1_agreement": 1.5}, {"min_topk_overlap": -0.1}, {"max_score_diff": 2},
                                 {"max_p99_ratio": 0}, {"max_errors": -1}])
def test_thresholds_out_of_range_are_refused_with_the_option_name(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="--" + next(iter(bad)).replace("_", "-")):
        Thresholds(**bad)  # type: ignore[arg-type]


def test_worst_lists_disagreements_worst_first_and_leaves_identical_answers_out() -> None:
    outcomes = [outcome("identical", diff=0.0), outcome("small", diff=1e-5), outcome("flip", same=False, diff=0.3),
                outcome("overlap", overlap=0.8, diff=0.01), outcome("broken", triton_error="504 backend_timeout")]
    assert [o.name for o in worst(outcomes, 10)] == ["flip", "overlap", "small"]
    assert [o.name for o in worst(outcomes, 1)] == ["flip"]
