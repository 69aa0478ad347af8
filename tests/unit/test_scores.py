"""The best classes, found without sorting all 1,000 scores, are the ones a full stable sort gives; a batch ranked at
once answers each row exactly as that row alone would (the legacy app's answers, to the bit)."""

from __future__ import annotations

import numpy as np
import pytest

from app.scores import SCORE_FUNCTIONS, Ranking, best, softmax

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton


def full_sort(probs: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in np.argsort(-probs, kind="stable")[:k]]


def test_the_top_k_of_imagenet_sized_scores_match_a_full_sort() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        probs = softmax(rng.standard_normal(1000).astype(np.float32))
        for k in (1, 5, 10):
            assert best(probs, k) == full_sort(probs, k)


@pytest.mark.parametrize("seed", range(5))
def test_ties_keep_class_order_and_nans_and_infinities_rank_as_a_full_sort_ranks_them(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for trial in range(2000):
        probs = rng.integers(0, 4, int(rng.integers(1, 40))).astype(np.float32)  # many ties
        if trial % 3 == 0:
            probs[rng.integers(0, probs.size, 2)] = np.nan
        if trial % 5 == 0:
            probs[rng.integers(0, probs.size)] = np.inf
        k = int(rng.integers(1, 8))
        assert best(probs, k) == full_sort(probs, k), (probs, k)


def one_by_one(rows: list[np.ndarray], k: int, scores: str) -> list[tuple[list[int], list[float]]]:
    """As a request would answer alone: its own row's scores, then a full stable sort of them."""
    answers = []
    for row in rows:
        probs = SCORE_FUNCTIONS[scores](row)
        top = full_sort(probs, k)
        answers.append((top, [float(probs[i]) for i in top]))
    return answers


@pytest.mark.parametrize("scores", sorted(SCORE_FUNCTIONS))
def test_a_batch_ranked_at_once_answers_each_row_as_it_would_alone(scores: str) -> None:
    rng = np.random.default_rng(1)
    for trial in range(300):
        n, classes, k = int(rng.integers(1, 20)), int(rng.integers(1, 40)), int(rng.integers(0, 8))
        if trial % 3 == 0:  # ties at the cut: those rows take best() itself
            batch = rng.integers(-3, 3, (n, classes)).astype(np.float32)
        else:
            batch = rng.standard_normal((n, classes)).astype(np.float32) * 10
        if trial % 7 == 0:
            batch[0, rng.integers(0, classes)] = np.nan
        rows = list(batch)
        ranked = Ranking(k, SCORE_FUNCTIONS[scores]).rank(rows)
        for answer, (classes_alone, scores_alone), row in zip(ranked, one_by_one(rows, k, scores), rows, strict=True):
            assert answer.outputs is row
            assert answer.classes == classes_alone, (row, k)
            assert np.array_equal(answer.scores, scores_alone, equal_nan=True), (answer.scores, scores_alone)


def test_imagenet_sized_batches_rank_as_their_rows_alone_to_the_bit() -> None:
    rng = np.random.default_rng(2)
    rows = list(rng.standard_normal((32, 1000)).astype(np.float32) * 4)
    ranked = Ranking(5).rank(rows)
    assert [(r.classes, r.scores) for r in ranked] == one_by_one(rows, 5, "softmax")


def test_rows_of_different_lengths_are_each_ranked_alone() -> None:
    rows = [np.array([0.0, 2.0, 1.0], dtype=np.float32), np.array([5.0, 1.0], dtype=np.float32)]
    ranked = Ranking(2).rank(rows)
    assert [r.classes for r in ranked] == [[1, 2], [0, 1]]
    assert Ranking(2).rank([]) == []
