"""Self-RAG decisions and scores on hand-made arrays, against docs/method.md section 5."""

from __future__ import annotations

import numpy as np
import pytest

from selfrag_jax.inference import scoring
from selfrag_jax.inference.scoring import RetrieveOptions, ScoreOptions

# log p of (No Retrieval, Retrieval, Continue) for three contexts
P = np.array([[0.6, 0.3, 0.1], [0.1, 0.85, 0.05], [0.5, 0.05, 0.45]])
LP = np.log(P)
GREEDY_RETRIEVAL = np.array([False, True, False])


def test_paper_rule_is_a_ratio_of_probabilities():
    expected = P[:, 1] / (P[:, 1] + P[:, 0])
    np.testing.assert_allclose(scoring.paper_ratio(LP), expected)
    got = scoring.decide_retrieve(LP, GREEDY_RETRIEVAL, RetrieveOptions(threshold=0.2))
    assert got.tolist() == (expected > 0.2).tolist() == [True, True, False]


def test_released_rule_is_a_ratio_of_raw_log_probabilities():
    expected = LP[:, 1] / (LP[:, 1] + LP[:, 0])
    np.testing.assert_allclose(scoring.released_ratio(LP), expected)
    got = scoring.decide_retrieve(LP, GREEDY_RETRIEVAL, RetrieveOptions(threshold=0.5, rule="released"))
    assert got.tolist() == (expected > 0.5).tolist()
    # a confident [Retrieval] has log p near 0, so the released ratio is *small* there
    assert scoring.released_ratio(LP)[1] < 0.1 < scoring.paper_ratio(LP)[1]


@pytest.mark.parametrize("mode,expected", [("always", [True] * 3), ("never", [False] * 3),
                                           ("hard", [False, True, False])])
def test_modes(mode, expected):
    assert scoring.decide_retrieve(LP, GREEDY_RETRIEVAL, RetrieveOptions(mode=mode)).tolist() == expected


def test_threshold_zero_means_always_under_the_paper_rule():
    assert scoring.decide_retrieve(LP, GREEDY_RETRIEVAL, RetrieveOptions(threshold=0.0)).all()


def test_bad_options_fail():
    with pytest.raises(ValueError, match="mode"):
        RetrieveOptions(mode="sometimes")
    with pytest.raises(ValueError, match="rule"):
        RetrieveOptions(rule="mine")


def test_critique_scores():
    rel = scoring.rel_score(np.array([[0.1, 0.3], [0.02, 0.0]]))
    np.testing.assert_allclose(rel, [0.75, 0.0])
    sup_p = np.array([[0.2, 0.2, 0.1], [0.5, 0.2, 0.3], [0.9, 0.0, 0.0]])
    sup = scoring.sup_score(sup_p, np.array([True, True, False]))
    np.testing.assert_allclose(sup, [(0.2 + 0.1) / 0.5, (0.5 + 0.1) / 1.0, 0.0])
    use_p = np.array([[0.1, 0.1, 0.2, 0.2, 0.4], [0.5, 0.0, 0.0, 0.0, 0.0]])
    use = scoring.use_score(use_p, np.array([True, True]))
    np.testing.assert_allclose(use, [(-0.1 - 0.05 + 0 + 0.1 + 0.4) / 1.0, -1.0])
    assert scoring.use_score(use_p, np.array([False, False])).tolist() == [0.0, 0.0]


def test_final_score_weights_and_sequence_score():
    seq, rel, sup, use = np.array([-0.5]), np.array([0.8]), np.array([0.6]), np.array([0.4])
    paper = scoring.final_score(seq, rel, sup, use, ScoreOptions())
    np.testing.assert_allclose(paper, np.exp(-0.5) + 0.8 + 0.6 + 0.5 * 0.4)
    released = scoring.final_score(seq, rel, sup, use, ScoreOptions(w_use=1.0, seqscore=False))
    np.testing.assert_allclose(released, 0.8 + 0.6 + 0.4)


def test_retriever_prior_is_a_softmax_of_the_scores_weighted_into_the_final_score():
    s = np.array([0.62, 0.55, 0.40])
    p = scoring.retriever_prob(s, 0.05)
    np.testing.assert_allclose(p, np.exp(s / 0.05) / np.exp(s / 0.05).sum(), rtol=1e-12)
    np.testing.assert_allclose(scoring.retriever_prob(s, 1e4), [1 / 3] * 3, rtol=1e-4)  # flat when hot
    # a candidate without a score (NaN, or inf from a bad file): no prior for the question at all
    assert scoring.retriever_prob([0.6, np.nan], 0.05).tolist() == [0.0, 0.0]
    assert scoring.retriever_prob([0.6, np.inf], 0.05).tolist() == [0.0, 0.0]
    assert scoring.retriever_prob([], 0.05).shape == (0,)
    seq, rel, sup, use = np.zeros(3), np.ones(3), np.ones(3), np.zeros(3)
    np.testing.assert_allclose(scoring.final_score(seq, rel, sup, use, ScoreOptions(w_ret=0.5), p), 1 + 2 + 0.5 * p)
    np.testing.assert_allclose(scoring.final_score(seq, rel, sup, use, ScoreOptions(), p), [3.0] * 3)  # paper: none
    with pytest.raises(ValueError, match="ret_temperature"):
        ScoreOptions(ret_temperature=0.0)


