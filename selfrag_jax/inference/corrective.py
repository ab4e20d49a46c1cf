"""Corrective re-retrieval: CRAG's idea, judged with Self-RAG's own IsRel token.

When every passage a question got scores as irrelevant (rel below `rel_threshold` for
all), any answer would rest on evidence the model itself rejected, so another round
retrieves. Round r asks for k = ndocs * 2^(r-1) passages, skips those already seen and
decodes at most `ndocs` new ones, so a round never costs more than the first. The query
can be rewritten with the entity words of the question (its capitalised words after the
first) and, optionally, the model's best answer so far. Without a retriever, the item's
later-ranked `ctxs` (beyond those seen) are the pool. Extra rounds are paid for in tokens
(passage + generated, per question); a question stops when the next passage would not fit
`token_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUERY_MODES = ("question", "keywords", "answer")


@dataclass(frozen=True)
class CorrectiveOptions:
    max_rounds: int = 1  # 1: no re-retrieval
    rel_threshold: float = 0.5
    token_budget: int = 4096  # per question, over all extra rounds
    query: str = "keywords"  # question | keywords (+ entity words) | answer (+ the best answer too)

    def __post_init__(self):
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {self.max_rounds}")
        if self.query not in QUERY_MODES:
            raise ValueError(f"re-retrieval query {self.query!r} is not one of {QUERY_MODES}")

    @property
    def enabled(self) -> bool:
        return self.max_rounds > 1


def all_irrelevant(rel: np.ndarray, threshold: float) -> bool:
    """Every passage judged irrelevant (and there was at least one)."""
    rel = np.asarray(rel)
    return rel.size > 0 and bool((rel < threshold).all())


def round_k(ndocs: int, round_number: int) -> int:
    """Passages asked for in round `round_number` (1-based): k doubles every round."""
    return ndocs * 2 ** (round_number - 1)


def keywords(question: str) -> list[str]:
    """Capitalised words after the first (names, places), punctuation stripped, in order."""
    words = [w.strip("?.,!;:\"'()") for w in question.split()[1:]]
    return list(dict.fromkeys(w for w in words if w[:1].isupper()))


def rewrite_query(question: str, answer: str, mode: str) -> str:
    """The next round's query: the question, plus its entity words, plus the model's answer."""
    parts = [question]
    if mode in ("keywords", "answer"):
        parts += keywords(question)
    if mode == "answer" and answer:
        parts.append(answer)
    return " ".join(p for p in parts if p)


def fit_budget(costs: list[int], budget_left: int) -> int:
    """How many of the leading rows fit the remaining token budget."""
    n, total = 0, 0
    for cost in costs:
        if total + cost > budget_left:
            break
        total += cost
        n += 1
    return n
