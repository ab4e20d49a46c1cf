"""The annotation pipeline (docs/method.md section 4) with a scripted critic and retriever."""

from __future__ import annotations

import pytest

from selfrag_jax import tokens as T
from selfrag_jax.data.annotate import Critic, annotate, parse_label, split_sentences


@pytest.mark.parametrize("kind,text,label", [
    ("isrel", "[Relevant]", T.RELEVANT), ("isrel", " [Irrelevant] ", T.IRRELEVANT), ("isrel", "Yes.", T.RELEVANT),
    ("retrieve_input", "[No Retrieval]", T.NO_RETRIEVAL), ("retrieve_input", "yes", T.RETRIEVAL),
    ("issup", "[Partially supported]", T.PARTIALLY_SUPPORTED), ("issup", "fully", T.FULLY_SUPPORTED),
    ("issup", "[No support / Contradictory]", T.NO_SUPPORT), ("isuse", "[Utility:4]", "[Utility:4]"),
    ("isuse", "rating 2", "[Utility:2]"), ("retrieve_sentence", "[Continue to Use Evidence]", T.CONTINUE_EVIDENCE),
    ("issup", "[No support / Contra", T.NO_SUPPORT), ("isrel", "banana", None), ("isuse", "great", None),
])
def test_parse_label(kind, text, label):
    assert parse_label(kind, text) == label


@pytest.mark.parametrize("text,output,label", [
    ("Answer: Teirwick\n[No support / Contradictory]", "Teirwick", T.FULLY_SUPPORTED),  # the reading decides
    ("Answer: teirwick.", "Teirwick", T.FULLY_SUPPORTED),
    ("Answer: Sakav Works, 1865\n", "1865, Sakav Works", T.FULLY_SUPPORTED),
    ("Answer: Sakav Works", "Sakav Works, 1865", T.PARTIALLY_SUPPORTED),
    ("Answer: 1841\n[Fully supported]", "1865", T.NO_SUPPORT),
    ("Answer: I don't know.\n[Fully supported]", "1865", T.NO_SUPPORT),
    ("Answer: I don't know.", "I don't know.", T.NO_SUPPORT),  # a refusal is never supported by a passage
    ("[Partially supported]", "1865", T.PARTIALLY_SUPPORTED),  # no reading line: the label, as before
])
def test_issup_decided_by_the_critics_reading(text, output, label):
    assert parse_label("issup", text, output) == label
    assert parse_label("isrel", "Answer: x\n[Relevant]", "x") == T.RELEVANT  # only IsSup reads


def test_split_sentences():
    assert split_sentences("A b. C d? E!") == ["A b.", "C d?", "E!"]
    assert split_sentences("no stop") == ["no stop"]


class ScriptedCritic(Critic):
    """Answers by looking at the prompt: the test decides every label."""

    def __init__(self):
        super().__init__(params=None, config=None, tokenizer=None)
        self.seen: list[str] = []

    def generate(self, prompts, desc="critic"):
        out = []
        for p in prompts:
            self.seen.append(p)
            if "Would outside evidence" in p:
                out.append("[No Retrieval]" if "What is 2 + 2" in p else "[Retrieval]")
            elif "Is the evidence about" in p:
                out.append("[Relevant]" if "GOOD" in p or "HALF" in p else "[Irrelevant]")
            elif "Does the evidence support" in p:
                out.append("[Fully supported]" if "GOOD" in p else "[Partially supported]")
            elif "Does the output sentence need" in p:
                out.append("[Continue to Use Evidence]")
            else:
                out.append("garbage")  # IsUse unreadable -> safe default, counted
        return out


class ScriptedRetriever:
    def __init__(self):
        self.queries = []

    def retrieve(self, queries, k):
        self.queries += list(queries)
        return [[{"id": "d1", "title": "Bad", "text": "BAD text", "score": 3.0},
                 {"id": "d2", "title": "Half", "text": "HALF text", "score": 2.0},
                 {"id": "d3", "title": "Good", "text": "GOOD text", "score": 1.0}][:k] for _ in queries]


