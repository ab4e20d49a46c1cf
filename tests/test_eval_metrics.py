"""`eval`: the released `match` and its quirks on hand-checked examples, EM/F1, ALCE str_em
and citation precision/recall with the world's ground-truth judge, and the command."""

from __future__ import annotations

import json

import pytest

from selfrag_jax.cli import main
from selfrag_jax import metrics as M
from selfrag_jax.evaluation.citations import citation_scores, split_sentences
from selfrag_jax.world.judges import WorldJudge
from selfrag_jax.evaluation.evaluate import evaluate


def test_match_is_a_case_sensitive_substring_without_normalisation():
    assert M.match("It is Paris, France.", ["Paris"]) == 1
    assert M.match("it is paris", ["Paris"]) == 0  # case-sensitive
    assert M.match("Paris", ["Paris, France"]) == 0  # gold inside prediction, not the reverse
    assert M.match("The Beatles", ["Beatles", "the Beatles"]) == 1  # any gold
    assert M.match("anything", []) == 0  # no gold: 0


def test_released_prediction_quirks():
    assert M.match("#Paris", ["#Paris"]) == 0 and M.match("##Paris", ["#Paris"]) == 1  # one leading # cut
    assert M.match(":yes", [":"]) == 0
    assert M.match("SUPPORTS", ["true"]) == 1 and M.match("REFUTES.", ["false"]) == 1
    assert M.match("The claim SUPPORTS it but REFUTES", ["true"]) == 1  # SUPPORTS checked first
    assert M.match("supports", ["true"]) == 0  # the mapping is case-sensitive too
    assert M.match("SUPPORTS Paris", ["Paris"]) == 0  # mapped for every task, as released
    assert M.factcheck_gold(["SUPPORTS", "REFUTES", "true"]) == ["true", "false", "true"]


def test_arc_scoring_reproduces_the_released_letter_substring():
    rec = {"answerKey": "B", "answers": ["ignored"]}
    assert M.arc_gold(rec) == ["B"]
    assert M.match("B", ["B"]) == 1 and M.match("A", ["B"]) == 0
    assert M.match("A: Because it rains", ["B"]) == 1  # any capital B counts (quirk)
    assert M.match("b", ["B"]) == 0
    assert M.arc_gold({"answerKey": "2"}) == ["2"] and M.match("B", ["2"]) == 0  # digit keys kept (quirk)
    assert M.choice_accuracy("A: Because it rains", "B") == 0 and M.choice_accuracy("(B) rain", "2") == 1


