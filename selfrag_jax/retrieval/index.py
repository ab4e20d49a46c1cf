"""Vector indexes behind one small interface: `search(queries[q, d], k) -> (scores, rows)`.

Two backends: ScaNN (approximate, parameters chosen from the corpus size as the ScaNN docs
advise, every one overridable) and exact inner product (blocked matmul + top-k, the
ground truth and the fallback where ScaNN is not installed). `ShardedIndex` merges several
indexes by score. ScaNN is imported inside its backend only: importing this module never
loads it (nor TensorFlow, which ScaNN loads when present).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

BACKENDS = ("scann", "exact")


class VectorIndex(Protocol):
    backend: str

    @property
    def size(self) -> int: ...

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 [q, d] -> (scores [q, k'] float32, rows [q, k'] int64), best first, k' = min(k, size)."""
        ...

    def save(self, folder: Path) -> dict[str, Any]:
        """Writes the index files into folder; returns the parameters for the manifest."""
        ...


# --------------------------------------------------------------------------- exact


class ExactIndex:
    """Exact maximum inner product: a jitted matmul + top-k per block of rows, merged.

    Blocks keep the score matrix small (queries x block) however large the database is;
    XLA's top-k is several times faster than numpy's argpartition over the same scores.
    The blocks are moved to the device once, on the first search (`keep_on_device=False`:
    per search, for a one-off pass over a corpus too large to hold twice).
    """

    backend = "exact"
    FILE = "embeddings.npy"
    QUERY_CHUNK = 256

    def __init__(self, vectors: np.ndarray, block_rows: int = 65_536, keep_on_device: bool = True):
        self.vectors = vectors
        self.block_rows = block_rows
        self.keep_on_device = keep_on_device  # False: convert each block per search (no second copy)
        self._blocks: list[Any] | None = None

    @property
    def size(self) -> int:
        return int(self.vectors.shape[0])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import jax.numpy as jnp

        queries = np.ascontiguousarray(queries, np.float32)
        k = min(k, self.size)
        if self._blocks is None and self.keep_on_device:
            self._blocks = [jnp.asarray(block, jnp.float32) for block in self._host_blocks()]
        out_scores, out_rows = [], []
        for qs in range(0, len(queries), self.QUERY_CHUNK):
            chunk = queries[qs : qs + self.QUERY_CHUNK]
            padded = np.zeros((_pow2(len(chunk)), chunk.shape[1]), np.float32)
            padded[: len(chunk)] = chunk
            scores, rows = [], []
            for b, block in enumerate(self._blocks if self._blocks is not None else self._host_blocks()):
                s, r = _block_topk(padded, block, min(k, block.shape[0]))
                scores.append(np.asarray(s)[: len(chunk)])
                rows.append(np.asarray(r, np.int64)[: len(chunk)] + b * self.block_rows)
            s, r = merge_topk(np.concatenate(scores, 1), np.concatenate(rows, 1), k)
            out_scores.append(s)
            out_rows.append(r)
        return np.concatenate(out_scores), np.concatenate(out_rows)

    def _host_blocks(self):
        return (np.asarray(self.vectors[s : s + self.block_rows], np.float32) for s in range(0, self.size, self.block_rows))

    def save(self, folder: Path) -> dict[str, Any]:
        np.save(folder / self.FILE, np.asarray(self.vectors, np.float32))
        return {"block_rows": self.block_rows}

    @classmethod
    def load(cls, folder: Path, params: dict[str, Any]) -> "ExactIndex":
        return cls(np.load(folder / cls.FILE, mmap_mode="r"), block_rows=int(params.get("block_rows", 65_536)))


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


_BLOCK_TOPK = None


def _block_topk(queries: np.ndarray, block: Any, k: int):
    global _BLOCK_TOPK
    if _BLOCK_TOPK is None:
        import jax

        _BLOCK_TOPK = jax.jit(lambda q, b, k: jax.lax.top_k(q @ b.T, k), static_argnums=2)
    return _BLOCK_TOPK(queries, block, k)


# --------------------------------------------------------------------------- ScaNN


