"""Per image: does Triton's answer agree with legacy's (app.shadow.compare on full logits, as shadow mode
judges live traffic)? For the run: agreement, score differences, latency."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app.contract import Prediction
from app.scores import Scores, softmax
from app.shadow import compare as compare_logits
from report.percentiles import percentile

LEGACY, TRITON = "legacy", "triton"
BACKENDS = (LEGACY, TRITON)


@dataclass(frozen=True)
class Answer:
    """One backend's answer to one image: its top-k (best first) and round-trip time, or what went wrong."""

    backend: str
    seconds: float | None = None
    top: tuple[Prediction, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Agreement:
    same_top1: bool
    topk_overlap: float  # share of legacy's top-k that Triton's top-k also holds
    max_score_diff: float

    @property
    def score(self) -> tuple[int, float, float]:
        """Sorts the worst first: top-1 differs, then least overlap, then largest score difference."""
        return (int(self.same_top1), self.topk_overlap, -self.max_score_diff)


@dataclass(frozen=True)
class Outcome:
    """One input file: skipped (not an image the shim reads), or both answers and how they compare."""

    name: str
    skipped: str | None = None
    legacy: Answer | None = None
    triton: Answer | None = None
    agreement: Agreement | None = None


def from_logits(legacy: npt.NDArray[np.float32], triton: npt.NDArray[np.float32], k: int,
                scores: Scores = softmax) -> Agreement:
    result = compare_logits(legacy, triton, k=k, tolerance=0.0, scores=scores)
    return Agreement(result.same_top1, result.topk_overlap, result.max_abs_diff)


@dataclass(frozen=True)
class Latency:
    samples: tuple[float, ...]  # seconds, sorted

    def percentile(self, p: float) -> float | None:
        return percentile(self.samples, p)

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


@dataclass(frozen=True)
class Summary:
    files: int
    skipped: int
    compared: int  # images both backends answered
    same_top1: int
    topk_overlap_mean: float | None
    score_diffs: tuple[float, ...]  # per compared image, sorted
    errors: dict[str, int]  # failed calls per backend (a shim's fallback to legacy is Triton's)
    latency: dict[str, Latency]

    @property
    def images(self) -> int:
        return self.files - self.skipped

    @property
    def top1_agreement(self) -> float | None:
        return self.same_top1 / self.compared if self.compared else None

    @property
    def score_diff_p99(self) -> float | None:
        return percentile(self.score_diffs, 99)

    @property
    def score_diff_max(self) -> float | None:
        return self.score_diffs[-1] if self.score_diffs else None

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())

    @property
    def p99_ratio(self) -> float | None:
        legacy, triton = self.latency[LEGACY].percentile(99), self.latency[TRITON].percentile(99)
        return triton / legacy if legacy and triton is not None else None


def summarize(outcomes: Iterable[Outcome]) -> Summary:
    outcomes = list(outcomes)
    agreements = [o.agreement for o in outcomes if o.agreement is not None]
    answers = [a for o in outcomes for a in (o.legacy, o.triton) if a is not None]
    return Summary(
        files=len(outcomes),
        skipped=sum(o.skipped is not None for o in outcomes),
        compared=len(agreements),
        same_top1=sum(a.same_top1 for a in agreements),
        topk_overlap_mean=sum(a.topk_overlap for a in agreements) / len(agreements) if agreements else None,
        score_diffs=tuple(sorted(a.max_score_diff for a in agreements)),
        errors={b: sum(a.backend == b and not a.ok for a in answers) for b in BACKENDS},
        latency={b: Latency(tuple(sorted(a.seconds for a in answers if a.backend == b and a.ok
                                            and a.seconds is not None))) for b in BACKENDS},
    )


def worst(outcomes: Iterable[Outcome], n: int) -> list[Outcome]:
    """The n compared images that disagree at all, worst first (file name breaks ties)."""
    compared = [o for o in outcomes if o.agreement is not None and o.agreement.score != (1, 1.0, 0.0)]
    return sorted(compared, key=lambda o: (o.agreement.score if o.agreement else (1, 1.0, 0.0), o.name))[:n]
