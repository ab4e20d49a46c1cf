"""The critic's inputs and labels per reflection-token type (docs/method.md section 4).

One place for the prompt layouts the critic is trained on and asked with: the world's
critic data builds examples with them, and `annotate` asks any critic with them.
"""

from __future__ import annotations

from selfrag_jax.tokens import (
    CONTINUE_EVIDENCE, CRITIC_PROMPT, FULLY_SUPPORTED, IRRELEVANT, ISUSE_GROUP, NO_RETRIEVAL, NO_SUPPORT,
    PARTIALLY_SUPPORTED, RELEVANT, RETRIEVAL,
)

INSTRUCTIONS = {  # short: every token of them costs a tiny critic compute on every example
    "retrieve_input": "Would outside evidence help to answer this instruction? Reply [Retrieval] or [No Retrieval].",
    "retrieve_sentence": (
        "Does the output sentence need evidence? Reply [Continue to Use Evidence] if the evidence given "
        "is enough, [Retrieval] if it needs new evidence, [No Retrieval] if it needs none."),
    "isrel": "Is the evidence about what the instruction asks? Reply [Relevant] or [Irrelevant].",
    "issup": (
        "Does the evidence support the output? Reply [Fully supported], [Partially supported] or "
        "[No support / Contradictory]."),
    "isuse": "Rate how well the output answers the instruction, true or not, from [Utility:1] (not at all) to [Utility:5] (fully).",
}
LABELS = {
    "retrieve_input": (RETRIEVAL, NO_RETRIEVAL),
    "retrieve_sentence": (RETRIEVAL, NO_RETRIEVAL, CONTINUE_EVIDENCE),
    "isrel": (RELEVANT, IRRELEVANT),
    "issup": (FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT),
    "isuse": ISUSE_GROUP,
}


def retrieve_input(instruction: str) -> str:
    return f"Task instruction: {instruction}"


def retrieve_sentence_input(instruction: str, preceding: str, evidence: str, sentence: str) -> str:
    return f"Task instruction: {instruction}\nPreceding sentences: {preceding}\nEvidence: {evidence}\nOutput: {sentence}"


def isrel_input(instruction: str, evidence: str) -> str:
    return f"Task instruction: {instruction}\nEvidence: {evidence}"


def issup_input(instruction: str, preceding: str, sentence: str, evidence: str) -> str:
    return f"Task instruction: {instruction}\nPreceding sentences: {preceding}\nOutput: {sentence}\nEvidence: {evidence}"


def issup_output(issup_text: str) -> str:
    """The output sentence of an `issup_input` text (its inverse, for checking a critic)."""
    return issup_text.split("\nOutput: ", 1)[1].split("\nEvidence: ", 1)[0]


def isuse_input(instruction: str, output: str) -> str:
    return f"Task instruction: {instruction}\nOutput: {output}"


def critic_prompt(record: dict) -> str:
    """The critic's full prompt for a record (CRITIC_PROMPT of tokens.py)."""
    return CRITIC_PROMPT.format(instruction=record["instruction"], input=record["input"])
