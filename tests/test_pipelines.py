"""Baselines, honest refusal, corrective re-retrieval, the run report and `compare`.

Refusal and re-retrieval are first checked on hand-made score arrays, then end to end on
tiny Llamas whose critique tokens are *forced*: a few hidden dimensions that no layer
writes to carry a signal from chosen input tokens straight to chosen lm_head rows, so
`</paragraph>` is always followed by `[Relevant]` (or `[Irrelevant]`), then a word, then
an IsSup token, then a Utility token that ends the segment.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_hf_llama, make_tokenizer
from test_inference import FakeRetriever, make_items, make_selfrag_model

from selfrag_jax import tokens as T
from selfrag_jax.cli import main
from selfrag_jax.inference import corrective, scoring
from selfrag_jax.evaluation.compare import PipelineSpec
from selfrag_jax.inference.corrective import CorrectiveOptions
from selfrag_jax.inference.engine import ControlIds, Engine
from selfrag_jax.inference.items import parse_item
from selfrag_jax.inference.report import quality_report
from selfrag_jax.world.judges import WorldFactJudge
from selfrag_jax.inference.scoring import RefuseOptions, RetrieveOptions
from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
from selfrag_jax.models.checkpoint import load_model
from selfrag_jax.tokenizer import SelfRAGTokenizer
from selfrag_jax.world.tasks import REFUSAL

MAX_NEW = 8
ALWAYS = RetrieveOptions(mode="always")
BAR = RefuseOptions(enabled=True, rel_threshold=0.5, sup_threshold=0.5)


# --- hand-made scores ---------------------------------------------------------------------
def test_support_bar_needs_a_supported_label_and_both_thresholds():
    rel = np.array([0.9, 0.9, 0.9, 0.4, 0.9, 0.9])
    sup = np.array([0.8, 0.8, 0.3, 0.8, 0.8, 0.0])
    label = np.array([0, 2, 1, 0, 1, -1])  # Fully, No support, Partially, Fully, Partially, none
    scores = np.full(6, np.nan)  # passages given without retriever scores
    use = np.full(6, -1.0)  # no utility bar by default (-inf)
    assert scoring.passes_bar(rel, sup, use, label, scores, BAR).tolist() == [True, False, False, False, True, False]
    assert not scoring.passes_bar(np.array([0.5]), np.array([0.9]), use[:1], np.array([0]), scores[:1], BAR).any()  # strictly above


def test_retriever_floor_refuses_low_scoring_passages_and_passes_unscored_ones():
    rel, sup, label = np.full(4, 0.9), np.full(4, 0.8), np.zeros(4, int)
    scores = np.array([0.7, 0.4, np.nan, 0.45])
    use = np.ones(4)
    floor = RefuseOptions(enabled=True, rel_threshold=0.5, sup_threshold=0.5, ret_threshold=0.45)
    assert scoring.passes_bar(rel, sup, use, label, scores, floor).tolist() == [True, False, True, False]
    assert scoring.passes_bar(rel, sup, use, label, scores, BAR).all()  # no floor by default (-inf)
    assert scoring.refusal_reason(rel[1:2], sup[1:2], use[1:2], label[1:2], scores[1:2], floor).startswith(
        "every passage scored low by the retriever (max 0.400 <= 0.45)")


def test_utility_bar_refuses_answers_rated_unhelpful():
    """A relevant, supported candidate whose IsUse says it answers another question is held back
    by a utility bar, with or without IsSup consulted."""
    rel, sup, label, scores = np.full(3, 0.9), np.full(3, 0.8), np.zeros(3, int), np.full(3, np.nan)
    use = np.array([0.9, -0.5, 0.0])
    for issup in (True, False):
        bar = RefuseOptions(enabled=True, rel_threshold=0.5, sup_threshold=0.5, issup=issup, use_threshold=0.0)
        assert scoring.passes_bar(rel, sup, use, label, scores, bar).tolist() == [True, False, False]
        assert scoring.refusal_reason(rel[1:], sup[1:], use[1:], label[1:], scores[1:], bar).startswith(
            "every answer judged unhelpful (max use 0.000 <= 0.0)")


def test_combined_bar_weighs_the_signals_together():
    """A learned bar passes a candidate when bias + weights . (features - centers) is above 0: a
    well retrieved answer rated a little unhelpful passes, a poorly retrieved one needs a better
    rating; a passage without a retriever score sits at the center. Thresholds are ignored."""
    from selfrag_jax.inference.scoring import BAR_FEATURES, Combination

    weights = dict.fromkeys(BAR_FEATURES, 0.0) | {"ret_score": 10.0, "use": 2.0}
    centers = dict.fromkeys(BAR_FEATURES, 0.0) | {"ret_score": 0.5}
    comb = Combination.from_json({"bias": 0.0, "weights": weights, "centers": centers})
    opts = RefuseOptions(enabled=True, rel_threshold=0.999, combination=comb)
    rel, sup, label, seq = np.full(4, 0.9), np.full(4, 0.5), np.zeros(4, int), np.zeros(4)
    retrieve, cover = np.log(np.full((4, 3), 1 / 3)), np.full(4, np.nan)
    ret, use = np.array([0.6, 0.45, 0.45, np.nan]), np.array([-0.4, 0.3, 0.2, 0.1])
    features = scoring.bar_features(rel, sup, use, ret, seq, retrieve, cover, cover)
    # 1.0 - 0.8, -0.5 + 0.6, -0.5 + 0.4, 0 + 0.2
    assert scoring.passes_bar(rel, sup, use, label, ret, opts, features).tolist() == [True, True, False, True]
    assert Combination.from_json(comb.to_json()) == comb
    features = scoring.bar_features(np.array([0.5, 1.0]), sup[:2], use[:2], ret[:2], np.array([-0.5, -50.0]),
                                    retrieve[:2], np.array([0.5, 1.0]), np.array([0.25, 1.0]))
    assert features[:, 0] == pytest.approx([0.0, np.log((1 - 1e-6) / 1e-6)]) and features[:, 4].tolist() == [-0.5, -10.0]
    assert features[:, 5] == pytest.approx([0.0, 0.0])  # p(Retrieval) = p(No Retrieval): log-odds 0
    assert features[:, 6].tolist() == [0.5, 1.0] and features[:, 7].tolist() == [0.25, 1.0]
    with pytest.raises(ValueError, match="needs the candidates' bar_features"):
        scoring.passes_bar(rel, sup, use, label, ret, opts)
    assert scoring.refusal_reason(rel, sup, use, label, ret, opts).startswith("no answer passed the learned bar")
    # a --cache folder's meta keeps it as decoding.json does, and gives it back
    from dataclasses import replace

    from selfrag_jax.inference.cache import SweepCache, options_json
    from selfrag_jax.inference.selfrag import GenerateOptions

    generate = GenerateOptions(refuse=opts)
    meta = json.loads(json.dumps({"options": options_json(generate)}))
    assert meta["options"]["refuse"]["combination"] == comb.to_json()
    assert SweepCache(meta, [], {}).refuse_options() == opts
    assert SweepCache({"options": options_json(replace(generate, refuse=BAR))}, [], {}).refuse_options() == BAR
    with pytest.raises(ValueError, match="missing 'seq'"):
        Combination.from_json({"bias": 0.0, "weights": {k: 1.0 for k in BAR_FEATURES if k != "seq"}, "centers": centers})
    with pytest.raises(ValueError, match="finite numbers"):
        Combination.from_json({"bias": float("nan"), "weights": weights, "centers": centers})


def test_coverage_is_the_share_of_the_question_the_passage_mentions():
    """Names: the question's capitalised words (question words aside); words: all of them; a
    possessive 's and case do not matter; the title counts; none of them: NaN (unknown)."""
    passage = {"title": "Fubo Skokro", "text": "In his spare time he played the drum. Skokro was born in 1929."}
    assert scoring.coverage("Where was Fubo Skokro born?", passage) == (1.0, 1.0)
    assert scoring.coverage("What instrument did Fubo Greimuski play?", passage) == (0.5, 0.25)
    names, words = scoring.coverage("What was fubo skokro's height?", passage)
    assert np.isnan(names) and words == 2 / 3  # no capitals: its names unknown
    assert all(np.isnan(scoring.coverage("Who?", passage)))
    assert all(np.isnan(scoring.coverage("Where was Fubo born?", None)))


