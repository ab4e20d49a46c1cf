"""Input records of `generate`: reading, validation (file:line errors) and task prompts.

Eval files are JSON lines `{"id"?, "question" | "instruction", "input"?, "answers"?,
"ctxs"?: [{"id"?, "title", "text"}], "choices"?, "answerKey"?}`. The task decides how the
question is folded into the instruction (docs/method.md section 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASK_INSTRUCTIONS = {
    "fever": "Is the following statement correct or not? Say true if it's correct; otherwise say false.",
    "pubhealth": "Is the following statement correct or not? Say true if it's correct; otherwise say false.",
    "arc_c": "Given four answer candidates, A, B, C and D, choose the best answer choice.",
    "asqa": ("Answer the following question. The question may be ambiguous and have multiple correct answers, "
             "and in that case, you have to provide a long-form answer including all correct answers."),
}


@dataclass
class Item:
    id: str
    question: str  # what the user asked (also the retrieval query)
    instruction: str  # what the prompt carries, task instruction folded in
    input: str = ""
    ctxs: list[dict[str, Any]] | None = None
    record: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # "file:line", for messages


def read_items(path: str | Path, task: str = "open") -> list[Item]:
    """Parse every line first, so bad input fails before any decoding, naming file:line."""
    items = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                items.append(parse_item(line, f"{path}:{number}", task, default_id=str(len(items))))
    return items


def parse_item(line: str, where: str, task: str = "open", default_id: str = "0") -> Item:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: malformed JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    return item_from_record(record, where, task, default_id)


def item_from_record(record: dict[str, Any], where: str, task: str = "open", default_id: str = "0") -> Item:
    """A parsed record (a `generate` line, or a `serve` request) checked and made an Item."""
    question = record.get("question", record.get("instruction"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: record has no 'question' or 'instruction' string")
    ctxs = record.get("ctxs")
    if ctxs is not None and not (isinstance(ctxs, list) and all(_is_passage(c) for c in ctxs)):
        raise ValueError(f"{where}: 'ctxs' must be a list of {{'title', 'text'}} objects")
    instruction, input_text = task_prompt(record, question, task)
    return Item(str(record.get("id", default_id)), question, instruction, input_text, ctxs, record, where)


def _is_passage(c: Any) -> bool:
    return isinstance(c, dict) and isinstance(c.get("text"), str) and isinstance(c.get("title", ""), str)


def task_prompt(record: dict[str, Any], question: str, task: str) -> tuple[str, str]:
    """(instruction, input) for the generator prompt."""
    if task in TASK_INSTRUCTIONS:
        if task == "arc_c":
            return f"{TASK_INSTRUCTIONS[task]}\n\n### Input:\n{question}{_choices(record)}", ""
        return f"{TASK_INSTRUCTIONS[task]}\n\n## Input:\n\n{question}", ""
    if "question" not in record:  # an instruction record, possibly with its own input
        return question, str(record.get("input") or "")
    return question, ""


def _choices(record: dict[str, Any]) -> str:
    choices = record.get("choices") or {}
    labels, texts = choices.get("label", []), choices.get("text", [])
    return "".join(f"\n{label}: {text}" for label, text in zip(labels, texts))


def passage(ctx: dict[str, Any], fallback_id: str) -> dict[str, Any]:
    """The {"id", "title", "text"} an output record carries for a passage, and its retriever
    "score" when it has a numeric one (the retriever's hits do; so do the released eval files' ctxs)."""
    out = {"id": str(ctx.get("id", fallback_id)), "title": str(ctx.get("title", "")), "text": str(ctx["text"])}
    score = ctx.get("score")
    if isinstance(score, (int, float)) and not isinstance(score, bool):
        out["score"] = float(score)
    elif isinstance(score, str):
        try:
            out["score"] = float(score)
        except ValueError:
            pass
    return out
