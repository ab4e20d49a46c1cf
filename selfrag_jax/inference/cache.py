"""`generate --cache DIR`: everything `sweep` needs to re-rank without decoding again.

Both paths are decoded for every question (all K passages and the no-retrieval answer), so
any threshold, rule, mode, weight, constraint, refusal bar or depth can be chosen again from
this folder (`candidates.choose` on `SweepCache.table()`, or `sweep` for a grid).

Schema (version 1), written atomically (temporary folder, then one rename):

    meta.json     {"schema": 1, "task", "options", "groups", "n_questions", "n_candidates"}
    index.jsonl   one line per question, in input order:
                  {"id", "question", "answers", "no_retrieval": {"text", "norm"},
                   "candidates": [{"passage": {"id","title","text"}, "text", "norm"}]}
    arrays.npz    `candidates.Table` per question q (Q rows) and candidate c (C rows, grouped by question):
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
      c_name_cover, c_word_cover [C] f32  `scoring.coverage` of the question by the passage
                                     (absent in caches written before them: read as NaN)
`norm` is `scoring.answer_group(text, task)`, the key of closed-set aggregation.
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
from selfrag_jax.inference.candidates import Choice, Table
from selfrag_jax.inference.scoring import Combination, RefuseOptions
from selfrag_jax.utils import atomic_dir

SCHEMA = 1


@dataclass
class SweepCache:
    meta: dict[str, Any]
    questions: list[dict[str, Any]]
    arrays: dict[str, np.ndarray]

    @property
    def task(self) -> str:
        return self.meta["task"]

    def table(self) -> Table:
        return Table.from_arrays(self.arrays, [[c["norm"] for c in q["candidates"]] for q in self.questions])

    def refuse_options(self) -> RefuseOptions:
        """The refusal options the cache was written with."""
        fields = dict(self.meta["options"].get("refuse", {}))
        if fields.get("combination") is not None:
            fields["combination"] = Combination.from_json(fields["combination"])
        return RefuseOptions(**fields)


def build_cache(results: list, opts) -> SweepCache:
    """The cache of short-form `results` (QuestionResult, both paths decoded), in memory."""
    if any(r.no_retrieval is None for r in results):
        raise ValueError("write_cache needs both paths decoded (GenerateOptions.keep_both_paths)")
    table = Table.from_results(results, opts.task)
    meta = {"schema": SCHEMA, "task": opts.task, "options": options_json(opts),
            "groups": {"retrieve": T.RETRIEVE_GROUP, "isrel": T.ISREL_GROUP, "issup": T.ISSUP_GROUP,
                       "isuse": T.ISUSE_GROUP},
            "n_questions": len(results), "n_candidates": len(table.seq)}
    return SweepCache(meta, [_index_line(r, opts.task) for r in results], table.to_arrays())


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
            "no_retrieval": {"text": nr, "norm": scoring.answer_group(nr, task)},
            "candidates": [{"passage": c.passage, "text": c.text, "norm": scoring.answer_group(c.text, task)}
                           for c in r.candidates]}


def _answers(record: dict[str, Any]) -> list:
    answers = record.get("answers", record.get("answer", []))
    return answers if isinstance(answers, list) else [answers]


def options_json(opts) -> dict[str, Any]:
    """GenerateOptions as the cache's meta keeps them; a learned refusal bar in the form
    decoding.json keeps it (`Combination.to_json`)."""
    out = _jsonable(dataclasses.asdict(opts))
    if opts.refuse.combination is not None:
        out["refuse"]["combination"] = opts.refuse.combination.to_json()
    return out


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


def predictions(cache: SweepCache, choice: Choice) -> list[str]:
    """Each question's answer text under `choice` (`candidates.choose` of the cache's table)."""
    message = cache.refuse_options().message
    return [message if choice.refused[q] else line["candidates"][choice.chosen[q]]["text"] if choice.chosen[q] >= 0
            else line["no_retrieval"]["text"] for q, line in enumerate(cache.questions)]