@dataclass(frozen=True)
class ScannParams:
    """ScaNN settings; `auto()` follows the ScaNN docs' rules of thumb for the corpus size."""

    brute_force: bool = False
    num_leaves: int = 0  # 0: no partitioning tree
    leaves_to_search: int = 0
    training_sample_size: int = 0
    dims_per_block: int = 2
    anisotropic_threshold: float = 0.2
    reorder: int = 0  # 0: no exact re-scoring of the AH candidates
    reorder_dtype: str = "float32"  # float32 | bfloat16 | int8 (smaller for very large n)
    soar_lambda: float | None = None  # spill each point to a second leaf (SOAR), more recall per leaf

    @classmethod
    def auto(cls, n: int, normalized: bool = True, mean_sq_norm: float = 1.0) -> "ScannParams":
        """Brute force under 20k; AH + re-scoring under 100k; a tree with SOAR above.

        Above 100k: 4 sqrt(n) leaves trained on 100 points per leaf, each point spilled to a
        second leaf (SOAR, lambda 1.5) and coded 4 dimensions per block. On 1M x 384 the ScaNN
        docs' sqrt(n) leaves and 2 dimensions per block reached half FAISS HNSW's QPS at
        recall 0.95, these twice it (bench/README.md): smaller leaves mean fewer points scored
        per query, spilling keeps the neighbours near leaf borders, and 4-dimension codes
        halve the scan while the exact re-scoring restores the order. The search-time knobs
        (leaves searched, re-scoring depth) here are starting points; `calibrate` sets them
        for a target recall. The anisotropic threshold 0.2 is meant for unit vectors; for
        unnormalised ones (Contriever) it is scaled by the mean squared norm.
        """
        threshold = 0.2 if normalized else round(0.2 * mean_sq_norm, 4)
        if n < 20_000:
            return cls(brute_force=True)
        if n < 100_000:
            return cls(anisotropic_threshold=threshold, reorder=100)
        leaves = int(round(4 * math.sqrt(n)))
        return cls(
            num_leaves=leaves,
            leaves_to_search=max(10, int(round(leaves * 0.025))),
            training_sample_size=min(n, max(100_000, 100 * leaves)),
            dims_per_block=4,
            anisotropic_threshold=threshold,
            reorder=100,
            reorder_dtype="float32" if n < 5_000_000 else "int8",
            soar_lambda=1.5,
        )

    def replace(self, **overrides: Any) -> "ScannParams":
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown ScaNN parameter(s) {sorted(unknown)}; known: {sorted(known)}")
        return ScannParams(**{**asdict(self), **{k: v for k, v in overrides.items() if v is not None}})


def import_scann():
    try:
        import scann
    except ImportError as err:
        raise ValueError(f"backend 'scann' needs ScaNN (pip install 'selfrag-jax[retrieval]'), or use backend 'exact' ({err})") from None
    return scann


