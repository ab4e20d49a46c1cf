"""Short-form Self-RAG and the baselines, over batches of questions (docs/method.md section 5).

Per batch: one prefill of all prompts gives each question's retrieve decision; then one
segment step decodes every candidate row together. Pipelines differ only in the rows:
- `selfrag`: K passage rows for each question that retrieves (with `keep_top` M, all K are
  read but only the M with the highest IsRel are decoded: IsRel is the first token after the
  passage, so the pruned rows' text could not have beaten them on IsRel), and a `prompt + [No
  Retrieval]` row only where that answer is needed (no retrieval, hard constraints that
  may drop every candidate, or `--cache`, which keeps both paths). Scores, constraints and
  the choice of answer follow `scoring`; optionally corrective re-retrieval rounds
  (`corrective`) and honest refusal (`scoring.RefuseOptions`) on top.
- `naive`: one row, `[Retrieval]` then all K passages as `<paragraph>...</paragraph>`.
- `top1`: one row, the top passage exactly as Self-RAG's first candidate row.
- `none`: the `[No Retrieval]` row.
The baselines always (naive, top1) or never (none) retrieve and answer with their one row,
control tokens stripped; the critique probabilities the step computes anyway are reported
but never used.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.inference import corrective, scoring
from selfrag_jax.inference.candidates import ChoiceOptions, Row, Table, candidate_scores, choose
from selfrag_jax.inference.corrective import CorrectiveOptions
from selfrag_jax.inference.engine import ContextState, Engine, Segments
from selfrag_jax.inference.items import Item, passage
from selfrag_jax.inference.scoring import PIPELINES, RefuseOptions, RetrieveOptions, ScoreOptions

RetrieveFn = Callable[[list[str], int], list[list[dict[str, Any]]]]
PASSAGE_MARKERS = 3  # [Retrieval] <paragraph> ... </paragraph>


@dataclass(frozen=True)
class GenerateOptions:
    task: str = "open"
    ndocs: int = 5
    pipeline: str = "selfrag"
    retrieve: RetrieveOptions = field(default_factory=RetrieveOptions)
    score: ScoreOptions = field(default_factory=ScoreOptions)
    refuse: RefuseOptions = field(default_factory=RefuseOptions)
    corrective: CorrectiveOptions = field(default_factory=CorrectiveOptions)
    trace: bool = False
    keep_both_paths: bool = False  # decode retrieval and no-retrieval paths for every question
    keep_top: int = 0  # decode only the M passage rows per question with the highest IsRel (0: all)
    # long form
    beam_width: int = 2
    max_depth: int = 7
    static_passages: bool = False

    def __post_init__(self):
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline {self.pipeline!r} is not one of {PIPELINES}")
        if self.keep_top < 0:
            raise ValueError(f"keep_top must not be negative, got {self.keep_top}")
        if self.keep_top and self.keep_both_paths:
            raise ValueError("keep_top prunes candidates that a sweep cache would re-rank: not with keep_both_paths")
        if self.pipeline != "selfrag" and (self.refuse.enabled or self.corrective.enabled or self.keep_top):
            raise ValueError(f"refusal, re-retrieval and keep_top judge with reflection scores: pipeline selfrag, "
                             f"not {self.pipeline}")

    @property
    def choice(self) -> ChoiceOptions:
        """How the answer is chosen. A baseline retrieves always (naive, top1) or never (none)
        and answers with its one row, whatever the scores."""
        if self.pipeline != "selfrag":
            mode = "never" if self.pipeline == "none" else "always"  # the scores are reported, not used
            return ChoiceOptions(task=self.task, retrieve=RetrieveOptions(mode=mode),
                                 score=replace(self.score, hard=scoring.Hard.NONE))
        return ChoiceOptions(task=self.task, retrieve=self.retrieve, score=self.score, refuse=self.refuse)


@dataclass
class QuestionResult:
    """Everything decided and decoded for one question (the output record and cache read it)."""

    item: Item
    prompt: list[int]
    retrieve_logprobs: np.ndarray
    greedy_retrieval: bool  # the argmax first token is [Retrieval]
    retrieved: bool
    candidates: list[Row] = field(default_factory=list)
    no_retrieval: Row | None = None
    chosen: int | None = None
    prediction: str = ""
    found_nothing: bool = False  # decided to retrieve, but no passage came back
    rounds: list[dict[str, Any]] = field(default_factory=list)  # corrective re-retrieval log
    retry_tokens: int = 0  # tokens spent on extra rounds
    retry_stopped: str | None = None  # why re-retrieval ended early
    refused: bool = False
    refusal_reason: str | None = None
    scores: dict[str, np.ndarray] = field(default_factory=dict)  # per candidate, set with the choice
    latency_s: float = 0.0  # set by `run_batches`

    def rows(self) -> list[Row]:
        return self.candidates + ([self.no_retrieval] if self.no_retrieval else [])


class ShortForm:
    def __init__(self, engine: Engine, tokenizer, opts: GenerateOptions, retrieve_fn: RetrieveFn | None = None):
        self.engine = engine
        self.tok = tokenizer
        self.opts = opts
        self.retrieve_fn = retrieve_fn
        self.max_len = engine.config.max_position_embeddings

    def run(self, items: Sequence[Item]) -> list[QuestionResult]:
        prompts = [self.prompt_ids(it) for it in items]
        state = self.engine.prefill(prompts)
        greedy_retrieval = state.greedy == self.tok.control_id(T.RETRIEVAL)
        retrieve = self._decide(state, greedy_retrieval)
        results = [QuestionResult(it, p, state.retrieve_logprobs[i], bool(greedy_retrieval[i]), bool(retrieve[i]))
                   for i, (it, p) in enumerate(zip(items, prompts))]
        if self.opts.pipeline == "selfrag":
            self._attach_rows(results)
        else:
            self._attach_baseline_rows(results)
        self._decode(state, results, [(i, row) for i, r in enumerate(results) for row in r.rows()])
        if self.opts.corrective.enabled:
            self._correct(state, results)
        self._choose(results)
        return results

    def record(self, r: QuestionResult) -> dict[str, Any]:
        return output_record(r, self.opts)

    def rechoose(self, results: Sequence[QuestionResult]) -> None:
        """Choose every question's answer again under this runner's options (scores,
        constraints, refusal), without decoding: results of another runner's `run` with the
        same rows, e.g. the paper's score and the retriever prior from one decode. Retrieval
        decisions stay as they were made."""
        if self.opts.score.hard != scoring.Hard.NONE and not self.opts.refuse.enabled and any(
                r.retrieved and r.no_retrieval is None for r in results):
            raise ValueError("rechoose: hard constraints need the no-retrieval answer, which these results did not decode")
        self._choose(results)

    def prompt_ids(self, item: Item) -> list[int]:
        ids = self.tok.encode_prompt(item.instruction, item.input)
        if len(ids) + PASSAGE_MARKERS + 1 > self.max_len:
            raise ValueError(f"{item.where}: prompt of {len(ids)} tokens leaves no room to answer "
                             f"(the model allows {self.max_len})")
        return ids

    def _decide(self, state: ContextState, greedy_retrieval: np.ndarray) -> np.ndarray:
        pipeline = self.opts.pipeline
        if pipeline == "selfrag":
            return scoring.decide_retrieve(state.retrieve_logprobs, greedy_retrieval, self.opts.retrieve)
        return np.full(len(greedy_retrieval), pipeline in ("naive", "top1"))

    def _attach_rows(self, results: list[QuestionResult]) -> None:
        both = self.opts.keep_both_paths
        need = [r for r in results if r.retrieved or both]
        for r, ctxs in zip(need, self.passages([r.item for r in need])):
            r.candidates = [self.passage_row(r.prompt, passage(c, f"{r.item.id}:{j}")) for j, c in enumerate(ctxs)]
            if not r.candidates:
                r.found_nothing, r.retrieved = r.retrieved, False
        hard, refuse = self.opts.score.hard != scoring.Hard.NONE, self.opts.refuse.enabled
        for r in results:
            if both or not r.retrieved or (hard and not refuse):
                r.no_retrieval = Row([self.tok.control_id(T.NO_RETRIEVAL)])

    def _attach_baseline_rows(self, results: list[QuestionResult]) -> None:
        need = [r for r in results if r.retrieved]
        for r, ctxs in zip(need, self.passages([r.item for r in need])):
            psgs = [passage(c, f"{r.item.id}:{j}") for j, c in enumerate(ctxs)]
            if not psgs:
                r.found_nothing, r.retrieved = True, False
            elif self.opts.pipeline == "top1":
                r.candidates = [self.passage_row(r.prompt, psgs[0])]
            else:
                r.candidates = [self.naive_row(r.prompt, psgs)]
        for r in results:
            if not r.retrieved:
                r.no_retrieval = Row([self.tok.control_id(T.NO_RETRIEVAL)])

    def passages(self, items: Sequence[Item]) -> list[list[dict[str, Any]]]:
        """Top `ndocs` passages per item (top 1 for `top1`): its `ctxs`, else the retriever's."""
        k = 1 if self.opts.pipeline == "top1" else self.opts.ndocs
        out = [it.ctxs[:k] if it.ctxs is not None else None for it in items]
        missing = [i for i, c in enumerate(out) if c is None]
        if missing and self.retrieve_fn is None:
            raise ValueError(f"{items[missing[0]].where}: no 'ctxs' and no retriever (--index or --retriever-url)")
        if missing:
            for i, hits in zip(missing, self.retrieve_fn([items[i].question for i in missing], k)):
                out[i] = hits
        return out

    def passage_row(self, context: list[int], psg: dict[str, str]) -> Row:
        """`[Retrieval]<paragraph>title\\ntext</paragraph>`, the text cut (never the context)
        so that context + passage + max_new_tokens fits the model."""
        ids = self.tok.encode_passage(psg["title"], psg["text"])
        budget = max(0, self.max_len - len(context) - self.engine.max_new_tokens - PASSAGE_MARKERS)
        body = ids[2:-1]
        return Row(ids[:2] + body[:budget] + ids[-1:], psg, dropped=max(0, len(body) - budget))

    def naive_row(self, context: list[int], psgs: list[dict[str, str]]) -> Row:
        """`[Retrieval]` then every passage as `<paragraph>title\\ntext</paragraph>` in rank
        order; what does not fit the model is cut from the end."""
        ids = [self.tok.control_id(T.RETRIEVAL)]
        budget = self.max_len - len(context) - self.engine.max_new_tokens
        dropped = 0
        for psg in psgs:
            enc = self.tok.encode_passage(psg["title"], psg["text"], retrieval_token=False)
            room = budget - len(ids) - 2
            body = enc[1:-1][: max(0, room)]
            if room > 0:
                ids += enc[:1] + body + enc[-1:]
            dropped += len(enc) - 2 - len(body)
        return Row(ids, psgs[0], passages=psgs, dropped=dropped)

    def _decode(self, state: ContextState, results: list[QuestionResult], pairs: list[tuple[int, Row]]) -> None:
        """Decode (question, row) pairs in one segment step on the prefilled prompts."""
        if not pairs:
            return
        rows, src = [row for _, row in pairs], [i for i, _ in pairs]
        limits = [min(self.engine.max_new_tokens, self.max_len - len(results[i].prompt) - len(row.suffix))
                  for i, row in pairs]
        suffixes = [row.suffix for row in rows]
        m = self.opts.keep_top
        if not m or max(Counter(i for i, row in pairs if row.passage is not None).values(), default=0) <= m:
            fill_rows(rows, self.engine.decode(state, src, suffixes, limits), self.tok)
            return
        reading = self.engine.read(state, src, suffixes)
        kept = keep_top_rows(src, [row.passage is not None for row in rows], reading.rel_probs, m)
        decoded = set(kept)
        for j, row in enumerate(rows):
            row.rel_probs, row.pruned = reading.rel_probs[j], j not in decoded
        fill_rows([rows[j] for j in kept], self.engine.decode_rows(reading, kept, [limits[j] for j in kept]), self.tok)

    # --- corrective re-retrieval ---------------------------------------------------------
    def _correct(self, state: ContextState, results: list[QuestionResult]) -> None:
        """Extra rounds for the questions whose every passage was judged irrelevant."""
        c = self.opts.corrective
        for r in results:
            if r.retrieved:
                first = "ctxs" if r.item.ctxs is not None else "retriever"
                r.rounds = [self._round_log(1, r.item.question if first == "retriever" else None, first,
                                            self.opts.ndocs, r.candidates)]
        for number in range(2, c.max_rounds + 1):
            todo = [i for i, r in enumerate(results) if r.retrieved and r.retry_stopped is None
                    and corrective.all_irrelevant(rel_scores(r.candidates), c.rel_threshold)]
            if not todo:
                break
            k = corrective.round_k(self.opts.ndocs, number)
            pairs, added = [], []
            for i, (query, source, pool) in zip(todo, self._pools([results[i] for i in todo], k, number)):
                rows = self._new_rows(results[i], pool)
                if rows:
                    results[i].candidates.extend(rows)
                    pairs += [(i, row) for row in rows]
                    added.append((results[i], query, source, rows))
            self._decode(state, results, pairs)
            for r, query, source, rows in added:
                r.retry_tokens += sum(len(row.suffix) + len(row.ids) for row in rows)
                r.rounds.append(self._round_log(number, query, source, k, rows))

    def _pools(self, results: list[QuestionResult], k: int, number: int):
        """(query, source, passages) per question: the retriever's top k for the rewritten
        query, or, without a retriever, the item's top k `ctxs`."""
        c = self.opts.corrective
        if self.retrieve_fn is None:
            return [(None, "ctxs", [passage(x, f"{r.item.id}:{j}") for j, x in enumerate((r.item.ctxs or [])[:k])])
                    for r in results]
        queries = [corrective.rewrite_query(r.item.question, best_text(r, self.opts.score), c.query) for r in results]
        hits = self.retrieve_fn(queries, k)
        return [(q, "retriever", [passage(h, f"{r.item.id}:r{number}.{j}") for j, h in enumerate(hs)])
                for q, r, hs in zip(queries, results, hits)]

    def _new_rows(self, r: QuestionResult, pool: list[dict[str, str]]) -> list[Row]:
        """Up to `ndocs` unseen passages of the pool, as many as the token budget allows."""
        seen = {c.passage["id"] for c in r.candidates}
        fresh = [p for p in pool if p["id"] not in seen][: self.opts.ndocs]
        rows = [self.passage_row(r.prompt, p) for p in fresh]
        costs = [len(row.suffix) + self.engine.max_new_tokens for row in rows]
        rows = rows[: corrective.fit_budget(costs, self.opts.corrective.token_budget - r.retry_tokens)]
        if not rows:
            r.retry_stopped = "token budget" if fresh else "no new passages"
        return rows

    @staticmethod
    def _round_log(number: int, query: str | None, source: str, k: int, rows: list[Row]) -> dict[str, Any]:
        rel = rel_scores(rows)
        return {"round": number, "query": query, "source": source, "k": k,
                "passages": [row.passage["id"] for row in rows], "max_rel": float(rel.max()) if rel.size else 0.0}

    # --- the answer --------------------------------------------------------------------
    def _choose(self, results: Sequence[QuestionResult]) -> None:
        """Every question's answer by `candidates.choose` over the batch's table."""
        choice = choose(Table.from_results(results, self.opts.task), self.opts.choice)
        for q, r in enumerate(results):
            r.chosen, r.refused, r.refusal_reason = choice.index(q), bool(choice.refused[q]), choice.reasons[q]
            r.scores = choice.question_scores(q)
            if r.refused:
                r.prediction = self.opts.refuse.message
            else:
                r.prediction = r.candidates[r.chosen].text if r.chosen is not None else r.no_retrieval.text


