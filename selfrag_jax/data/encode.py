"""Tokenization and loss weights of one example, on token ids (docs/method.md sections 3-4).

An example is `[BOS] prompt target [EOS]` with one weight per token: the weight of
*predicting* that token. The prompt is untrusted text (`encode_text`); a generator target
is trusted Self-RAG output (`encode_structured`), so `<paragraph>` / `</paragraph>` are
found by id, and a passage quoting those characters cannot open or close a span.

Masking happens after truncation, so a `<paragraph>` whose `</paragraph>` was cut off masks
to the end (both modes). `passage_loss_weight` > 0 trains passage content lightly instead
of not at all: the paper uses 0, but a tiny model learns to read passages faster when it
also has to model them (used by the embedded default's training). `unsupported_weight` < 1
(beyond the paper) weighs the text of a segment the annotation rates `[No support /
Contradictory]`: its IsSup token is learned, the unsupported answer less or not at all, so
contrast examples (a wrong value against a passage) teach IsSup without teaching the value.
`unhelpful_weight` < 1 does the same for an output rated `[Utility:1]` or `[Utility:2]`: the
text of its relevant segments (an answer to another question, found in the passage) is weighed
down, its IsSup and Utility tokens are learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from selfrag_jax import tokens as T


@dataclass(frozen=True)
class MaskConfig:
    """How loss weights are set.

    masking: "paper" masks the content of each `<paragraph>`..`</paragraph>` span separately
      (markers stay trained); "released" masks from the first `<paragraph>`+1 to the last
      `</paragraph>`-1 of the sequence, as the reference code does.
    prompt_off_by_one: the reference's quirk of keeping the last prompt token in the loss.
    passage_loss_weight: weight of masked passage content (0.0 = the paper).
    critic_labels: "text" encodes a critic label as plain text, as the released critic
      emits it; "tokens" encodes it as the reflection token's id.
    unsupported_weight: weight of a segment's text between `[Relevant]` and `[No support /
      Contradictory]` (1.0 = the paper).
    unhelpful_weight: weight of the text after each `[Relevant]` of an output that ends
      `[Utility:1]` or `[Utility:2]` (1.0 = the paper).
    """

    masking: Literal["paper", "released"] = "paper"
    prompt_off_by_one: bool = False
    passage_loss_weight: float = 0.0
    critic_labels: Literal["text", "tokens"] = "text"
    unsupported_weight: float = 1.0
    unhelpful_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.masking not in ("paper", "released"):
            raise ValueError(f"masking must be 'paper' or 'released', got {self.masking!r}")
        if self.critic_labels not in ("text", "tokens"):
            raise ValueError(f"critic_labels must be 'text' or 'tokens', got {self.critic_labels!r}")
        if not 0.0 <= self.passage_loss_weight <= 1.0:
            raise ValueError(f"passage_loss_weight must be in [0, 1], got {self.passage_loss_weight}")
        for name in ("unsupported_weight", "unhelpful_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


class Example(NamedTuple):
    tokens: np.ndarray  # int32 [n]
    weights: np.ndarray  # float32 [n], weight of predicting tokens[j]
    truncated: bool

    @property
    def has_loss(self) -> bool:
        return bool(np.any(self.weights[1:] > 0))  # tokens[0] is never a target


@dataclass(frozen=True)
class SpecialIds:
    """The ids masking needs; plain ints so the seqio path can carry them into TF."""

    bos: int | None
    eos: int
    open: int
    close: int
    relevant: int
    no_support: int
    issup: tuple[int, ...]  # the IsSup group
    low_utility: tuple[int, ...]  # [Utility:1], [Utility:2]

    @classmethod
    def of(cls, tok) -> "SpecialIds":
        return cls(tok.bos_id, tok.eos_id, tok.control_id(T.PARAGRAPH_OPEN), tok.control_id(T.PARAGRAPH_CLOSE),
                   tok.control_id(T.RELEVANT), tok.control_id(T.NO_SUPPORT),
                   tuple(map(tok.control_id, T.ISSUP_GROUP)), tuple(map(tok.control_id, T.ISUSE_GROUP[:2])))


def generator_texts(record: dict) -> tuple[str, str]:
    """(prompt text, target text) of a generator record."""
    return T.format_prompt(record["instruction"], record.get("input", "")), record["output"]


def critic_texts(record: dict) -> tuple[str, str]:
    """(prompt text, label) of a critic record; the critic prompt has no trailing newline."""
    return T.CRITIC_PROMPT.format(instruction=record["instruction"], input=record.get("input", "")), record["output"]


def encode_parts(record: dict, kind: str, tok, cfg: MaskConfig) -> tuple[list[int], list[int]]:
    """Prompt ids (untrusted text) and target ids (structured for the generator), no BOS/EOS."""
    if kind == "generator":
        prompt, target = generator_texts(record)
        return tok.encode_text(prompt), tok.encode_structured(target)
    if kind == "text":
        return [], tok.encode_text(record["output"])
    prompt, label = critic_texts(record)
    return tok.encode_text(prompt), (tok.encode_text(label) if cfg.critic_labels == "text" else tok.encode_structured(label))


def passage_content(tokens: np.ndarray, ids: SpecialIds, masking: str) -> np.ndarray:
    """Boolean mask of passage content (markers excluded), found by id."""
    is_open, is_close = tokens == ids.open, tokens == ids.close
    n = len(tokens)
    if masking == "released":
        # One span: first <paragraph>+1 .. last </paragraph>-1. If a <paragraph> is still open
        # at the end (its </paragraph> cut off), the sequence's last </paragraph> lies beyond
        # the end: the span runs to the end.
        opens, closes = np.flatnonzero(is_open), np.flatnonzero(is_close)
        out = np.zeros(n, bool)
        if len(opens):
            closes = closes[closes > opens[0]]
            end = n if not len(closes) or opens[-1] > closes[-1] else closes[-1]
            out[opens[0] + 1:end] = True
        return out  # markers inside the span are masked too, as in the reference
    marker = is_open | is_close
    last = np.maximum.accumulate(np.where(marker, np.arange(n), -1)) if n else np.zeros(0, int)
    return (last >= 0) & is_open[np.maximum(last, 0)] & ~marker


def relevant_text(tokens: np.ndarray, ids: SpecialIds, closing: tuple[int, ...]) -> np.ndarray:
    """Boolean mask of the text strictly between a `[Relevant]` and the IsSup token that closes
    its segment, for segments closed by one of `closing` (the tokens after `[Relevant]`, up to IsSup)."""
    out = np.zeros(len(tokens), bool)
    relevant = np.flatnonzero(tokens == ids.relevant)
    for end in np.flatnonzero(np.isin(tokens, closing)):
        before = relevant[relevant < end]
        if len(before):
            out[before[-1] + 1:end] = True
    return out


def unsupported_text(tokens: np.ndarray, ids: SpecialIds) -> np.ndarray:
    """The text of each segment rated `[No support / Contradictory]`."""
    return relevant_text(tokens, ids, (ids.no_support,))


def unhelpful_text(tokens: np.ndarray, ids: SpecialIds) -> np.ndarray:
    """The text of every relevant segment, in a sequence holding `[Utility:1]` or `[Utility:2]`:
    the answers an output rated unhelpful gives from passages it found relevant."""
    if not np.isin(tokens, ids.low_utility).any():
        return np.zeros(len(tokens), bool)
    return relevant_text(tokens, ids, ids.issup)


def assemble(prompt: list[int] | np.ndarray, target: list[int] | np.ndarray, kind: str, ids: SpecialIds,
             cfg: MaskConfig, max_tokens: int | None = None) -> Example:
    """`[BOS] prompt target [EOS]`, truncated to `max_tokens`, with its loss weights."""
    head = [ids.bos] if ids.bos is not None else []
    tokens = np.asarray([*head, *np.asarray(prompt).tolist(), *np.asarray(target).tolist(), ids.eos], np.int32)
    prompt_len = len(head) + len(prompt)
    truncated = max_tokens is not None and len(tokens) > max_tokens
    if truncated:
        tokens = tokens[:max_tokens]
    weights = np.zeros(len(tokens), np.float32)
    weights[prompt_len:] = 1.0
    if cfg.prompt_off_by_one and 0 < prompt_len <= len(tokens):
        weights[prompt_len - 1] = 1.0
    if kind == "generator":
        content = passage_content(tokens, ids, cfg.masking)
        content[:prompt_len] = False
        weights[content] = cfg.passage_loss_weight
        if cfg.unsupported_weight != 1.0:
            unsupported = unsupported_text(tokens, ids)
            unsupported[:prompt_len] = False
            weights[unsupported] = cfg.unsupported_weight
        if cfg.unhelpful_weight != 1.0:
            unhelpful = unhelpful_text(tokens, ids)
            unhelpful[:prompt_len] = False
            weights[unhelpful] = cfg.unhelpful_weight
    return Example(tokens, weights, truncated)


def encode_record(record: dict, kind: str, tok, cfg: MaskConfig, max_tokens: int | None = None) -> Example:
    prompt, target = encode_parts(record, kind, tok, cfg)
    return assemble(prompt, target, kind, SpecialIds.of(tok), cfg, max_tokens)