class ScannIndex:
    """A ScaNN searcher for inner product; rows are the database's row numbers."""

    backend = "scann"
    SUBDIR = "scann"

    def __init__(self, searcher: Any, params: ScannParams, size: int):
        self.searcher = searcher
        self.params = params
        self._size = size

    @classmethod
    def build(cls, vectors: np.ndarray, params: ScannParams, k_hint: int = 10) -> "ScannIndex":
        scann = import_scann()
        vectors = np.ascontiguousarray(vectors, np.float32)
        builder = scann.scann_ops_pybind.builder(vectors, k_hint, "dot_product")
        if params.num_leaves:
            builder = builder.tree(
                num_leaves=params.num_leaves,
                num_leaves_to_search=params.leaves_to_search or params.num_leaves,
                training_sample_size=params.training_sample_size or min(len(vectors), 100_000),
                soar_lambda=params.soar_lambda,
            )
        if params.brute_force:
            builder = builder.score_brute_force()
        else:
            builder = builder.score_ah(
                params.dims_per_block,
                anisotropic_quantization_threshold=params.anisotropic_threshold,
                training_sample_size=params.training_sample_size or min(len(vectors), 100_000),
            )
            if params.reorder:
                kind = {"float32": scann.ReorderType.FLOAT32, "bfloat16": scann.ReorderType.BFLOAT16, "int8": scann.ReorderType.INT8}
                if params.reorder_dtype not in kind:
                    raise ValueError(f"reorder_dtype {params.reorder_dtype!r}: must be one of {sorted(kind)}")
                builder = builder.reorder(params.reorder, quantize=kind[params.reorder_dtype])
        return cls(builder.build(), params, len(vectors))

    @property
    def size(self) -> int:
        return self._size

    def search(
        self, queries: np.ndarray, k: int, leaves_to_search: int | None = None, reorder: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """leaves_to_search / reorder: per-call overrides of the built values (speed vs recall)."""
        queries = np.ascontiguousarray(queries, np.float32)
        k = min(k, self.size)
        pre = max(reorder or self.params.reorder, k) if self.params.reorder else None
        leaves = leaves_to_search or (self.params.leaves_to_search or None)
        if len(queries) == 1:
            rows, scores = self.searcher.search_batched(queries, k, pre, leaves)
        else:
            rows, scores = self.searcher.search_batched_parallel(queries, k, pre, leaves)
        return np.asarray(scores, np.float32), np.asarray(rows, np.int64)

    def save(self, folder: Path) -> dict[str, Any]:
        target = folder / self.SUBDIR
        target.mkdir()
        self.searcher.serialize(str(target), relative_path=True)
        return asdict(self.params)

    @classmethod
    def load(cls, folder: Path, params: dict[str, Any], size: int) -> "ScannIndex":
        scann = import_scann()
        searcher = scann.scann_ops_pybind.load_searcher(str(folder / cls.SUBDIR))
        return cls(searcher, ScannParams(**params), size)


# --------------------------------------------------------------------------- calibration

SEARCH_KNOBS = ("leaves_to_search", "reorder")
LEAF_FRACTIONS = (0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12, 0.16, 0.2, 0.25, 0.3, 0.4, 0.5)
REORDER_DEPTHS = (50, 100, 200, 400, 800)


def leaf_grid(num_leaves: int) -> list[int]:
    """The leaves-searched values calibration tries (fractions of the tree's leaves)."""
    return sorted({max(1, round(num_leaves * f)) for f in LEAF_FRACTIONS})


def calibration_rows(n: int, n_queries: int = 1000, seed: int = 0) -> np.ndarray:
    """The corpus rows calibration draws its queries from (sorted, seeded)."""
    return np.sort(np.random.default_rng(seed).choice(n, min(n_queries, n), replace=False))


def calibrate(
    index: ScannIndex, vectors: np.ndarray, target_recall: float, k: int = 10,
    query_maker: Callable[[np.ndarray], np.ndarray] | None = None, fixed: Sequence[str] = (), repeats: int = 3,
) -> tuple[ScannIndex, dict[str, Any]]:  # fmt: skip
    """The fastest search knobs (leaves searched, re-scoring depth) whose recall@k reaches
    `target_recall` on queries drawn from the corpus; (index with them, report).

    Queries are made from 1,000 corpus rows: `query_maker(rows)` gives their vectors (`index
    build` embeds each passage's text without its title, as a question arrives without one);
    by default the rows' own vectors. Each row's own hit is excluded from both lists, so a
    query is a held-out point. Recall counts a found row whose exact score ties the k-th true score, so
    duplicate passages do not read as misses, and must reach the target at its one-sided
    95% lower bound over queries: a fresh query set of the same kind meets it. Per
    re-scoring depth the widest search is tried first (a depth that misses there is
    skipped), then leaves upwards; the reaching points are timed and the fastest kept.
    Knobs named in `fixed` (given by the user) are kept. Unreached, the most accurate point
    is kept and the report says so.
    """
    params = index.params
    report: dict[str, Any] = {"target_recall": target_recall, "k": k}
    if params.brute_force:
        return index, {**report, "reached": True, "note": "brute force: exact scoring"}
    rows = calibration_rows(len(vectors))
    queries = np.ascontiguousarray(query_maker(rows) if query_maker else vectors[rows], np.float32)
    truth_scores, truth_rows = ExactIndex(vectors, keep_on_device=False).search(queries, k + 1)
    # The k-th best score of other rows: the query's own row dropped, or else the (k+1)-th.
    kth = np.array([s[r != row][k - 1] for s, r, row in zip(truth_scores, truth_rows, rows)])
    tolerance = 1e-5 * np.maximum(1.0, np.abs(kth))

    def measure(leaves: int | None, reorder: int | None) -> dict[str, Any]:
        _, found = index.search(queries, k + 1, leaves_to_search=leaves, reorder=reorder)
        per_query = np.empty(len(rows))
        for i, (row, hits) in enumerate(zip(rows, found)):
            hits = [h for h in hits.tolist() if h != row and h >= 0][:k]
            exact = np.asarray(vectors[np.sort(hits)], np.float32) @ queries[i] if hits else np.zeros(0)
            per_query[i] = min(k, int(np.sum(exact >= kth[i] - tolerance[i]))) / k
        recall = float(per_query.mean())
        bound = recall - 1.645 * float(per_query.std(ddof=1)) / math.sqrt(len(rows))
        return {"leaves_to_search": leaves, "reorder": reorder, "recall": recall, "recall_lower_bound": bound}

    leaf_options: list[int | None] = [params.leaves_to_search or None]
    if params.num_leaves and "leaves_to_search" not in fixed:
        leaf_options = leaf_grid(params.num_leaves)
    reorder_options: list[int | None] = [params.reorder or None]
    if params.reorder and "reorder" not in fixed:
        reorder_options = sorted({d for d in REORDER_DEPTHS if d > k})
    sweep: list[dict[str, Any]] = []
    reached: list[dict[str, Any]] = []
    for reorder in reorder_options:
        widest = measure(leaf_options[-1], reorder)
        sweep.append(widest)
        if widest["recall_lower_bound"] < target_recall:
            continue  # this depth misses at the widest search: no need to walk its leaves
        for leaves in leaf_options[:-1]:  # the fewest leaves reaching the target, per depth
            point = measure(leaves, reorder)
            sweep.append(point)
            if point["recall_lower_bound"] >= target_recall:
                break
        else:
            point = widest
        search = lambda: index.search(queries, k, leaves_to_search=point["leaves_to_search"], reorder=reorder)  # noqa: E731
        point["qps"] = len(rows) / float(np.median([_timed(search) for _ in range(repeats)]))
        reached.append(point)
    best = max(reached, key=lambda p: p["qps"]) if reached else max(sweep, key=lambda p: p["recall"])
    chosen = params.replace(**{knob: best[knob] for knob in SEARCH_KNOBS if best[knob] is not None})
    report.update({key: best.get(key) for key in ("leaves_to_search", "reorder", "recall", "recall_lower_bound", "qps")},
                  queries=len(rows), reached=bool(reached), sweep=sweep)  # fmt: skip
    return ScannIndex(index.searcher, chosen, index.size), report


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- sharded


class ShardedIndex:
    """Several indexes as one: each searched for top-k, merged by score, rows offset."""

    backend = "sharded"

    def __init__(self, parts: Sequence[VectorIndex]):
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [p.size for p in self.parts])

    @property
    def size(self) -> int:
        return int(self.offsets[-1])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        results = [p.search(queries, k) for p in self.parts]
        scores = np.concatenate([s for s, _ in results], axis=1)
        rows = np.concatenate([r + off for (_, r), off in zip(results, self.offsets)], axis=1)
        return merge_topk(scores, rows, k)

    def save(self, folder: Path) -> dict[str, Any]:
        raise NotImplementedError("save each part as its own index folder")


