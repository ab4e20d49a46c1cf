"""Clustered unit vectors for index tests and benchmarks (real embeddings cluster by topic)."""

from __future__ import annotations

import numpy as np


def clustered_vectors(n: int, dim: int, clusters: int, seed: int = 0, spread: float = 1.0) -> np.ndarray:
    """n unit vectors around `clusters` random unit centres; `spread` ~ noise-to-centre ratio."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((clusters, dim), dtype=np.float32))
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, 100_000):  # bounded temporaries for million-row sets
        stop = min(start + 100_000, n)
        noise = rng.standard_normal((stop - start, dim), dtype=np.float32) * (spread / np.sqrt(dim))
        out[start:stop] = _unit(centres[rng.integers(0, clusters, stop - start)] + noise)
    return out


def split_queries(vectors: np.ndarray, n_queries: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(database, queries): held-out points of the same distribution as queries."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(vectors), bool)
    mask[rng.choice(len(vectors), n_queries, replace=False)] = True
    return vectors[~mask], vectors[mask]


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of the true top-k rows found (both [q, k])."""
    hits = sum(len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found, truth))
    return hits / truth.size


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)