def test_annotate_builds_the_paper_format():
    records = [{"instruction": "Who is Ana?", "input": "", "output": "Ana is a baker. She lives in Rom.", "id": "a"},
               {"instruction": "What is 2 + 2?", "input": "", "output": "4", "id": "b"}]
    retriever = ScriptedRetriever()
    out, report = annotate(records, ScriptedCritic(), retriever, ndocs=3)
    first = (T.RETRIEVAL + T.PARAGRAPH_OPEN + "Good\nGOOD text" + T.PARAGRAPH_CLOSE + T.RELEVANT
             + "Ana is a baker." + T.FULLY_SUPPORTED)
    assert out[0]["output"] == first + T.CONTINUE_EVIDENCE + " She lives in Rom." + "[Utility:3]"
    assert out[1]["output"] == T.NO_RETRIEVAL + "4[Utility:3]"
    assert retriever.queries == ["Who is Ana? Ana is a baker.", "Who is Ana? She lives in Rom."]
    assert report["defaults"] == {"isuse": 2} and report["retrieval_rate"] == 0.5
    assert [r["id"] for r in out] == ["a", "b"]


def test_irrelevant_passages_are_written_without_issup():
    class NothingRelevant(ScriptedCritic):
        def generate(self, prompts, desc="critic"):
            return ["[Irrelevant]" if "Is the evidence about" in p else t
                    for p, t in zip(prompts, super().generate(prompts))]

    out, _ = annotate([{"instruction": "Q?", "input": "", "output": "One.", "id": "x"}], NothingRelevant(),
                      ScriptedRetriever(), ndocs=2)
    assert out[0]["output"] == (T.RETRIEVAL + T.PARAGRAPH_OPEN + "Bad\nBAD text" + T.PARAGRAPH_CLOSE + T.IRRELEVANT
                                + "One." + "[Utility:3]")


def test_irrelevant_share_keeps_a_critic_rejected_passage():
    """With irrelevant_share=1 every sentence that retrieved an irrelevant passage writes it
    (the best-ranked one) as [Irrelevant]; share 0 is the reference's rule."""
    records = [{"instruction": "Who is Ana?", "input": "", "output": "Ana is a baker.", "id": "a"}]
    out, report = annotate(records, ScriptedCritic(), ScriptedRetriever(), ndocs=3, irrelevant_share=1.0)
    assert out[0]["output"] == (T.RETRIEVAL + T.PARAGRAPH_OPEN + "Bad\nBAD text" + T.PARAGRAPH_CLOSE + T.IRRELEVANT
                                + "Ana is a baker." + "[Utility:3]")
    assert report["irrelevant_segments"] == 1
    out, report = annotate(records, ScriptedCritic(), ScriptedRetriever(), ndocs=3, irrelevant_share=0.0)
    assert T.RELEVANT + "Ana is a baker." in out[0]["output"] and report["irrelevant_segments"] == 0
    with pytest.raises(ValueError, match="irrelevant_share"):
        annotate(records, ScriptedCritic(), ScriptedRetriever(), irrelevant_share=1.5)


def test_annotation_decides_issup_by_a_reading_critics_answer_line():
    """A critic that writes reading lines: the passage whose reading equals the sentence wins,
    whatever label the critic wrote after it (annotation passes each sentence to the critic)."""
    class Reader(ScriptedCritic):
        def generate(self, prompts, desc="critic"):
            return [("Answer: Rom\n[No support / Contradictory]" if "GOOD" in p else "Answer: Lis\n[Fully supported]")
                    if "Does the evidence support" in p else t for p, t in zip(prompts, super().generate(prompts))]

    out, report = annotate([{"instruction": "Where does Ana live?", "input": "", "output": "Rom", "id": "x"}], Reader(),
                           ScriptedRetriever(), ndocs=3)
    assert out[0]["output"].startswith(T.RETRIEVAL + T.PARAGRAPH_OPEN + "Good\nGOOD text")
    assert T.FULLY_SUPPORTED in out[0]["output"]
    assert report["labels"]["issup"] == {T.NO_SUPPORT: 2, T.FULLY_SUPPORTED: 1}
