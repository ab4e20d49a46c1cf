"""Long-form Self-RAG: segment-level beam search (paper Algorithm 1, docs/method.md section 5).

Each level prefills every live beam's context once (that gives the retrieve decision at
the boundary), then one segment step decodes all children of all beams of all questions:
one child per passage where the beam retrieves, one `[No Retrieval]` (or `[Continue to Use
Evidence]`, whichever the model prefers) child where it does not. A beam's context is the
prompt plus everything generated so far, passages and reflection tokens included, as in
training. Passages: the item's `ctxs` when it has them (static), otherwise retrieved online
from the question plus the previous segment (or once per question with `static_passages`).

Unlike the released long-form script: the sequence score is used, utility reads the IsUse
group, siblings never share text, and beams expand past the first level. Beams are ranked
by the mean of their segment scores, so finished and unfinished beams compare fairly; a
segment without a passage scores exp(seq) + w_use * use (no IsRel/IsSup to judge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.inference import scoring
from selfrag_jax.inference.engine import Engine
from selfrag_jax.inference.items import Item, passage
from selfrag_jax.inference.candidates import Row, Table, candidate_scores
from selfrag_jax.inference.selfrag import PASSAGE_MARKERS, GenerateOptions, RetrieveFn, ShortForm, fill_rows


@dataclass
class Segment:
    text: str
    passage: dict[str, str] | None
    doc: int | None  # 1-based index into the item's docs
    scores: dict[str, float]
    token_ids: list[int]


@dataclass
class Beam:
    tokens: list[int]  # prompt + all generated context so far
    segments: list[Segment] = field(default_factory=list)
    done: bool = False

    @property
    def score(self) -> float:
        return float(np.mean([s.scores["final"] for s in self.segments])) if self.segments else 0.0

    @property
    def last_text(self) -> str:
        return self.segments[-1].text if self.segments else ""


@dataclass
class LongResult:
    item: Item
    prompt: list[int]
    p_retrieve: float
    docs: list[dict[str, str]]
    best: Beam
    prediction: str = ""
    latency_s: float = 0.0  # set by `run_batches`


class LongForm:
    def __init__(self, engine: Engine, tokenizer, opts: GenerateOptions, retrieve_fn: RetrieveFn | None = None):
        self.engine = engine
        self.tok = tokenizer
        self.opts = opts
        self.retrieve_fn = retrieve_fn
        self.short = ShortForm(engine, tokenizer, opts, retrieve_fn)  # prompts, passages, truncation
        self.stop_ids = set(tokenizer.isuse_ids) | {tokenizer.eos_id}

    def run(self, items: Sequence[Item]) -> list[LongResult]:
        prompts = [self.short.prompt_ids(it) for it in items]
        static = [it.ctxs is not None or self.opts.static_passages or self.retrieve_fn is None for it in items]
        fixed = self._static_passages(items, static)
        docs: list[list[dict[str, str]]] = [[passage(c, f"{it.id}:{j}") for j, c in enumerate(ps)]
                                            for it, ps in zip(items, fixed)]
        beams = [[Beam(list(p))] for p in prompts]
        p_first = [0.0] * len(items)
        for depth in range(self.opts.max_depth):
            live = [(q, b) for q, bs in enumerate(beams) for b in bs if not b.done]
            if not live:
                break
            children = self._expand(items, live, docs, fixed, static, p_first if depth == 0 else None)
            for q in range(len(items)):
                pool = [b for b in beams[q] if b.done] + children.get(q, [])
                beams[q] = sorted(pool, key=lambda b: b.score, reverse=True)[: self.opts.beam_width]
        results = []
        for q, it in enumerate(items):
            best = max(beams[q], key=lambda b: b.score)
            results.append(LongResult(it, prompts[q], p_first[q], docs[q], best, self._prediction(best)))
        return results

    def _static_passages(self, items: Sequence[Item], static: list[bool]) -> list[list[dict[str, Any]]]:
        need = [i for i, s in enumerate(static) if s and self.opts.retrieve.mode != "never"]
        out: list[list[dict[str, Any]]] = [[] for _ in items]
        for i, ps in zip(need, self.short.passages([items[i] for i in need]) if need else []):
            out[i] = ps
        return out

    def _expand(self, items, live, docs, fixed, static, p_first) -> dict[int, list[Beam]]:
        """One level: decide, gather passages, decode every child of every live beam."""
        state = self.engine.prefill([b.tokens for _, b in live])
        greedy_ret = state.greedy == self.tok.control_id(T.RETRIEVAL)
        retrieve = scoring.decide_retrieve(state.retrieve_logprobs, greedy_ret, self.opts.retrieve)
        if p_first is not None:
            for (q, _), lp in zip(live, state.retrieve_logprobs):
                p_first[q] = float(scoring.paper_ratio(lp))
        online = [i for i, (q, _) in enumerate(live) if retrieve[i] and not static[q]]
        queries = [f"{items[live[i][0]].question} {live[i][1].last_text}".strip() for i in online]
        found = dict(zip(online, self.retrieve_fn(queries, self.opts.ndocs) if online else []))
        src, rows, parents = [], [], []
        for i, (q, beam) in enumerate(live):
            psgs = (fixed[q] if static[q] else found.get(i, [])) if retrieve[i] else []
            for j, c in enumerate(psgs):
                rows.append(self.short.passage_row(beam.tokens, passage(c, f"{items[q].id}:{j}")))
            if not psgs:
                rows.append(Row([self._no_retrieval_token(state.retrieve_logprobs[i])]))
            src.extend([i] * (len(rows) - len(src)))
            parents.extend([(q, beam)] * (len(rows) - len(parents)))
        limits = [self.short.max_len - len(parents[n][1].tokens) - len(r.suffix) for n, r in enumerate(rows)]
        fill_rows(rows, self.engine.decode(state, src, [r.suffix for r in rows], limits), self.tok)
        return self._children(rows, parents, docs)

    def _no_retrieval_token(self, retrieve_logprobs: np.ndarray) -> int:
        """[No Retrieval] or [Continue to Use Evidence], whichever the model prefers here."""
        prefer_continue = retrieve_logprobs[2] > retrieve_logprobs[0]
        return self.tok.control_id(T.CONTINUE_EVIDENCE if prefer_continue else T.NO_RETRIEVAL)

    def _children(self, rows: list[Row], parents: list, docs) -> dict[int, list[Beam]]:
        # one table group per parent beam: the retriever prior is over the passages it was given
        groups: dict[int, list[Row]] = {}
        for row, (_, beam) in zip(rows, parents):
            groups.setdefault(id(beam), []).append(row)
        scores = candidate_scores(Table.from_rows(list(groups.values()), self.opts.task), self.opts.score)
        out: dict[int, list[Beam]] = {}
        for n, (row, (q, parent)) in enumerate(zip(rows, parents)):
            seg_scores = {k: float(v[n]) for k, v in scores.items()}
            ids = row.ids
            ends_open = bool(ids) and ids[-1] in self.tok.retrieve_ids  # the next level decides that token
            kept = ids[:-1] if ends_open else ids
            tokens = parent.tokens + row.suffix + kept
            done = not ids or ids[-1] in self.stop_ids or len(tokens) + PASSAGE_MARKERS + 1 >= self.short.max_len
            doc = self._doc_index(docs[q], row.passage)
            segment = Segment(row.text, row.passage, doc, seg_scores, ids)
            out.setdefault(q, []).append(Beam(tokens, parent.segments + [segment], done))
        return out

    @staticmethod
    def _doc_index(docs: list[dict[str, str]], psg: dict[str, str] | None) -> int | None:
        if psg is None:
            return None
        for i, d in enumerate(docs):
            if d["id"] == psg["id"] and d["text"] == psg["text"]:
                return i + 1
        docs.append(psg)
        return len(docs)

    def _prediction(self, beam: Beam) -> str:
        cite = self.opts.task == "asqa"
        parts = [s.text + (f" [{s.doc}]" if cite and s.doc is not None else "") for s in beam.segments if s.text]
        return " ".join(parts)

    def record(self, r: LongResult) -> dict[str, Any]:
        segments = []
        for s in r.best.segments:
            seg = {"text": s.text, "passage": s.passage, "scores": s.scores}
            if self.opts.trace:
                seg["token_ids"] = s.token_ids
            segments.append(seg)
        out = {"id": r.item.id, "question": r.item.question, "prediction": r.prediction,
               "retrieved": any(s.passage is not None for s in r.best.segments), "p_retrieve": r.p_retrieve,
               "candidates": [], "chosen": None, "segments": segments, "docs": r.docs, "output": r.prediction}
        if self.opts.trace:
            out["prompt_token_ids"] = r.prompt
            out["token_ids"] = r.best.tokens[len(r.prompt):]
        return out
