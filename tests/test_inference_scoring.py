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
    released = scoring.final_score(seq, rel, sup, use, ScoreOptions(w_use=1.0, use_seqscore=False))
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


def test_hard_constraints():
    rel_label = np.array([1, 0, 1, -1])  # Relevant, Irrelevant, Relevant, none
    sup_label = np.array([0, 0, 2, -1])  # Fully, Fully, No support, none
    assert scoring.allowed(rel_label, sup_label, ScoreOptions()).tolist() == [True] * 4
    assert scoring.allowed(rel_label, sup_label, ScoreOptions(drop_irrelevant=True)).tolist() == [True, False, True, True]
    assert scoring.allowed(rel_label, sup_label, ScoreOptions(drop_no_support=True)).tolist() == [True, True, False, True]


def test_open_task_takes_the_best_candidate_and_constraints_can_drop_all():
    finals = np.array([0.2, 0.9, 0.5])
    assert scoring.choose(["a", "b", "c"], finals, np.ones(3, bool)) == 1
    assert scoring.choose(["a", "b", "c"], finals, np.array([True, False, True])) == 2
    assert scoring.choose(["a", "b", "c"], finals, np.zeros(3, bool)) is None


def test_closed_set_sums_final_scores_per_normalised_answer():
    texts = ["True", "false.", "It is true", "False", "FALSE"]
    finals = np.array([0.9, 0.4, 0.3, 0.35, 0.3])  # true: 1.2, false: 1.05
    chosen = scoring.choose(texts, finals, np.ones(5, bool), task="fever")
    assert chosen == 0  # best candidate of the winning answer
    finals = np.array([0.9, 0.5, 0.2, 0.4, 0.4])  # true 1.1, false 1.3: the sum wins over the single best
    assert scoring.normalise_answer(texts[scoring.choose(texts, finals, np.ones(5, bool), task="pubhealth")], "pubhealth") == "false"
    assert scoring.choose(texts, finals, np.ones(5, bool), task="open") == 0
    arc = ["B", "A: the sun", "(B) water", "b"]
    assert scoring.normalise_answer(arc[1], "arc_c") == "A"
    assert scoring.choose(arc, np.array([0.5, 0.9, 0.3, 0.2]), np.ones(4, bool), task="arc_c") == 0
    assert scoring.normalise_answer("REFUTES", "fever") == "false"
