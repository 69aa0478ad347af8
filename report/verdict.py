"""GO / NO-GO: each check, its measured value, its threshold, PASS or FAIL. A check that could not be
measured (no image compared, no latency of a backend) fails: no evidence is not a GO."""

from __future__ import annotations

import math
from dataclasses import dataclass

from report.compare import LEGACY, TRITON, Summary


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    min_top1_agreement: float = 0.999  # share of compared images whose top-1 class is the same
    min_topk_overlap: float = 0.99  # mean share of legacy's top-k that Triton's top-k holds
    max_score_diff: float = 0.01  # p99 over images of each image's largest probability difference
    max_p99_ratio: float = 1.2  # Triton's p99 latency / legacy's
    max_errors: int = 0  # failed calls of either backend (a shim's fallback to legacy counts as Triton's)

    def __post_init__(self) -> None:
        for name in ("min_top1_agreement", "min_topk_overlap", "max_score_diff"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be from 0 to 1 (or 0% to 100%), "
                                 f"not {getattr(self, name)}")
        if self.max_p99_ratio <= 0:
            raise ValueError(f"--max-p99-ratio must be > 0, not {self.max_p99_ratio}")
        if self.max_errors < 0:
            raise ValueError(f"--max-errors must be >= 0, not {self.max_errors}")


@dataclass(frozen=True)
class Check:
    name: str
    measured: str
    threshold: str
    passed: bool

    @property
    def result(self) -> str:
        return "PASS" if self.passed else "FAIL"


@dataclass(frozen=True)
class Verdict:
    checks: tuple[Check, ...]

    @property
    def go(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def label(self) -> str:
        return "GO" if self.go else "NO-GO"

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]


def percent(share: float) -> str:
    """A share as a percentage, cut (not rounded) to 3 decimals, so that it never shows a measured share above a
    threshold it misses: 998 of 999 is 99.899%, not 99.9%."""
    thousandths = math.floor(share * 100_000 + 1e-6)  # the epsilon keeps 0.29 from becoming 28.999
    text = f"{thousandths / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{text}%"


def judge(summary: Summary, t: Thresholds, *, k: int) -> Verdict:
    none = "n/a (no image was compared)"
    agreement, overlap, diff = summary.top1_agreement, summary.topk_overlap_mean, summary.score_diff_p99
    legacy_p99, triton_p99 = summary.latency[LEGACY].percentile(99), summary.latency[TRITON].percentile(99)
    ratio = summary.p99_ratio
    checks = [
        Check("top-1 agreement",
              none if agreement is None else f"{percent(agreement)} ({summary.same_top1} of {summary.compared})",
              f">= {percent(t.min_top1_agreement)}", agreement is not None and agreement >= t.min_top1_agreement),
        Check(f"mean top-{k} overlap", none if overlap is None else percent(overlap),
              f">= {percent(t.min_topk_overlap)}", overlap is not None and overlap >= t.min_topk_overlap),
        Check("p99 score difference",
              none if diff is None else f"{diff:.2g} (largest {summary.score_diff_max:.2g})",
              f"<= {t.max_score_diff:g}", diff is not None and diff <= t.max_score_diff),
        Check("p99 latency ratio (Triton / legacy)",
              "n/a (a backend has no successful call)" if ratio is None or legacy_p99 is None or triton_p99 is None
              else f"{ratio:.2f} ({triton_p99 * 1000:.1f} ms / {legacy_p99 * 1000:.1f} ms)",
              f"<= {t.max_p99_ratio:g}", ratio is not None and ratio <= t.max_p99_ratio),
        Check("errors", f"{summary.error_total} (legacy {summary.errors[LEGACY]}, triton {summary.errors[TRITON]})",
              f"<= {t.max_errors}", summary.error_total <= t.max_errors),
    ]
    return Verdict(tuple(checks))
