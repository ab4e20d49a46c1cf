"""The Self-RAG vocabulary of control tokens and the text formats around them.

Strings, order and groups are those of the released checkpoints (docs/method.md
section 1): added after the base vocabulary in this order, then `<pad>`. Everything that
needs a reflection token asks the tokenizer for its id; nothing searches decoded text.
"""

from __future__ import annotations

RETRIEVE_GROUP = ("[No Retrieval]", "[Retrieval]", "[Continue to Use Evidence]")
ISREL_GROUP = ("[Irrelevant]", "[Relevant]")
PARAGRAPH_OPEN, PARAGRAPH_CLOSE = "<paragraph>", "</paragraph>"
ISUSE_GROUP = tuple(f"[Utility:{k}]" for k in range(1, 6))
ISSUP_GROUP = ("[Fully supported]", "[Partially supported]", "[No support / Contradictory]")

# Reference order: ids base+0 .. base+14, then <pad> at base+15.
REFLECTION_TOKENS = (
    *RETRIEVE_GROUP,
    *ISREL_GROUP,
    PARAGRAPH_OPEN,
    PARAGRAPH_CLOSE,
    *ISUSE_GROUP,
    *ISSUP_GROUP,
)
PAD_TOKEN = "<pad>"
CONTROL_TOKENS = (*REFLECTION_TOKENS, PAD_TOKEN)

NO_RETRIEVAL, RETRIEVAL, CONTINUE_EVIDENCE = RETRIEVE_GROUP
IRRELEVANT, RELEVANT = ISREL_GROUP
FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT = ISSUP_GROUP

# Weights of the five utility tokens in the IsUse score (docs/method.md section 5).
UTILITY_WEIGHTS = (-1.0, -0.5, 0.0, 0.5, 1.0)

PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
# The critic's prompt has no trailing newline (docs/method.md section 4).
CRITIC_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
# What an honest refusal answers (beyond the paper: `--refuse`), and what a reading critic
# writes when the evidence states no value.
REFUSAL = "I don't know."


def format_prompt(instruction: str, input: str = "") -> str:
    """The generator prompt of the paper, with or without an input field."""
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def passage_text(title: str, text: str) -> str:
    """Passage body as it sits between <paragraph> and </paragraph>."""
    return f"{title}\n{text}"