@pytest.mark.parametrize("rel,sup,label,reason", [
    ([], [], [], "no passages were found"),
    ([0.2, 0.4], [0.9, 0.9], [0, 0], "every passage judged irrelevant (max rel 0.400"),
    ([0.9, 0.7], [0.9, 0.0], [2, -1], "no candidate judged supported"),
    ([0.9, 0.7], [0.3, 0.5], [0, 1], "support too weak (max sup 0.500"),
    ([0.9, 0.2], [0.2, 0.9], [0, 0], "no candidate is both relevant and supported"),
])
def test_refusal_reason_names_what_failed(rel, sup, label, reason):
    args = [np.array(x, float) for x in (rel, sup)] + [np.ones(len(rel)), np.array(label, int), np.full(len(rel), 0.5)]
    assert not scoring.passes_bar(*args, BAR).any()
    assert scoring.refusal_reason(*args, BAR).startswith(reason)


def test_corrective_helpers():
    assert corrective.all_irrelevant(np.array([0.1, 0.49]), 0.5)
    assert not corrective.all_irrelevant(np.array([0.1, 0.5]), 0.5)
    assert not corrective.all_irrelevant(np.array([]), 0.5)
    assert [corrective.round_k(5, r) for r in (1, 2, 3)] == [5, 10, 20]
    q = "Where was Alice Mbeki born, in Lurvik?"
    assert corrective.keywords(q) == ["Alice", "Mbeki", "Lurvik"]
    assert corrective.rewrite_query(q, "Oslo", "question") == q
    assert corrective.rewrite_query(q, "Oslo", "keywords") == f"{q} Alice Mbeki Lurvik"
    assert corrective.rewrite_query(q, "Oslo", "answer") == f"{q} Alice Mbeki Lurvik Oslo"
    assert corrective.fit_budget([10, 10, 10], 25) == 2 and corrective.fit_budget([30], 25) == 0
    with pytest.raises(ValueError, match="query"):
        CorrectiveOptions(query="hyde")