def test_passages_keep_a_numeric_retriever_score():
    from selfrag_jax.inference.items import passage

    assert passage({"id": "a", "title": "t", "text": "x", "score": 0.5}, "f")["score"] == 0.5
    assert passage({"title": "t", "text": "x", "score": "1.6427"}, "f") == {"id": "f", "title": "t", "text": "x",
                                                                             "score": 1.6427}  # released ctxs
    for bad in ("high", True, None, [1]):
        assert "score" not in passage({"text": "x", "score": bad}, "f")
    assert np.isnan(scoring.passage_score(None)) and np.isnan(scoring.passage_score({"text": "x"}))


def one_question(texts, finals, task="open", rel_label=None, sup_label=None):
    """A one-question table whose candidates' final scores are `finals` under ScoreOptions(w_use=0,
    seqscore=False, w_sup=0): rel carries the score."""
    from selfrag_jax.inference.candidates import Row, Table

    n = len(texts)
    rel_label = [1] * n if rel_label is None else rel_label
    sup_label = [0] * n if sup_label is None else sup_label
    rows = [Row([], {"id": str(i), "title": "", "text": ""}, text=t, rel_probs=np.array([1 - f, f]),
                sup_probs=np.eye(3)[max(s, 0)] if s >= 0 else np.zeros(3), sup_found=s >= 0, rel_label=r)
            for i, (t, f, r, s) in enumerate(zip(texts, finals, rel_label, sup_label))]
    return Table.from_rows([rows], task, np.log(np.array([[0.1, 0.8, 0.1]])), [True])


def chosen(table, task="open", hard="none", **refuse):
    from selfrag_jax.inference.candidates import ChoiceOptions, choose
    from selfrag_jax.inference.scoring import RefuseOptions

    opts = ChoiceOptions(task=task, score=ScoreOptions(w_sup=0.0, w_use=0.0, seqscore=False, hard=hard),
                         refuse=RefuseOptions(**refuse))
    return choose(table, opts).index(0)


def test_hard_constraints():
    table = one_question(["a", "b", "c", "d"], [0.2, 0.9, 0.5, 0.1],
                         rel_label=[1, 0, 1, -1], sup_label=[0, 0, 2, -1])  # b: Irrelevant, c: No support
    assert chosen(table) == 1
    assert chosen(table, hard="irrelevant") == 2
    assert chosen(table, hard="no_support") == 1
    assert chosen(table, hard="both") == 0
    assert scoring.Hard.of(True, True) == scoring.Hard.BOTH and ScoreOptions(hard="both").hard.drops_irrelevant
    with pytest.raises(ValueError, match="hard constraint"):
        ScoreOptions(hard="sometimes")


def test_open_task_takes_the_best_candidate_and_constraints_can_drop_all():
    assert chosen(one_question(["a", "b", "c"], [0.2, 0.9, 0.5])) == 1
    assert chosen(one_question(["a", "b", "c"], [0.2, 0.9, 0.5], rel_label=[1, 0, 1]), hard="irrelevant") == 2
    assert chosen(one_question(["a", "b", "c"], [0.2, 0.9, 0.5], rel_label=[0, 0, 0]), hard="irrelevant") is None
    assert chosen(one_question(["a", "b", "c"], [0.9, 0.9, 0.5])) == 0  # ties: the first


def test_closed_set_sums_final_scores_per_normalised_answer():
    texts = ["True", "false.", "It is true", "False", "FALSE"]
    finals = [0.9, 0.4, 0.3, 0.35, 0.3]  # true: 1.2, false: 1.05
    assert chosen(one_question(texts, finals, "fever"), "fever") == 0  # best candidate of the winning answer
    finals = [0.9, 0.5, 0.2, 0.4, 0.4]  # true 1.1, false 1.3: the sum wins over the single best
    c = chosen(one_question(texts, finals, "pubhealth"), "pubhealth")
    assert scoring.answer_group(texts[c], "pubhealth") == "false" and c == 1
    assert chosen(one_question(texts, finals, "open")) == 0
    arc = ["B", "A: the sun", "(B) water", "b"]
    assert scoring.answer_group(arc[1], "arc_c") == "A"
    assert chosen(one_question(arc, [0.5, 0.9, 0.3, 0.2], "arc_c"), "arc_c") == 0
    # equal totals: the answer whose first candidate comes first wins
    assert chosen(one_question(["A", "B", "B"], [0.5, 0.25, 0.25], "arc_c"), "arc_c") == 0
    assert chosen(one_question(["B", "A", "B"], [0.25, 0.5, 0.25], "arc_c"), "arc_c") == 0
    assert scoring.answer_group("REFUTES", "fever") == "false"


def test_refusal_and_its_reason():
    from selfrag_jax.inference.candidates import ChoiceOptions, choose
    from selfrag_jax.inference.scoring import RefuseOptions

    table = one_question(["a", "b"], [0.9, 0.3], sup_label=[2, 0])  # a: No support; b: supported but rel 0.3
    opts = ChoiceOptions(refuse=RefuseOptions(enabled=True))
    got = choose(table, opts)
    assert got.refused.tolist() == [True] and got.index(0) is None
    assert got.reasons[0] == "no candidate is both relevant and supported"
    assert chosen(table, enabled=True, rel_threshold=0.2) == 1