def test_exact_match_and_token_f1_are_squad_style():
    assert M.exact_match("The  Eiffel Tower!", ["eiffel tower"]) == 1
    assert M.exact_match("Eiffel Tower in Paris", ["eiffel tower"]) == 0
    assert M.token_f1("Eiffel Tower in Paris", ["the Eiffel Tower"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert M.token_f1("x", []) == 0.0


def test_str_em_counts_questions_whose_short_answer_appears():
    out = "It was built in 1889 [1]. The architect was Gustave Eiffel [2]."
    assert M.remove_citations(out) == "It was built in 1889. The architect was Gustave Eiffel."
    assert M.str_em(out, [["1889"], ["Eiffel", "G. Eiffel"], ["Paris"]]) == pytest.approx(2 / 3)


def test_sentences_keep_citations_written_after_the_full_stop():
    assert split_sentences("A was born in X. [1] She played the harp [2]. Done.") == \
        ["A was born in X [1].", "She played the harp [2].", "Done."]


WORLD_PEOPLE = [
    {"id": "person-1", "type": "person", "name": "Ada Quill", "birthplace": "Rixgard", "birth_year": "1789",
     "occupation": "mason", "employer": "Teshe Works", "instrument": "flute", "passage_ids": ["w1", "w2"]},
    {"id": "person-2", "type": "person", "name": "Bo Reed", "birthplace": "Fustgard", "birth_year": "1937",
     "occupation": "brewer", "employer": "Gygroul Mills", "instrument": "harp", "passage_ids": ["w3"]},
    {"id": "place-1", "type": "place", "name": "Rixgard"},
]
WORLD_PASSAGES = [
    {"id": "w1", "title": "Ada Quill", "text": "Ada Quill, a mason, was born in Rixgard. She liked maps."},
    {"id": "w2", "title": "Ada Quill", "text": "She played the flute. Quill was born in 1789."},
    {"id": "w3", "title": "Bo Reed", "text": "Bo Reed was born in Fustgard. He played the harp."},
]


@pytest.fixture()
def world(tmp_path):
    for name, rows in (("entities", WORLD_PEOPLE), ("passages", WORLD_PASSAGES)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_world_judge_and_alce_citation_precision_recall(world):
    judge = WorldJudge.from_world(world)
    w1, w2, w3 = WORLD_PASSAGES
    assert judge.entails("Title: Ada Quill\n" + w1["text"], "Ada Quill, a mason, was born in Rixgard.")
    assert not judge.entails("Title: Ada Quill\n" + w1["text"], "She played the flute.")  # not in that passage
    assert not judge.entails("Title: Bo Reed\n" + w3["text"], "Ada Quill played the harp.")  # another person
    assert not judge.entails("Title: Ada Quill\n" + w1["text"], "She was kind.")  # no checkable fact
    out = ("Ada Quill, a mason, was born in Rixgard [1]. She played the flute [1][2]. "
           "She was born in 1789 [3]. She was kind [1]. Bo Reed played the harp [4].")
    scores = citation_scores([out], [[w1, w2, w3]], judge)
    # recall: sentences 1 and 2 entailed of 5; precision: s1 [1] ok, s2 [2] needed but [1] over-cites,
    # s3 [3] wrong, s4 unsupported, s5 out of range (not counted) -> 2 of 5 citations
    assert (scores.recall, scores.precision, scores.sentences) == (pytest.approx(2 / 5), pytest.approx(2 / 5), 5)


def test_eval_command_on_world_files(world, tmp_path, capsys):
    gold = [{"id": "a", "question": "Q?", "answers": ["Rixgard"]}, {"id": "b", "question": "Q?", "answers": ["1937"]}]
    preds = [{"id": "b", "prediction": "1937.", "retrieved": True}, {"id": "a", "prediction": "rixgard", "retrieved": False}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gold))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    assert main(["eval", "--task", "world_qa", "--predictions", str(tmp_path / "p.jsonl"),
                 "--input", str(tmp_path / "in.jsonl"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["n"], got["match"], got["em"], got["retrieval_frequency"]) == (2, 0.5, 1.0, 0.5)

    longform = [{"id": "l", "prediction": "Ada Quill, a mason, was born in Rixgard. [1] She played the flute. [2]",
                 "retrieved": True, "docs": WORLD_PASSAGES[:2]}]
    (tmp_path / "l.jsonl").write_text(json.dumps(longform[0]) + "\n")
    (tmp_path / "lg.jsonl").write_text(json.dumps({"id": "l", "answers": ["mason", "Rixgard", "1789"]}) + "\n")
    assert main(["eval", "--task", "world_longform", "--predictions", str(tmp_path / "l.jsonl"), "--input",
                 str(tmp_path / "lg.jsonl"), "--world", str(world), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["str_em"] == pytest.approx(2 / 3) and got["citation_recall"] == 1.0 and got["citation_precision"] == 1.0
    assert main(["eval", "--task", "world_qa", "--predictions", str(tmp_path / "p.jsonl")]) == 0  # no gold: 0s
    assert "match" in capsys.readouterr().out


def test_eval_tasks_apply_their_gold_rules():
    res, _ = evaluate("world_unanswerable", [{"prediction": "I don't know.", "retrieved": True}], [{"answers": []}])
    assert res["match"] == 1.0
    res, _ = evaluate("pubhealth", [{"prediction": "true"}, {"prediction": "SUPPORTS"}],
                      [{"answers": ["SUPPORTS"]}, {"answers": ["true"]}])
    assert res["match"] == 1.0 and res["retrieval_frequency"] is None
    res, _ = evaluate("arc_c", [{"prediction": "A: Because"}], [{"answerKey": "B", "choices": {}}])
    assert (res["match"], res["choice_accuracy"]) == (1.0, 0.0)
    asqa = {"output": "Built in 1889 [1].", "docs": [], "qa_pairs": [{"short_answers": ["1889"]}, {"short_answers": ["x"]}]}
    res, _ = evaluate("asqa", [asqa])
    assert res["str_em"] == 0.5 and res["str_em_hit"] == 0.0


def test_eval_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prediction": "x"}\n{"prediction": "y"}\n')
    (tmp_path / "in.jsonl").write_text('{"answers": ["x"]}\n')
    assert main(["eval", "--task", "popqa", "--predictions", str(tmp_path / "p.jsonl"),
                 "--input", str(tmp_path / "in.jsonl")]) == 2
    assert "2 predictions but 1 input records" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"prediction": "x"}\n{oops\n')
    assert main(["eval", "--task", "popqa", "--predictions", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
