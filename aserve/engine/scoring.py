"""Scores of text pairs with an embedding model, as vLLM scores them: the cosine similarity of
the two texts' embeddings. Shared by `LLM.score` and the server's `/v1/score` and `/rerank`.

Pairs are vLLM's: `text_1` one text against each of `text_2` (1 ↔ N), or the i-th against the
i-th (N ↔ N); every other pairing is refused, naming the field.
"""

from __future__ import annotations

import numpy as np


def pair_indices(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """(index into text_1, index into text_2) per pair; ValueError naming the field that
    breaks 1 ↔ N or N ↔ N."""
    if num_1 == 0:
        raise ValueError("text_1 must not be empty.")
    if num_2 == 0:
        raise ValueError("text_2 must not be empty.")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise ValueError(f"text_2 must hold one text per text of text_1 (N:N) when text_1 holds "
                         f"several ({num_1}), got {num_2}.")
    return [(i, i) for i in range(num_1)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two vectors (torch's `CosineSimilarity` with eps 1e-8, which
    vLLM scores with), computed in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8))