def fill_rows(rows: list[Row], seg: Segments, tok) -> None:
    """Copy the engine's per-row results into the rows."""
    isrel = tok.isrel_ids
    for i, row in enumerate(rows):
        row.ids = seg.ids(i)
        row.seq = float(seg.seq[i])
        row.rel_probs, row.sup_probs, row.use_probs = seg.rel_probs[i], seg.sup_probs[i], seg.use_probs[i]
        row.sup_found, row.use_found = bool(seg.sup_found[i]), bool(seg.use_found[i])
        row.rel_label = isrel.index(row.ids[0]) if row.ids and row.ids[0] in isrel else -1
        row.text = tok.decode(row.ids, skip_control=True).strip()


def keep_top_rows(src: Sequence[int], is_passage: Sequence[bool], rel_probs: np.ndarray, m: int) -> list[int]:
    """Indices of the rows to decode: per question (`src`), the m passage rows with the highest
    IsRel score (rank order breaks ties), and every row without a passage."""
    rel = scoring.rel_score(rel_probs)
    by_question: dict[int, list[int]] = {}
    for j, (q, p) in enumerate(zip(src, is_passage)):
        if p:
            by_question.setdefault(q, []).append(j)
    kept = {j for j, p in enumerate(is_passage) if not p}
    for rows in by_question.values():
        kept.update(sorted(rows, key=lambda j: -rel[j])[:m])  # sorted is stable: rank order on ties
    return sorted(kept)


