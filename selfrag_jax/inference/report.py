"""Cost and quality of a run: what `generate` writes to `<output>.report.json` and what
`compare` puts side by side.

Cost: retrieval, retry and refusal rates, latency per question and tokens processed.
Latency: `run_batches` times each compiled batch (wall clock, host work included) and
gives each of its questions an equal share; with batch size 1 that is each question's own
time. The first batches include compilation. Tokens are real (unpadded) tokens the engine
ran: prompts and passages prefilled, tokens generated.

Quality (when the input carries the ground truth): accuracy is the released `match` (any
gold answer a case-sensitive substring of the prediction, `selfrag_jax.metrics`); refusal accuracy counts a record right when it was refused (by
the support bar, or the answer is the refusal message) exactly when it is marked `"answerable": false`; faithfulness is the share of answers
(not refusals, with a passage) that a judge finds supported by their passage(s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from selfrag_jax.inference.scoring import RefuseOptions
from selfrag_jax.metrics import match, normalize_answer


def cost_report(records: list[dict[str, Any]], latencies: Sequence[float], tokens, batch_size: int,
                seconds: float) -> dict[str, Any]:
    """Rates, latency and tokens of one run (`tokens`: the engine's `TokenCount`)."""
    n = max(len(records), 1)
    lat = np.asarray(list(latencies) or [0.0], np.float64)
    return {
        "n": len(records),
        "retrieval_rate": sum(bool(r.get("retrieved")) for r in records) / n,
        "retry_rate": sum(len(r.get("rounds", [])) > 1 for r in records) / n,
        "refusal_rate": sum(bool(r.get("refused")) for r in records) / n,
        "latency_s": {"p50": float(np.percentile(lat, 50)), "p95": float(np.percentile(lat, 95)),
                      "mean": float(lat.mean())},
        "latency_method": ("measured per question (batch size 1)" if batch_size == 1 else
                           f"wall time of each batch (up to {batch_size} questions) divided among its questions"),
        "tokens": {"prefill": tokens.prefill, "decode": tokens.decode, "total": tokens.total,
                   "per_question": tokens.total / n},
        "seconds": seconds,
    }


class SupportJudge(Protocol):
    """Is `prediction` supported by `passages`? None: cannot tell for this record."""

    def supported(self, record: dict[str, Any], prediction: str, passages: list[dict[str, str]]) -> bool | None: ...


@dataclass
class EntailmentJudge:
    """Any NLI model with `entails(premise, hypothesis) -> bool` as a support judge; the
    premise is the passages as "Title: t\\ntext" blocks."""

    model: Any

    def supported(self, record: dict[str, Any], prediction: str, passages: list[dict[str, str]]) -> bool | None:
        premise = "\n".join(f"Title: {p.get('title', '')}\n{p['text']}" for p in passages)
        return bool(self.model.entails(premise, prediction))


def used_passages(record: dict[str, Any]) -> list[dict[str, str]]:
    """The passage(s) the answer was generated from: the chosen candidate's (all of them
    for naive RAG)."""
    chosen = record.get("chosen")
    if chosen is None or record.get("refused"):
        return []
    cand = record["candidates"][chosen]
    return cand.get("passages") or [cand["passage"]]


def quality_report(inputs: list[dict[str, Any]], records: list[dict[str, Any]],
                   judge: SupportJudge | None = None, refusal_message: str | None = None) -> dict[str, Any]:
    """Accuracy, refusal accuracy and faithfulness of `records` against the input records. A
    refusal is the support bar's or an answer that is the refusal message (the generator's own;
    default: `RefuseOptions`' message)."""
    answerable = [rec.get("answerable", True) is not False for rec in inputs]
    graded = [(inp, out) for inp, out, ok in zip(inputs, records, answerable) if ok and _answers(inp)]
    said = normalize_answer(RefuseOptions().message if refusal_message is None else refusal_message)
    refusals = [bool(out.get("refused")) or normalize_answer(out.get("prediction") or "") == said for out in records]
    un = [r for r, ok in zip(refusals, answerable) if not ok]
    out: dict[str, Any] = {
        "accuracy": _mean([match(o["prediction"], _answers(i)) for i, o in graded]),
        "n_graded": len(graded),
        "refusal_accuracy": _mean([r != ok for r, ok in zip(refusals, answerable)]) if un else None,
        "refusal_rate_unanswerable": _mean(un) if un else None,
        "refusal_rate_answerable": _mean([r for r, ok in zip(refusals, answerable) if ok]) if un else None,
        "faithfulness": None, "n_judged": 0,
    }
    if judge is not None:
        verdicts = []
        for inp, rec in zip(inputs, records):
            psgs = used_passages(rec)
            verdict = judge.supported(inp, rec["prediction"], psgs) if psgs else None
            if verdict is not None:
                verdicts.append(verdict)
        out.update(faithfulness=_mean(verdicts) if verdicts else None, n_judged=len(verdicts))
    return out


def _answers(record: dict[str, Any]) -> list[str]:
    answers = record.get("answers", record.get("answer", []))
    return [str(a) for a in (answers if isinstance(answers, list) else [answers])]


def _mean(values: Sequence[Any]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def flat_row(report: dict[str, Any]) -> dict[str, Any]:
    """One table row: the cost columns plus whatever quality fields the report has."""
    row = {k: report[k] for k in ("retrieval_rate", "retry_rate", "refusal_rate")}
    row.update(latency_p50_s=report["latency_s"]["p50"], latency_p95_s=report["latency_s"]["p95"],
               tokens_per_question=report["tokens"]["per_question"])
    for key in ("accuracy", "faithfulness", "refusal_accuracy"):
        if report.get(key) is not None:
            row[key] = report[key]
    return row


def format_table(reports: dict[str, dict[str, Any]]) -> str:
    """Pipelines as columns, metrics as rows."""
    rows = {name: flat_row(r) for name, r in reports.items()}
    keys = list(dict.fromkeys(k for row in rows.values() for k in row))
    names = list(rows)
    width = max(len(k) for k in keys) + 2
    cols = [max(len(n), 10) + 2 for n in names]
    lines = ["".ljust(width) + "".join(n.rjust(c) for n, c in zip(names, cols))]
    for k in keys:
        cells = [_cell(rows[n].get(k)).rjust(c) for n, c in zip(names, cols)]
        lines.append(k.ljust(width) + "".join(cells))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