def merge_topk(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


def build_index(
    vectors: np.ndarray, backend: str, normalized: bool, overrides: dict[str, Any] | None = None,
    target_recall: float | None = None, query_maker: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[VectorIndex, dict[str, Any] | None]:  # fmt: skip
    """The index for these vectors and its calibration report (None: exact, or no target).

    ScaNN parameters come from the corpus size unless overridden; with a target recall,
    the search-time knobs the user did not give are calibrated (`calibrate`; `query_maker`
    turns corpus rows into query vectors).
    """
    if backend == "exact":
        return ExactIndex(vectors), None
    if backend != "scann":
        raise ValueError(f"backend {backend!r}: must be one of {BACKENDS}")
    overrides = overrides or {}
    sample = vectors[:: max(1, len(vectors) // 10_000)]
    mean_sq_norm = float(np.mean(np.sum(np.square(sample, dtype=np.float64), axis=1)))
    params = ScannParams.auto(len(vectors), normalized=normalized, mean_sq_norm=mean_sq_norm)
    index = ScannIndex.build(vectors, params.replace(**overrides))
    if not target_recall:
        return index, None
    fixed = [knob for knob in SEARCH_KNOBS if knob in overrides]
    return calibrate(index, vectors, target_recall, query_maker=query_maker, fixed=fixed)


def load_vector_index(folder: Path, backend: str, params: dict[str, Any], size: int) -> VectorIndex:
    if backend == "exact":
        return ExactIndex.load(folder, params)
    if backend == "scann":
        return ScannIndex.load(folder, params, size)
    raise ValueError(f"{folder}/manifest.json: field 'backend' {backend!r} must be one of {BACKENDS}")