def rel_scores(rows: Sequence[Row]) -> np.ndarray:
    return scoring.rel_score(np.array([r.rel_probs for r in rows]).reshape(-1, 2))


def best_text(r: QuestionResult, opts: ScoreOptions) -> str:
    """The text of the best-scoring candidate so far (the model's own answer)."""
    decoded = [c for c in r.candidates if not c.pruned]
    if not decoded:
        return ""
    return decoded[int(np.argmax(candidate_scores(Table.from_rows([decoded], "open"), opts)["final"]))].text


def output_record(r: QuestionResult, opts: GenerateOptions) -> dict[str, Any]:
    """The JSON line of `generate` (docs/generate-format.md); the scores are the ones the
    answer was chosen by (`ShortForm._choose`, under the options it ran or re-chose with)."""
    scores = r.scores
    cands = []
    for j, c in enumerate(r.candidates):
        cand = {"passage": c.passage, "text": c.text,
                "scores": {k: float(v[j]) for k, v in scores.items()}}
        if c.passages is not None:
            cand["passages"] = c.passages
        if c.pruned:
            cand["pruned"] = True
        if opts.trace:
            cand.update(prompt_token_ids=r.prompt + c.suffix, token_ids=c.ids, passage_tokens_dropped=c.dropped)
        cands.append(cand)
    out = {"id": r.item.id, "question": r.item.question, "prediction": r.prediction, "retrieved": r.retrieved,
           "p_retrieve": float(scoring.paper_ratio(r.retrieve_logprobs)), "candidates": cands, "chosen": r.chosen,
           "pipeline": opts.pipeline, "refused": r.refused, "refusal_reason": r.refusal_reason}
    if opts.corrective.enabled:
        out.update(rounds=r.rounds, retry_stopped=r.retry_stopped, retry_tokens=r.retry_tokens)
    if opts.trace:
        out["prompt_token_ids"] = r.prompt
        out["retrieve_probs"] = dict(zip(T.RETRIEVE_GROUP, np.exp(r.retrieve_logprobs).tolist()))
        if r.no_retrieval is not None:
            nr = r.no_retrieval
            out["no_retrieval"] = {"text": nr.text, "prompt_token_ids": r.prompt + nr.suffix, "token_ids": nr.ids}
    return out
