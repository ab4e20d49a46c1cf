"""A realistic `--cache` with random scores, for the sweep's tests and benchmark.

Same schema as `inference.cache` (so `load_cache`, `candidates.choose` and `sweep` read it): random
retrieve log-probabilities, Dirichlet critique distributions, labels drawn from them, some
candidates without an IsSup/Utility token, a few questions with fewer candidates, and
answer texts from a small pool so closed-set aggregation has duplicates to sum.
"""

from __future__ import annotations

import numpy as np

from selfrag_jax.inference import scoring
from selfrag_jax.inference.cache import SCHEMA, SweepCache

CLOSED_ANSWERS = {"fever": ("true", "false"), "pubhealth": ("true", "false"), "arc_c": ("A", "B", "C", "D")}


def synthetic_cache(n_questions: int, k: int = 5, task: str = "open", seed: int = 0) -> SweepCache:
    rng = np.random.default_rng(seed)
    counts = np.where(rng.random(n_questions) < 0.05, rng.integers(0, k + 1, n_questions), k).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    c = int(counts.sum())
    retrieve_p = rng.dirichlet([1.0, 1.0, 0.3], n_questions)
    rel_p = rng.dirichlet([1.0, 1.0], c)
    sup_p, use_p = rng.dirichlet([1.0, 1.0, 0.7], c), rng.dirichlet(np.ones(5), c)
    sup_found, use_found = rng.random(c) < 0.85, rng.random(c) < 0.9
    arrays = {
        "q_retrieve_logprobs": np.log(retrieve_p).astype(np.float32),
        "q_retrieve_probs": retrieve_p.astype(np.float32),
        "q_greedy_retrieval": retrieve_p.argmax(1) == scoring.RET,
        "q_cand_start": starts, "q_cand_count": counts,
        "q_nr_seq": -rng.gamma(2.0, 0.5, n_questions).astype(np.float32),
        "c_question": np.repeat(np.arange(n_questions), counts).astype(np.int32),
        "c_seq": -rng.gamma(2.0, 0.5, c).astype(np.float32),
        "c_rel_probs": rel_p.astype(np.float32), "c_rel": scoring.rel_score(rel_p).astype(np.float32),
        "c_sup_probs": np.where(sup_found[:, None], sup_p, 0).astype(np.float32), "c_sup_found": sup_found,
        "c_use_probs": np.where(use_found[:, None], use_p, 0).astype(np.float32), "c_use_found": use_found,
        "c_rel_label": rel_p.argmax(1).astype(np.int8),
        "c_sup_label": np.where(sup_found, sup_p.argmax(1), -1).astype(np.int8),
        # cosine-like retriever scores, best first; a few questions' passages carry none
        "c_ret_score": np.where(np.repeat(rng.random(n_questions) < 0.1, counts), np.nan,
                                -np.sort(-rng.uniform(0.2, 0.8, c))).astype(np.float32),
    }
    pool = CLOSED_ANSWERS.get(task) or tuple(f"answer {i}" for i in range(8))
    questions = []
    for q in range(n_questions):
        texts = [str(rng.choice(pool)) for _ in range(counts[q])]
        gold = [str(rng.choice(pool))]
        nr = str(rng.choice(pool))
        questions.append({
            "id": str(q), "question": f"question {q}?", "answers": gold,
            "no_retrieval": {"text": nr, "norm": scoring.answer_group(nr, task)},
            "candidates": [{"passage": {"id": f"{q}:{j}", "title": "t", "text": "p"}, "text": t,
                            "norm": scoring.answer_group(t, task)} for j, t in enumerate(texts)]})
    meta = {"schema": SCHEMA, "task": task, "options": {}, "groups": {}, "n_questions": n_questions, "n_candidates": c}
    return SweepCache(meta, questions, arrays)
