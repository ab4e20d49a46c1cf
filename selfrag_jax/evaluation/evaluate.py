"""`selfrag-jax eval`: metrics of a predictions file for the released tasks and the world's.

Predictions are `generate`'s JSON lines (`prediction`, `retrieved`, long form also `docs`),
or an ALCE-style JSON file `{"data": [{"output", "docs", ...}]}`. Gold answers come from the
predictions themselves (`answers` / `answer` / `answerKey` / `qa_pairs`) or from `--input`
(the eval file given to `generate`), matched by `id` when every prediction's id is found
there, else by line order. Every value is a fraction in [0, 1]; the table shows percent.
See `metrics` for the released `match` and the quirks it reproduces.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrag_jax import metrics as M
from selfrag_jax.tokens import REFUSAL


@dataclass(frozen=True)
class EvalTask:
    kind: str  # short | factcheck | mc | longform | refusal
    citations: str | None = None  # None, "nli" (--nli-model) or "world" (--world)


TASKS: dict[str, EvalTask] = {
    "popqa": EvalTask("short"), "triviaqa": EvalTask("short"), "pubhealth": EvalTask("factcheck"),
    "arc_c": EvalTask("mc"), "asqa": EvalTask("longform", "nli"),
    "world_qa": EvalTask("short"), "world_qa_wordings": EvalTask("short"), "world_noretrieval": EvalTask("short"),
    "world_factcheck": EvalTask("factcheck"), "world_mc": EvalTask("mc"),
    "world_longform": EvalTask("longform", "world"), "world_unanswerable": EvalTask("refusal"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--predictions", required=True, help="generate's JSON lines, or ALCE JSON {'data': [...]}")
    p.add_argument("--input", help="the eval file (gold answers), matched by id or line order")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument("--nli-model", metavar="DIR", help="asqa: HF sequence-classification NLI folder for citations")
    p.add_argument("--world", metavar="DIR", help="world_longform: world folder (entities.jsonl, passages.jsonl) "
                                                 "whose ground truth judges citations")
    p.add_argument("--per-item", metavar="FILE", help="also write per-item scores as JSON lines")


def run(args: argparse.Namespace) -> int:
    from selfrag_jax.cli import CLIError

    preds = read_records(args.predictions)
    if not preds:
        raise CLIError(f"{args.predictions}: no predictions")
    gold = read_records(args.input) if args.input else None
    judge = _judge(args, CLIError)
    try:
        result, per_item = evaluate(args.task, preds, gold, judge)
    except LookupError as err:
        raise CLIError(str(err)) from None
    if args.per_item:
        from selfrag_jax.utils import atomic_file

        with atomic_file(args.per_item) as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in per_item)
    print(json.dumps(result, indent=1) if args.json else format_table(args.task, result))
    return 0


def _judge(args: argparse.Namespace, error: type[Exception]):
    spec = TASKS[args.task]
    if spec.citations == "nli" and args.nli_model:
        from selfrag_jax.evaluation.citations import HFJudge

        return HFJudge(args.nli_model)
    if spec.citations == "world" and args.world:
        from selfrag_jax.world.judges import WorldJudge

        if not (Path(args.world) / "entities.jsonl").exists():
            raise error(f"{args.world}: no entities.jsonl (not a world folder)")
        return WorldJudge.from_world(args.world)
    return None


# --- reading --------------------------------------------------------------------------
def read_records(path: str | Path) -> list[dict[str, Any]]:
    """JSON lines, or one JSON document: a list or ALCE's {"data": [...]}."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("[") or (stripped.startswith("{") and _is_one_document(stripped)):
        doc = json.loads(stripped)
        rows = doc["data"] if isinstance(doc, dict) and "data" in doc else doc
        return rows if isinstance(rows, list) else [rows]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: malformed JSON ({err.msg})") from None
    return out


def _is_one_document(text: str) -> bool:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("data"), list)