def test_pipeline_names_of_compare():
    assert PipelineSpec.parse("selfrag+refuse+crag") == PipelineSpec("selfrag+refuse+crag", "selfrag", True, True)
    assert PipelineSpec.parse("naive").pipeline == "naive"
    assert PipelineSpec.parse("selfrag+keep2").keep_top == 2 and PipelineSpec.parse("selfrag").keep_top is None
    for bad in ("naive+refuse", "selfrag+magic", "rag", "selfrag+keep0", "selfrag+keep2+keep3", "top1+keep1"):
        with pytest.raises(ValueError):
            PipelineSpec.parse(bad)


def test_quality_report_and_world_judge(tmp_path):
    (tmp_path / "entities.jsonl").write_text(
        json.dumps({"id": "e1", "name": "Ada Lin", "birthplace": "Lurvik", "passage_ids": ["w1"]}) + "\n")
    judge = WorldFactJudge.from_world(tmp_path)
    meta = {"meta": {"attributes": ["birthplace"]}}
    inputs = [{"answers": ["Lurvik"], **meta}, {"answers": ["Oslo"], **meta}, {"answers": [], "answerable": False},
              {"answers": ["Lurvik"], **meta}]
    good = {"id": "w1", "title": "Ada Lin", "text": "Ada Lin was born in Lurvik."}
    silent = {"id": "w1", "title": "Ada Lin", "text": "Ada Lin kept a garden."}

    def rec(pred, psg=None, refused=False):
        return {"prediction": pred, "refused": refused, "chosen": 0 if psg else None,
                "candidates": [{"passage": psg}] if psg else []}

    records = [rec("In Lurvik.", good), rec("lurvik", silent), rec(REFUSAL, refused=True), rec(REFUSAL, refused=True)]
    q = quality_report(inputs, records, judge)
    assert q["accuracy"] == pytest.approx(1 / 3) and q["n_graded"] == 3  # case-sensitive substring
    assert q["refusal_accuracy"] == pytest.approx(3 / 4)  # the last refusal was not needed
    assert q["refusal_rate_unanswerable"] == 1.0 and q["refusal_rate_answerable"] == pytest.approx(1 / 3)
    assert q["faithfulness"] == 0.5 and q["n_judged"] == 2  # the value must be written in the passage too
    # the generator writing the refusal itself is a refusal too (whatever the message is)
    records[2] = rec(REFUSAL.lower())
    assert quality_report(inputs, records, judge)["refusal_rate_unanswerable"] == 1.0
    assert quality_report(inputs, records, judge, refusal_message="No answer.")["refusal_rate_unanswerable"] == 0.0


