"""Model outputs -> class scores and the best classes, computed one way for answers and shadow comparisons.

How a model's outputs become scores is its description's [output] scores: softmax of logits (one class per
image), a sigmoid per class (multi-label), or probabilities taken as they come.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Scores = Callable[[npt.NDArray[np.float32]], npt.NDArray[np.float32]]


def softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """In float32, as torch.softmax computes it (the legacy app's scores)."""
    exp = np.exp(logits.astype(np.float32) - logits.max())
    return exp / exp.sum(dtype=np.float32)  # type: ignore[no-any-return]


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
    """Indices of the k highest scores, best first; ties keep class order."""
    if 0 < k < probs.size:  # sort only what can make the top k: every score >= the k-th highest, ties included
        candidates = np.flatnonzero(probs >= np.partition(probs, probs.size - k)[probs.size - k])
        if candidates.size >= k:  # fewer only with NaNs, which partition ranks first and the sort below last
            return [int(i) for i in candidates[np.argsort(-probs[candidates], kind="stable")[:k]]]
    return [int(i) for i in np.argsort(-probs, kind="stable")[:k]]
