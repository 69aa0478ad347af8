"""Model outputs -> class scores and the best classes, computed one way for answers and shadow comparisons.

How a model's outputs become scores is its description's [output] scores: softmax of logits (one class per
image), a sigmoid per class (multi-label), or probabilities taken as they come. Each function takes one row or a
batch of rows ([N, classes]) and answers each row as it would alone, to the bit.

Ranking.rank answers a whole batch in a few numpy calls, in the batch sender's thread: per request, the same work
on a 1,000-class row let go of the GIL a few times per image for the other request threads to take, and the shim
spent 1-20 % more CPU per image (bench/RESULTS.md, "The answer ranked once per batch").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Scores = Callable[[npt.NDArray[np.float32]], npt.NDArray[np.float32]]


def softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """In float32, as torch.softmax computes it (the legacy app's scores); over the last axis."""
    exp = np.exp(logits.astype(np.float32) - logits.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, dtype=np.float32, keepdims=True)  # type: ignore[no-any-return]


def sigmoid(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Per class, in float32, as torch.sigmoid computes it: 1 / (1 + exp(-x))."""
    x = logits.astype(np.float32)
    out: npt.NDArray[np.float32] = np.float32(1) / (np.float32(1) + np.exp(-x))
    return out


def probabilities(outputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """A model that answers probabilities already: its outputs are the scores."""
    return outputs.astype(np.float32, copy=False)


SCORE_FUNCTIONS: dict[str, Scores] = {"softmax": softmax, "sigmoid": sigmoid, "probabilities": probabilities}


def best(probs: npt.NDArray[np.float32], k: int) -> list[int]:
    """Indices of the k highest scores of one row, best first; ties keep class order."""
    return best_of_rows(probs.reshape(1, -1), k)[0]


def best_of_rows(probs: npt.NDArray[np.float32], k: int) -> list[list[int]]:
    """The k best classes of each row of [N, classes], best first, ties in class order: what a full stable sort of
    each row gives, in a few calls for the whole batch. Only what can make the top k is sorted (every score >= the
    k-th highest); a row where more than k can (a tie at the cut) or fewer (a NaN, which partition ranks first and
    the sort last) is sorted whole."""
    n, classes = probs.shape
    if not 0 < k < classes:
        return [_sorted_whole(row, k) for row in probs]
    kth = np.partition(probs, classes - k, axis=1)[:, classes - k]
    candidates = probs >= kth[:, None]
    counts = candidates.sum(axis=1)
    exact = np.flatnonzero(counts == k)  # the common case: exactly k can make the top k
    answer: list[list[int]] = [[] for _ in range(n)]
    if exact.size:
        ids = np.nonzero(candidates[exact])[1].reshape(exact.size, k)  # in class order
        order = np.argsort(-np.take_along_axis(probs[exact], ids, axis=1), axis=1, kind="stable")
        for row, chosen in zip(exact.tolist(), np.take_along_axis(ids, order, axis=1).tolist(), strict=True):
            answer[row] = chosen
    for row in np.flatnonzero(counts != k).tolist():
        answer[row] = _sorted_whole(probs[row], k)
    return answer


def _sorted_whole(row: npt.NDArray[np.float32], k: int) -> list[int]:
    return [int(i) for i in np.argsort(-row, kind="stable")[:k]]


@dataclass(frozen=True)
class Ranked:
    """One request's answer from its backend: the model's outputs for it and its k best classes, best first."""

    outputs: npt.NDArray[np.float32]  # as the model answered them (shadow mode compares these)
    classes: list[int]
    scores: list[float]


@dataclass(frozen=True)
class Ranking:
    """How the rows of one batch become answers: the description's scores, then the top k of each row."""

    k: int
    scores: Scores = softmax

    def rank(self, rows: Sequence[npt.NDArray[np.float32]]) -> list[Ranked]:
        if len({row.shape for row in rows}) > 1:  # rows of one backend call have one shape; else each alone
            return [self.rank([row])[0] for row in rows]
        if not rows:
            return []
        probs = self.scores(np.stack(rows)).reshape(len(rows), -1)
        tops = best_of_rows(probs, self.k)
        return [Ranked(row, top, probs[i, top].tolist()) for i, (row, top) in enumerate(zip(rows, tops, strict=True))]