# --- the same engine running the baselines -------------------------------------------------
@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    folder = make_selfrag_model(tmp_path_factory.mktemp("pipelines") / "hf", seed=2)
    config, params, tok, _ = load_model(folder)
    return folder, Engine(params, config, ControlIds.from_tokenizer(tok), MAX_NEW), tok


def run_pipeline(engine, tok, items, retrieve_fn=None, **kw):
    sf = ShortForm(engine, tok, GenerateOptions(trace=True, **kw), retrieve_fn)
    return [sf.record(r) for r in sf.run(items)]


def test_baseline_prompts_are_exactly_as_specified(random_model):
    _, engine, tok = random_model
    items = make_items(3, seed=11, k=4, p_words=(3, 8))  # all three passages fit the tiny model
    ret, no_ret = tok.control_id(T.RETRIEVAL), tok.control_id(T.NO_RETRIEVAL)
    for pipeline in ("naive", "top1", "none"):
        for item, rec in zip(items, run_pipeline(engine, tok, items, pipeline=pipeline, ndocs=3)):
            prompt = tok.encode_prompt(item.instruction)
            assert rec["prompt_token_ids"] == prompt and rec["pipeline"] == pipeline
            ctxs = item.ctxs[:3]
            if pipeline == "none":
                assert not rec["retrieved"] and rec["candidates"] == [] and rec["chosen"] is None
                assert rec["no_retrieval"]["prompt_token_ids"] == prompt + [no_ret]
                assert rec["prediction"] == rec["no_retrieval"]["text"]
                continue
            assert rec["retrieved"] and rec["chosen"] == 0 and len(rec["candidates"]) == 1
            cand = rec["candidates"][0]
            if pipeline == "top1":
                expected = prompt + tok.encode_passage(ctxs[0]["title"], ctxs[0]["text"])
            else:
                expected = prompt + [ret] + sum((tok.encode_passage(c["title"], c["text"], retrieval_token=False)
                                                 for c in ctxs), [])
                assert [p["id"] for p in cand["passages"]] == [c["id"] for c in ctxs]
            assert cand["prompt_token_ids"] == expected and cand["passage"]["id"] == ctxs[0]["id"]
            assert rec["prediction"] == cand["text"] == tok.decode(cand["token_ids"], skip_control=True).strip()
    # top1 decodes exactly Self-RAG's first candidate row
    selfrag = run_pipeline(engine, tok, items, ndocs=3, retrieve=ALWAYS)
    top1 = run_pipeline(engine, tok, items, pipeline="top1", ndocs=3)
    assert [r["candidates"][0]["token_ids"] for r in selfrag] == [r["candidates"][0]["token_ids"] for r in top1]


def test_naive_cuts_passages_from_the_end(random_model):
    _, engine, tok = random_model
    long = " ".join(["fox jumps over the dog"] * 60)
    item = parse_item(json.dumps({"question": "where?", "ctxs": [{"title": "a", "text": "short one"},
                                                                   {"title": "b", "text": long},
                                                                   {"title": "c", "text": "never fits"}]}), "t:1")
    cand = run_pipeline(engine, tok, [item], pipeline="naive", ndocs=3)[0]["candidates"][0]
    ids = cand["prompt_token_ids"]
    assert len(ids) + MAX_NEW == engine.config.max_position_embeddings and cand["passage_tokens_dropped"] > 0
    assert ids.count(tok.control_id(T.PARAGRAPH_OPEN)) == 2  # the third passage had no room left
    assert ids[-1] == tok.control_id(T.PARAGRAPH_CLOSE)


