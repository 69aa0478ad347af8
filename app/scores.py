"""Logits -> class probabilities and the best classes, computed one way for answers and shadow comparisons."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """In float32, as torch.softmax computes it (the legacy app's scores)."""
    exp = np.exp(logits.astype(np.float32) - logits.max())
    return exp / exp.sum(dtype=np.float32)  # type: ignore[no-any-return]


def best(probs: npt.NDArray[np.float32], k: int) -> list[int]:
    """Indices of the k highest scores, best first; ties keep class order."""
    if 0 < k < probs.size:  # sort only what can make the top k: every score >= the k-th highest, ties included
        candidates = np.flatnonzero(probs >= np.partition(probs, probs.size - k)[probs.size - k])
        if candidates.size >= k:  # fewer only with NaNs, which partition ranks first and the sort below last
            return [int(i) for i in candidates[np.argsort(-probs[candidates], kind="stable")[:k]]]
    return [int(i) for i in np.argsort(-probs, kind="stable")[:k]]
