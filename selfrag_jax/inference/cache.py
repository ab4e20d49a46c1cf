"""`generate --cache DIR`: everything `sweep` needs to re-rank without decoding again.

Both paths are decoded for every question (all K passages and the no-retrieval answer), so
any threshold, rule, mode, weight or constraint can be replayed from this folder.

Schema (version 1), written atomically (temporary folder, then one rename):

    meta.json     {"schema": 1, "task", "options", "groups", "n_questions", "n_candidates"}
    index.jsonl   one line per question, in input order:
                  {"id", "question", "answers", "no_retrieval": {"text", "norm"},
                   "candidates": [{"passage": {"id","title","text"}, "text", "norm"}]}
    arrays.npz    per question q (Q rows) and per candidate c (C rows, grouped by question):
      q_retrieve_logprobs [Q,3] f32  log p of (No Retrieval, Retrieval, Continue), full softmax
      q_retrieve_probs    [Q,3] f32  the same as probabilities
      q_greedy_retrieval  [Q]  bool  the argmax first token is [Retrieval] (mode hard)
      q_cand_start, q_cand_count [Q] int32  the question's candidate rows
      q_nr_seq            [Q]  f32   mean log-prob of the no-retrieval answer
      c_question          [C]  int32 question row of the candidate
      c_seq               [C]  f32   mean log-prob of the generated tokens (raw, not exp)
      c_rel_probs         [C,2] f32  p(Irrelevant), p(Relevant) at the first position
      c_rel               [C]  f32   p(Relevant) / (p(Relevant) + p(Irrelevant))
      c_sup_probs         [C,3] f32  IsSup group at the first generated IsSup token (0s if none)
      c_sup_found         [C]  bool
      c_use_probs         [C,5] f32  IsUse group at the first generated Utility token (0s if none)
      c_use_found         [C]  bool
      c_rel_label, c_sup_label [C] int8  group index of the generated IsRel / IsSup token, -1 none
      c_ret_score         [C]  f32   the retriever's score of the passage, NaN if none (absent in
                                     caches written before it: read as NaN, no retriever prior)
`norm` is `scoring.normalise_answer(text, task)`, the key of closed-set aggregation.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.inference import scoring
from selfrag_jax.utils import atomic_dir

SCHEMA = 1


@dataclass
class SweepCache:
    meta: dict[str, Any]
    questions: list[dict[str, Any]]
    arrays: dict[str, np.ndarray]

    def candidate_rows(self, q: int) -> slice:
        start = int(self.arrays["q_cand_start"][q])
        return slice(start, start + int(self.arrays["q_cand_count"][q]))


def build_cache(results: list, opts) -> SweepCache:
    """The cache of short-form `results` (QuestionResult, both paths decoded), in memory."""
    task = opts.task
    questions, q_rows, c_rows = [], [], []
    for q, r in enumerate(results):
        if r.no_retrieval is None:
            raise ValueError("write_cache needs both paths decoded (GenerateOptions.keep_both_paths)")
        questions.append(_index_line(r, task))
        q_rows.append((r.retrieve_logprobs, r.greedy_retrieval, len(c_rows), len(r.candidates),
                       r.no_retrieval.seq))
        c_rows.extend((q, c) for c in r.candidates)
    meta = {"schema": SCHEMA, "task": task, "options": _jsonable(dataclasses.asdict(opts)),
            "groups": {"retrieve": T.RETRIEVE_GROUP, "isrel": T.ISREL_GROUP, "issup": T.ISSUP_GROUP,
                       "isuse": T.ISUSE_GROUP},
            "n_questions": len(questions), "n_candidates": len(c_rows)}
    return SweepCache(meta, questions, _arrays(q_rows, c_rows))


def write_cache(folder: str | Path, results: list, opts) -> SweepCache:
    """Write the cache of short-form `results` to `folder` (atomically) and return it."""
    cache = build_cache(results, opts)
    with atomic_dir(folder) as tmp:
        np.savez(tmp / "arrays.npz", **cache.arrays)
        (tmp / "index.jsonl").write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in cache.questions))
        (tmp / "meta.json").write_text(json.dumps(cache.meta, indent=1) + "\n")
    return cache


def _index_line(r, task: str) -> dict[str, Any]:
    nr = r.no_retrieval.text
    return {"id": r.item.id, "question": r.item.question, "answers": _answers(r.item.record),
            "no_retrieval": {"text": nr, "norm": scoring.normalise_answer(nr, task)},
            "candidates": [{"passage": c.passage, "text": c.text, "norm": scoring.normalise_answer(c.text, task)}
                           for c in r.candidates]}


def _answers(record: dict[str, Any]) -> list:
    answers = record.get("answers", record.get("answer", []))
    return answers if isinstance(answers, list) else [answers]


def _arrays(q_rows: list, c_rows: list) -> dict[str, np.ndarray]:
    lp = np.array([q[0] for q in q_rows], np.float32).reshape(-1, 3)
    cands = [c for _, c in c_rows]
    rel_probs = np.array([c.rel_probs for c in cands], np.float32).reshape(-1, 2)
    return {
        "q_retrieve_logprobs": lp, "q_retrieve_probs": np.exp(lp),
        "q_greedy_retrieval": np.array([q[1] for q in q_rows], bool),
        "q_cand_start": np.array([q[2] for q in q_rows], np.int32),
        "q_cand_count": np.array([q[3] for q in q_rows], np.int32),
        "q_nr_seq": np.array([q[4] for q in q_rows], np.float32),
        "c_question": np.array([q for q, _ in c_rows], np.int32),
        "c_seq": np.array([c.seq for c in cands], np.float32),
        "c_rel_probs": rel_probs, "c_rel": scoring.rel_score(rel_probs).astype(np.float32),
        "c_sup_probs": np.array([c.sup_probs for c in cands], np.float32).reshape(-1, 3),
        "c_sup_found": np.array([c.sup_found for c in cands], bool),
        "c_use_probs": np.array([c.use_probs for c in cands], np.float32).reshape(-1, 5),
        "c_use_found": np.array([c.use_found for c in cands], bool),
        "c_rel_label": np.array([c.rel_label for c in cands], np.int8),
        "c_sup_label": np.array([c.sup_label for c in cands], np.int8),
        "c_ret_score": np.array([scoring.passage_score(c.passage) for c in cands], np.float32),
    }


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def load_cache(folder: str | Path) -> SweepCache:
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{folder}: not a generate --cache folder (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("schema") != SCHEMA:
        raise ValueError(f"{meta_path}: cache schema {meta.get('schema')!r}, expected {SCHEMA}")
    questions = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines() if line]
    with np.load(folder / "arrays.npz") as data:
        arrays = {k: data[k] for k in data.files}
    return SweepCache(meta, questions, arrays)


def retriever_probs(cache: SweepCache, temperature: float, ndocs: int = 0) -> np.ndarray:
    """[C] `scoring.retriever_prob` of each candidate among its question's first `ndocs` (0:
    all; 0 beyond them, where a score is missing, and everywhere for a cache written before
    `c_ret_score`)."""
    a = cache.arrays
    out = np.zeros(len(a["c_seq"]))
    if "c_ret_score" not in a:
        return out
    scores = a["c_ret_score"]
    for q in range(len(cache.questions)):
        rows = depth_rows(cache, q, ndocs)
        out[rows] = scoring.retriever_prob(scores[rows], temperature)
    return out


def depth_rows(cache: SweepCache, q: int, ndocs: int = 0) -> slice:
    """Question q's candidate rows, its first `ndocs` only (0: all): the retriever's top K."""
    rows = cache.candidate_rows(q)
    return slice(rows.start, min(rows.stop, rows.start + ndocs)) if ndocs else rows


def replay(cache: SweepCache, retrieve: scoring.RetrieveOptions, score: scoring.ScoreOptions,
           refuse: scoring.RefuseOptions | None = None, ndocs: int = 0) -> list[dict[str, Any]]:
    """Per question {"prediction", "retrieved", "chosen", "refused"} under new options, no
    decoding. `refuse` defaults to the refusal options the cache was written with; `ndocs`
    keeps each question's first K candidates (0: all)."""
    a, task = cache.arrays, cache.meta["task"]
    if refuse is None:
        refuse = scoring.RefuseOptions(**cache.meta["options"].get("refuse", {}))
    decide = scoring.decide_retrieve(a["q_retrieve_logprobs"], a["q_greedy_retrieval"], retrieve)
    sup = scoring.sup_score(a["c_sup_probs"], a["c_sup_found"])
    use = scoring.use_score(a["c_use_probs"], a["c_use_found"])
    final = scoring.final_score(a["c_seq"], a["c_rel"], sup, use, score,
                                retriever_probs(cache, score.ret_temperature, ndocs))
    keep = scoring.allowed(a["c_rel_label"], a["c_sup_label"], score)
    if refuse.enabled:
        keep &= scoring.passes_bar(a["c_rel"], sup, a["c_sup_label"], refuse)
    out = []
    for q, line in enumerate(cache.questions):
        rows = depth_rows(cache, q, ndocs)
        retrieved = bool(decide[q]) and rows.stop > rows.start
        texts = [c["text"] for c in line["candidates"]][: rows.stop - rows.start]
        chosen = scoring.choose(texts, final[rows], keep[rows], task) if retrieved else None
        refused = refuse.enabled and bool(decide[q]) and chosen is None
        text = (refuse.message if refused else
                line["candidates"][chosen]["text"] if chosen is not None else line["no_retrieval"]["text"])
        out.append({"prediction": text, "retrieved": retrieved, "chosen": chosen, "refused": refused})
    return out