# --- forced critique tokens ------------------------------------------------------------------
def make_forced_model(folder, links: list[tuple[str, str]]):
    """A tiny Llama where input token a is always followed by token b, for each (a, b).

    Hidden dimension d (one per link) is zeroed in every embedding but a's and in every
    o_proj/down_proj row, so only a's position carries it to the final norm; lm_head row b
    reads it with a large weight."""
    from safetensors.numpy import load_file, save_file

    tok = SelfRAGTokenizer(make_tokenizer(folder, vocab_size=300))
    make_hf_llama(folder, seed=1, vocab_size=len(tok))
    tok.save(folder)
    w = load_file(folder / "model.safetensors")
    ids = {name: (tok.control_id(name) if name in T.CONTROL_TOKENS else tok.encode_text(name)[0]) for pair in links
           for name in pair}
    assert all(name in T.CONTROL_TOKENS or tok.encode_text(name) == [i] for name, i in ids.items())
    dims = list(range(len(links)))
    w["model.embed_tokens.weight"][:, dims] = 0.0
    for name, t in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[dims] = 0.0
    for d, (a, b) in enumerate(links):
        w["model.embed_tokens.weight"][ids[a], d] = 1.0
        w["lm_head.weight"][ids[b], d] = 50.0
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config, params, tok, _ = load_model(folder)
    return Engine(params, config, ControlIds.from_tokenizer(tok), MAX_NEW), tok


WORD_TOKEN, WORD = " born", "born"  # one token of the test tokenizer


@pytest.fixture(scope="module")
def supported_model(tmp_path_factory):
    return make_forced_model(tmp_path_factory.mktemp("forced") / "sup", [
        (T.PARAGRAPH_CLOSE, T.RELEVANT), (T.RELEVANT, WORD_TOKEN), (WORD_TOKEN, T.FULLY_SUPPORTED),
        (T.FULLY_SUPPORTED, "[Utility:5]")])


@pytest.fixture(scope="module")
def irrelevant_model(tmp_path_factory):
    return make_forced_model(tmp_path_factory.mktemp("forced") / "irr", [
        (T.PARAGRAPH_CLOSE, T.IRRELEVANT), (T.IRRELEVANT, WORD_TOKEN), (WORD_TOKEN, T.NO_SUPPORT),
        (T.NO_SUPPORT, "[Utility:1]")])


def test_forced_models_emit_the_chain(supported_model, irrelevant_model):
    for (engine, tok), first, sup in ((supported_model, T.RELEVANT, T.FULLY_SUPPORTED),
                                      (irrelevant_model, T.IRRELEVANT, T.NO_SUPPORT)):
        rec = run_pipeline(engine, tok, make_items(3, seed=4, k=3), retrieve=ALWAYS, ndocs=3)[0]  # shapes reused below
        ids = rec["candidates"][0]["token_ids"]
        assert ids[0] == tok.control_id(first) and ids[2] == tok.control_id(sup) and len(ids) == 4
        assert rec["candidates"][0]["text"] == WORD


