"""The best classes, found without sorting all 1,000 scores, are the ones a full stable sort gives."""

from __future__ import annotations

import numpy as np
import pytest

from app.scores import best, softmax

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
