"""Answer metrics: the released `match`, SQuAD-style exact match and token F1, ALCE str_em.

`match` is what the paper reports as "accuracy" (docs/method.md section 6), reproduced with the
released script's quirks (AkariAsai/self-rag retrieval_lm/run_short_form.py + metrics.py),
because published numbers are only comparable under the same rules:

1. Substring, case-sensitive, no normalisation: 1 if any gold answer occurs in the
   prediction ("Paris" matches "It is Paris."; "paris" does not match "Paris").
2. Before matching, one leading "#" or ":" is cut from the prediction (the script strips
   `pred[0]` when it is either character).
3. If "SUPPORTS" occurs in the prediction it becomes "true", else if "REFUTES" occurs it
   becomes "false" -- for every task, case-sensitive, on the prediction (the gold labels of
   the released fact-checking files are already true/false). Gold labels written
   SUPPORTS/REFUTES (FEVER-style files) are mapped the same way here; with the released
   files that is a no-op, and without it such files could never match.
4. ARC-Challenge: the gold is `[answerKey]` as written in the file -- items whose keys
   are "1".."4" keep the digit even though the prompt relabels the choices A-D -- and
   the letter is matched as a substring, so any capital letter equal to the key anywhere
   in the prediction counts ("B" in "Because ..." matches key B). `choice_accuracy` gives
   the strict reading beside it (first option letter of the prediction == key, digits
   mapped to letters).
5. A record without gold answers scores 0 (the loop over golds finds nothing).
The released script also prints the retrieval frequency as count / len(result dict) (8),
not count / questions; we report the fraction of questions.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_ARC_DIGITS = {"1": "A", "2": "B", "3": "C", "4": "D", "5": "E"}


# --- the released metric --------------------------------------------------------------
def released_prediction(prediction: str) -> str:
    """The prediction as the released script scores it (quirks 2 and 3)."""
    if prediction[:1] in ("#", ":"):
        prediction = prediction[1:]
    if "SUPPORTS" in prediction:
        return "true"
    if "REFUTES" in prediction:
        return "false"
    return prediction


def factcheck_gold(answers: Sequence[str]) -> list[str]:
    """SUPPORTS/REFUTES gold labels as the true/false the predictions are mapped to."""
    return [{"SUPPORTS": "true", "REFUTES": "false"}.get(a, a) for a in answers]


def match(prediction: str, answers: Sequence[str]) -> int:
    """The released `match` after the released prediction mapping (quirks 1-3, 5)."""
    pred = released_prediction(prediction)
    return int(any(gold in pred for gold in answers))


def arc_gold(record: dict) -> list[str]:
    """The released ARC gold: `[answerKey]` as written (digits kept), else `answers`."""
    if record.get("answerKey") is not None:
        return [str(record["answerKey"])]
    return as_list(record.get("answers", record.get("answer")))


def choice_accuracy(prediction: str, answer_key: str) -> int:
    """Strict multiple choice: the option letter the prediction starts with is the key."""
    m = re.match(r"^\s*\(?([A-Ea-e])\b", prediction)
    key = _ARC_DIGITS.get(str(answer_key), str(answer_key)).upper()
    return int(bool(m) and m.group(1).upper() == key)


def as_list(answers) -> list[str]:
    if answers is None:
        return []
    return [str(a) for a in answers] if isinstance(answers, list) else [str(answers)]


# --- SQuAD-style metrics (extra columns) --------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> int:
    p = normalize_answer(prediction)
    return int(any(p == normalize_answer(a) for a in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token-level F1 over the gold answers (0 without gold answers)."""
    return max((_f1(prediction, a) for a in answers), default=0.0)


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


# --- ALCE (ASQA) ----------------------------------------------------------------------
def remove_citations(text: str) -> str:
    """ALCE's `remove_citations`: drop "[3]"-style markers (and every "]", as ALCE does)."""
    return re.sub(r"\[\d+", "", re.sub(r" \[\d+", "", text)).replace(" |", "").replace("]", "")


def alce_output(text: str) -> str:
    """ALCE's preprocessing of a model output: stripped, first line only."""
    return text.strip().split("\n")[0].replace("<|im_end|>", "")


def str_em(output: str, qa_pairs: Sequence[Sequence[str]]) -> float:
    """ALCE str_em of one item: the fraction of questions (each a list of short answers)
    with any short answer present in the normalised, citation-free output."""
    if not qa_pairs:
        return 0.0
    context = normalize_answer(remove_citations(output))
    return sum(any(normalize_answer(a) in context for a in shorts) for shorts in qa_pairs) / len(qa_pairs)