def test_refusal_triggers_exactly_when_no_candidate_passes(supported_model, irrelevant_model):
    items = make_items(3, seed=4, k=3)
    engine, tok = irrelevant_model
    for rec in run_pipeline(engine, tok, items, retrieve=ALWAYS, ndocs=3, refuse=BAR):
        assert rec["refused"] and rec["prediction"] == REFUSAL and rec["chosen"] is None
        assert rec["refusal_reason"].startswith("every passage judged irrelevant")
    custom = RefuseOptions(True, 0.5, 0.5, "No idea.")
    assert {r["prediction"] for r in run_pipeline(engine, tok, items, retrieve=ALWAYS, refuse=custom)} == {"No idea."}
    plain = run_pipeline(engine, tok, items, retrieve=ALWAYS, ndocs=3)
    assert not any(r["refused"] for r in plain) and {r["prediction"] for r in plain} == {WORD}

    engine, tok = supported_model
    recs = run_pipeline(engine, tok, items, retrieve=ALWAYS, ndocs=3, refuse=BAR)
    for rec in recs:
        c = rec["candidates"][rec["chosen"]]["scores"]
        assert not rec["refused"] and rec["refusal_reason"] is None and rec["prediction"] == WORD
        assert c["rel"] > 0.99 and c["sup"] > 0.99
    too_strict = RefuseOptions(True, 0.5, 1.0)  # sup can never exceed 1
    for rec in run_pipeline(engine, tok, items, retrieve=ALWAYS, ndocs=3, refuse=too_strict):
        assert rec["refused"] and rec["refusal_reason"].startswith("support too weak")
    never = run_pipeline(engine, tok, items, retrieve=RetrieveOptions(mode="never"), refuse=BAR)
    assert not any(r["refused"] for r in never)  # a question the model answers without evidence


def test_corrective_round_runs_only_when_all_passages_are_irrelevant(supported_model, irrelevant_model):
    items = make_items(2, seed=6, k=2)
    crag = CorrectiveOptions(max_rounds=3, rel_threshold=0.5, token_budget=10_000)
    engine, tok = supported_model
    fake = FakeRetriever()
    for rec in run_pipeline(engine, tok, items, fake, retrieve=ALWAYS, ndocs=2, corrective=crag):
        assert [r["round"] for r in rec["rounds"]] == [1] and rec["rounds"][0]["max_rel"] > 0.99
        assert len(rec["candidates"]) == 2
    assert fake.queries == []

    engine, tok = irrelevant_model
    for rec, item in zip(run_pipeline(engine, tok, items, fake, retrieve=ALWAYS, ndocs=2, corrective=crag), items):
        rounds = rec["rounds"]
        assert [r["round"] for r in rounds] == [1, 2, 3] and [r["k"] for r in rounds] == [2, 4, 8]
        assert rounds[0]["source"] == "ctxs" and rounds[0]["query"] is None
        assert rounds[1]["source"] == "retriever" and rounds[1]["query"] == corrective.rewrite_query(
            item.question, WORD, "keywords")
        ids = [p for r in rounds for p in r["passages"]]
        assert len(ids) == len(set(ids)) == 6 and all(r["max_rel"] < 0.01 for r in rounds)
        assert [c["passage"]["id"] for c in rec["candidates"]] == ids
        assert rec["retry_tokens"] == sum(len(c["prompt_token_ids"]) - len(rec["prompt_token_ids"])
                                          + len(c["token_ids"]) for c in rec["candidates"][2:])
    assert len(fake.queries) == 4  # two questions x two extra rounds, nothing more (max rounds)


def test_corrective_rounds_respect_the_token_budget_and_fall_back_to_later_ctxs(irrelevant_model):
    engine, tok = irrelevant_model
    items = make_items(2, seed=8, k=5)
    one_row = len(tok.encode_passage(items[0].ctxs[2]["title"], items[0].ctxs[2]["text"])) + MAX_NEW
    crag = CorrectiveOptions(max_rounds=4, token_budget=one_row)
    rec = run_pipeline(engine, tok, items[:1], retrieve=ALWAYS, ndocs=2, corrective=crag)[0]
    assert [r["passages"] for r in rec["rounds"]] == [["p0.0", "p0.1"], ["p0.2"]]  # later ctxs, within budget
    assert rec["retry_stopped"] == "token budget" and rec["retry_tokens"] <= one_row
    rec = run_pipeline(engine, tok, items[1:], retrieve=ALWAYS, ndocs=2,
                       corrective=CorrectiveOptions(max_rounds=4))[0]
    assert [r["passages"] for r in rec["rounds"]] == [["p1.0", "p1.1"], ["p1.2", "p1.3"], ["p1.4"]]
    assert rec["retry_stopped"] == "no new passages"


