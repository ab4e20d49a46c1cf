"""ALCE citation precision and recall with a pluggable entailment judge.

The procedure is ALCE's `compute_autoais(citation=True)` (princeton-nlp/ALCE eval.py),
which is how the paper's ASQA citation numbers were measured:
- the output is split into sentences; each sentence's "[i]" markers (1-based into the
  item's `docs`) name its citations;
- recall: a sentence counts if the concatenation of its cited documents ("Title: t\\ntext",
  one per line) entails it; no citation or one out of range -> 0;
- precision: per citation of an entailed sentence, 1 unless the sentence has several
  citations, this one alone does not entail it and the others without it do (over-citation);
  item precision = supported citations / citations (0 without citations);
- both averaged over items that have at least one sentence (fractions here; ALCE prints
  them times 100).
ALCE splits sentences with NLTK; here a regex splitter stands in (NLTK is not a dependency),
and a citation written after the full stop ("... born in X. [1]", the layout `generate`
writes) is moved before it, so it stays with its own sentence.

Judges: `HFJudge` runs any Hugging Face sequence-classification NLI folder with
transformers (PyTorch, imported only when built); the bundled world's exact judge is
`selfrag_jax.world.judges.WorldJudge`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from selfrag_jax.metrics import remove_citations

_TRAILING_CITES = re.compile(r"([.!?])((?:\s*\[\d+\])+)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_CITE = re.compile(r"\[(\d+)")


class Judge(Protocol):
    def entails(self, premise: str, hypothesis: str) -> bool: ...


def format_document(doc: dict[str, Any]) -> str:
    """ALCE's `_format_document`."""
    return "Title: %s\n%s" % (doc.get("title", ""), doc.get("sent", doc.get("text", "")))


def split_sentences(text: str) -> list[str]:
    text = _TRAILING_CITES.sub(lambda m: m.group(2) + m.group(1), text.strip())
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


@dataclass
class CitationScores:
    recall: float  # 0..1
    precision: float  # 0..1
    items: int  # items with at least one sentence
    sentences: int


def citation_scores(outputs: Sequence[str], docs: Sequence[Sequence[dict[str, Any]]], judge: Judge) -> CitationScores:
    recalls, precisions, n_sents = [], [], 0
    for output, item_docs in zip(outputs, docs):
        sents = split_sentences(output)
        if not sents:
            continue
        entailed = supported = cited = 0
        for sent in sents:
            target = remove_citations(sent).strip()
            refs = [int(r) - 1 for r in _CITE.findall(sent)]
            if not refs or any(r >= len(item_docs) or r < 0 for r in refs):
                continue
            cited += len(refs)
            if not judge.entails(_joint(item_docs, refs), target):
                continue
            entailed += 1
            supported += len(refs) if len(refs) == 1 else sum(
                judge.entails(format_document(item_docs[r]), target)
                or not judge.entails(_joint(item_docs, [o for o in refs if o != r]), target) for r in refs)
        n_sents += len(sents)
        recalls.append(entailed / len(sents))
        precisions.append(supported / cited if cited else 0.0)
    mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
    return CitationScores(mean(recalls), mean(precisions), len(recalls), n_sents)


def _joint(docs: Sequence[dict[str, Any]], refs: Sequence[int]) -> str:
    return "\n".join(format_document(docs[r]) for r in refs)


# --- judges ---------------------------------------------------------------------------
class HFJudge:
    """Entailment from a Hugging Face sequence-classification folder (e.g. an MNLI model):
    entailed when the label named like "entail..." has the highest probability."""

    def __init__(self, folder: str | Path, device: str = "cpu", max_length: int = 512):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(folder)).to(device).eval()
        self.device, self.max_length = device, max_length
        labels = {i: str(name).lower() for i, name in self.model.config.id2label.items()}
        hits = [i for i, name in labels.items() if name.startswith("entail")]
        if not hits:
            raise ValueError(f"{folder}: no 'entailment' label in id2label {labels}")
        self.entail_id = int(hits[0])

    def entails(self, premise: str, hypothesis: str) -> bool:
        batch = self.tokenizer(premise, hypothesis, return_tensors="pt", truncation=True,
                               max_length=self.max_length).to(self.device)
        with self.torch.inference_mode():
            logits = self.model(**batch).logits[0]
        return int(logits.argmax()) == self.entail_id