def align_gold(preds: list[dict], gold: list[dict] | None) -> list[dict]:
    """Per prediction, the record its gold answers come from."""
    if gold is None:
        return preds
    by_id = {str(g["id"]): g for g in gold if "id" in g}
    if by_id and all("id" in p and str(p["id"]) in by_id for p in preds):
        return [{**by_id[str(p["id"])], **_gold_fields(p)} for p in preds]
    if len(gold) != len(preds):
        raise LookupError(f"{len(preds)} predictions but {len(gold)} input records, and ids do not match")
    return [{**g, **_gold_fields(p)} for p, g in zip(preds, gold)]


def _gold_fields(pred: dict) -> dict:
    """Gold fields a prediction record carries itself (they win over the input's)."""
    return {k: pred[k] for k in ("answers", "answer", "answerKey", "qa_pairs") if k in pred}


def prediction_text(record: dict) -> str:
    for key in ("prediction", "output", "pred"):
        if isinstance(record.get(key), str):
            return record[key]
    raise LookupError(f"record {record.get('id', '?')}: no 'prediction' (or 'output') string")


# --- scoring --------------------------------------------------------------------------
def evaluate(task: str, preds: list[dict], gold: list[dict] | None = None, judge=None) -> tuple[dict, list[dict]]:
    """(aggregate metrics, per-item rows)."""
    spec = TASKS[task]
    golds = align_gold(preds, gold)
    rows = [score_item(spec, p, g) for p, g in zip(preds, golds)]
    result: dict[str, Any] = {"task": task, "n": len(rows)}
    for key in rows[0]:
        if key != "id":
            result[key] = sum(r[key] for r in rows) / len(rows)
    flags = [p["retrieved"] for p in preds if isinstance(p.get("retrieved"), bool)]
    result["retrieval_frequency"] = sum(flags) / len(flags) if len(flags) == len(preds) else None
    if spec.kind == "longform" and judge is not None:
        from selfrag_jax.evaluation.citations import citation_scores

        docs = [p.get("docs") or g.get("docs") or g.get("ctxs") or [] for p, g in zip(preds, golds)]
        outs = [M.alce_output(prediction_text(p)) for p in preds]
        cites = citation_scores(outs, docs, judge)
        result.update(citation_recall=cites.recall, citation_precision=cites.precision)
    return result, rows


def score_item(spec: EvalTask, pred: dict, gold: dict) -> dict[str, Any]:
    text = prediction_text(pred)
    answers = gold_answers(spec, gold)
    row = {"id": pred.get("id", gold.get("id")), "match": M.match(text, answers),
           "em": M.exact_match(text, answers), "f1": M.token_f1(text, answers)}
    if spec.kind == "mc" and gold.get("answerKey") is not None:
        row["choice_accuracy"] = M.choice_accuracy(text, gold["answerKey"])
    if spec.kind == "longform":
        pairs = [M.as_list(q.get("short_answers")) for q in gold.get("qa_pairs") or []] or [[a] for a in answers]
        em = M.str_em(M.alce_output(text), pairs)
        row.update(str_em=em, str_em_hit=float(em == 1.0))
    return row


def gold_answers(spec: EvalTask, gold: dict) -> list[str]:
    if spec.kind == "mc":
        return M.arc_gold(gold)
    if spec.kind == "refusal":
        return [REFUSAL]  # unanswerable: the right answer is the refusal
    answers = M.as_list(gold.get("answers", gold.get("answer")))
    if not answers and gold.get("qa_pairs"):
        answers = [a for q in gold["qa_pairs"] for a in M.as_list(q.get("short_answers"))]
    return M.factcheck_gold(answers) if spec.kind == "factcheck" else answers


def format_table(task: str, result: dict) -> str:
    keys = [k for k in result if k not in ("task", "n") and result[k] is not None]
    header = ["task", "n"] + keys
    cells = [task, str(result["n"])] + [f"{100 * result[k]:.1f}" for k in keys]
    widths = [max(len(h), len(c)) for h, c in zip(header, cells)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return line(header) + "\n" + line(cells) + "\n(percent; match = the released metric)"