# --- generate, its report, and compare -------------------------------------------------------
REPORT_KEYS = {"pipeline", "n", "retrieval_rate", "retry_rate", "refusal_rate", "latency_s", "latency_method",
               "tokens", "seconds", "accuracy", "refusal_accuracy", "faithfulness"}


def write_input(path, items, extra=()):
    lines = [json.dumps({**it.record, "answers": [WORD]}) for it in items] + [json.dumps(e) for e in extra]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("pipeline", ["selfrag", "naive", "top1", "none"])
def test_each_pipeline_runs_through_generate(random_model, tmp_path, capsys, pipeline):
    folder = random_model[0]
    src = write_input(tmp_path / "in.jsonl", make_items(3, seed=9, k=5))
    out = tmp_path / "out.jsonl"
    flags = ["--max-rounds", "2", "--crag-rel-threshold", "1.01"] if pipeline == "selfrag" else []
    rc = main(["generate", "--model", str(folder), "--input", str(src), "--output", str(out), "--ndocs", "3",
               "--max-new-tokens", str(MAX_NEW), "--pipeline", pipeline, "--batch-size", "2", *flags])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["0", "1", "2"]
    for rec in records:
        assert {"id", "question", "prediction", "retrieved", "p_retrieve", "candidates", "chosen"} <= set(rec)
        assert rec["pipeline"] == pipeline and len(rec["candidates"]) == {"none": 0, "naive": 1, "top1": 1}.get(
            pipeline, len(rec["candidates"]))
        for cand in rec["candidates"]:
            assert set(cand["scores"]) == {"seq", "rel", "sup", "use", "ret", "final"}
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert REPORT_KEYS <= set(report) and report["n"] == 3 and report["pipeline"] == pipeline
    assert set(report["latency_s"]) == {"p50", "p95", "mean"} and report["latency_s"]["p95"] > 0
    assert report["tokens"]["total"] == report["tokens"]["prefill"] + report["tokens"]["decode"] > 0
    assert report["retrieval_rate"] == {"none": 0.0, "naive": 1.0, "top1": 1.0}.get(pipeline, report["retrieval_rate"])
    if pipeline == "selfrag":  # refusal is on for --task open; rel < 1.01 always, so every retrieval retried
        assert all("refused" in r and r["rounds"] for r in records if r["retrieved"])
        assert report["retry_rate"] == report["retrieval_rate"]
    assert "retrieval_rate" in capsys.readouterr().out


def test_compare_runs_two_pipelines_side_by_side(random_model, tmp_path, capsys):
    folder = random_model[0]
    (tmp_path / "world").mkdir()
    (tmp_path / "world" / "entities.jsonl").write_text("")
    unanswerable = {"id": "u", "question": "who is nobody?", "answers": [], "answerable": False,
                    "ctxs": [{"id": "x", "title": "x", "text": "nothing here"}]}
    src = write_input(tmp_path / "in.jsonl", make_items(3, seed=10, k=2), [unanswerable])
    out = tmp_path / "cmp.json"
    rc = main(["compare", "--pipelines", "selfrag+refuse,naive", "--input", str(src), "--model", str(folder),
               "--ndocs", "2", "--max-new-tokens", str(MAX_NEW), "--world", str(tmp_path / "world"),
               "--out", str(out), "--predictions-dir", str(tmp_path / "preds"), "--no-warmup"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert list(result["pipelines"]) == ["selfrag+refuse", "naive"] and result["n"] == 4
    for name, rep in result["pipelines"].items():
        assert REPORT_KEYS <= set(rep) and rep["n_graded"] == 3 and rep["refusal_accuracy"] is not None
        assert len((tmp_path / "preds" / f"{name}.jsonl").read_text().splitlines()) == 4
    assert result["pipelines"]["naive"]["refusal_rate"] == 0.0
    table = capsys.readouterr().out
    assert "selfrag+refuse" in table and "latency_p95_s" in table and "refusal_accuracy" in table
