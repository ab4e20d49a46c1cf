"""`selfrag-jax generate` end to end: output format, --cache chosen again, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_inference import make_items, make_selfrag_model

from selfrag_jax.cli import main
from selfrag_jax.inference.cache import load_cache, predictions
from selfrag_jax.inference.candidates import ChoiceOptions, choose
from selfrag_jax.inference.scoring import RetrieveOptions

KEYS = {"id", "question", "prediction", "retrieved", "p_retrieve", "candidates", "chosen"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_selfrag_model(tmp_path_factory.mktemp("cli") / "hf", seed=4)


def write_input(path, items):
    path.write_text("".join(json.dumps(it.record) + "\n" for it in items))
    return path


def test_generate_writes_records_and_a_cache_that_chooses_the_same(model_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", make_items(5, seed=7, k=3))
    out, cache = tmp_path / "out.jsonl", tmp_path / "cache"
    rc = main(["generate", "--model", str(model_dir), "--input", str(src), "--output", str(out), "--ndocs", "3",
               "--max-new-tokens", "8", "--threshold", "0.5", "--trace", "--cache", str(cache)])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [str(i) for i in range(5)]  # input order
    for rec in records:
        assert KEYS <= set(rec) and 0 <= rec["p_retrieve"] <= 1
        assert len(rec["candidates"]) == 3 and "token_ids" in rec["no_retrieval"]
        for cand in rec["candidates"]:
            assert set(cand["scores"]) == {"seq", "rel", "sup", "use", "ret", "final"}
            assert {"prompt_token_ids", "token_ids"} <= set(cand) and set(cand["passage"]) == {"id", "title", "text"}

    data = load_cache(cache)
    assert data.meta["n_questions"] == 5 and data.meta["n_candidates"] == 15
    assert data.arrays["c_sup_probs"].shape == (15, 3) and data.arrays["c_use_probs"].shape == (15, 5)
    table, refuse = data.table(), data.refuse_options()
    assert refuse.enabled  # --task open: refusal on by default, and the cache says so
    same = choose(table, ChoiceOptions(retrieve=RetrieveOptions(threshold=0.5), refuse=refuse))
    assert list(zip(predictions(data, same), same.retrieved.tolist(), [same.index(q) for q in range(5)])) == \
        [(r["prediction"], r["retrieved"], r["chosen"]) for r in records]
    np.testing.assert_allclose(data.arrays["c_seq"], [c["scores"]["seq"] for r in records for c in r["candidates"]],
                               atol=1e-6)
    assert choose(table, ChoiceOptions(retrieve=RetrieveOptions(mode="always"))).retrieved.all()
    assert not choose(table, ChoiceOptions(retrieve=RetrieveOptions(mode="never"))).retrieved.any()


@pytest.mark.parametrize("lines,message", [
    (['{"question": "a?"}', '{"question": '], "in.jsonl:2: malformed JSON"),
    (['{"question": "a?"}', '', '{"answers": ["x"]}'], "in.jsonl:3: record has no 'question' or 'instruction'"),
    (['{"question": "a?", "ctxs": "nope"}'], "in.jsonl:1: 'ctxs' must be a list"),
])
def test_bad_input_fails_with_file_and_line(model_dir, tmp_path, capsys, lines, message):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.jsonl*"))


@pytest.mark.parametrize("flags,message", [
    (["--pipeline", "naive", "--refuse"], "--refuse and --max-rounds judge with reflection scores"),
    (["--pipeline", "top1", "--max-rounds", "2"], "--refuse and --max-rounds judge with reflection scores"),
    (["--long-form", "--refuse"], "short-form options"),
    (["--max-rounds", "0"], "--max-rounds must be at least 1"),
    (["--pipeline", "none", "--cache", "c"], "--cache is for --pipeline selfrag"),
])
def test_inconsistent_options_fail_in_one_line(model_dir, tmp_path, capsys, flags, message):
    (tmp_path / "in.jsonl").write_text('{"question": "a?"}\n')
    rc = main(["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "o.jsonl"), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1


def test_missing_passages_without_a_retriever_fail_naming_the_record(model_dir, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"question": "a?"}\n{"question": "b?"}\n')
    rc = main(["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "o.jsonl"), "--mode", "always", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "in.jsonl:1: no 'ctxs' and no retriever" in err


@pytest.mark.parametrize("task, refuse", [("open", True), ("popqa", False), ("triviaqa", False), ("fever", False)])
def test_paper_tasks_keep_the_papers_defaults(task, refuse):
    """Refusal (this project's addition) is on by default only for `open`; --refuse turns it on anywhere."""
    import argparse

    from selfrag_jax.inference.cli import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", "m", "--input", "i", "--output", "o", "--task", task]
    opts = options_from_args(parser.parse_args(base))
    assert opts.refuse.enabled == refuse
    assert opts.score.w_ret == 0.0 and opts.corrective.max_rounds == 1
    assert options_from_args(parser.parse_args(base + ["--refuse"])).refuse.enabled


def test_settings_text_keeps_each_grid_column_on_one_line():
    from selfrag_jax.inference.settings import settings_text

    info = {"ndocs": 2, "refuse": {"rel_threshold": 0.9, "ret_threshold": None,
                                   "dev_grid": {"rel": [0.5, 0.9] * 500, "issup": [True, False] * 500, "ret": [None, 0.5] * 500}},
            "runs": [{"k": 1}, {"k": 2}]}
    text = settings_text(info)
    assert json.loads(text) == info and text.endswith("}\n")
    assert len(text.splitlines()) < 25 and '"rel": [0.5, 0.9, 0.5' in text


def test_refusal_bar_comes_from_the_models_decoding_json_unless_given(tmp_path):
    """`--refuse` without a bar uses the one chosen on dev data for these models: decoding.json
    in the generator's folder or its models folder; flags win; a bad file is named."""
    import argparse
    import json

    from selfrag_jax.inference.cli import add_arguments, options_from_args
    from selfrag_jax.inference.scoring import RefuseOptions

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    generator = tmp_path / "models" / "generator"
    generator.mkdir(parents=True)

    def bar(*flags):
        refuse = options_from_args(parser.parse_args(["--model", str(generator), "--input", "i", "--output", "o",
                                                      *flags])).refuse
        return refuse.rel_threshold, refuse.sup_threshold, refuse.issup, refuse.ret_threshold, refuse.use_threshold

    default = RefuseOptions()
    inf = float("-inf")
    assert bar() == (default.rel_threshold, default.sup_threshold, True, inf, inf)  # no decoding.json: the option's default
    (tmp_path / "models" / "decoding.json").write_text(json.dumps({"ndocs": 2}))
    assert bar() == (default.rel_threshold, default.sup_threshold, True, inf, inf)  # a depth only
    (tmp_path / "models" / "decoding.json").write_text(json.dumps({"ndocs": 2, "refuse": {"rel_threshold": 0.97,
                                                                                           "sup_threshold": 0.8}}))
    assert bar() == (0.97, 0.8, True, inf, inf)
    assert bar("--refuse-rel-threshold", "0.5", "--refuse-issup", "off") == (0.5, 0.8, False, inf, inf)
    (generator / "decoding.json").write_text(json.dumps({"refuse": {"rel_threshold": 0.9, "sup_threshold": 0.0,
                                                                    "issup": False, "ret_threshold": 0.52,
                                                                    "use_threshold": 0.25}}))
    assert bar() == (0.9, 0.0, False, 0.52, 0.25)  # the generator's own file first
    assert bar("--refuse-ret-threshold=-inf", "--refuse-use-threshold", "0.5") == (0.9, 0.0, False, inf, 0.5)
    # a learned combination is the bar; any threshold given replaces it
    from selfrag_jax.inference.scoring import BAR_FEATURES

    learned = {"bias": -1.0, "weights": dict.fromkeys(BAR_FEATURES, 0.5), "centers": dict.fromkeys(BAR_FEATURES, 0.0)}
    (generator / "decoding.json").write_text(json.dumps({"refuse": {"rel_threshold": 0.9, "sup_threshold": 0.0,
                                                                    "combination": learned}}))
    refuse = lambda *flags: options_from_args(parser.parse_args(  # noqa: E731
        ["--model", str(generator), "--input", "i", "--output", "o", *flags])).refuse
    assert refuse().combination.to_json() == learned
    assert refuse("--refuse-rel-threshold", "0.5").combination is None
    (generator / "decoding.json").write_text(json.dumps({"refuse": {"rel_threshold": 0.9, "sup_threshold": 0.0,
                                                                    "combination": {"bias": 1.0}}}))
    with pytest.raises(ValueError, match=r"generator/decoding.json: 'refuse.combination': .*missing 'weights'"):
        bar()
    (generator / "decoding.json").write_text(json.dumps({"refuse": {"rel_threshold": "high"}}))
    with pytest.raises(ValueError, match=r"generator/decoding.json: 'refuse' needs numbers"):
        bar()
    (generator / "decoding.json").write_text(json.dumps({"refuse": {"rel_threshold": 0.9, "sup_threshold": 0.0,
                                                                    "ret_threshold": "low"}}))
    with pytest.raises(ValueError, match=r"'refuse.ret_threshold' must be a number or null"):
        bar()
    (generator / "decoding.json").write_text(json.dumps({"refuse": {"rel_threshold": 0.9, "sup_threshold": 0.0,
                                                                    "use_threshold": True}}))
    with pytest.raises(ValueError, match=r"'refuse.use_threshold' must be a number or null"):
        bar()
