"""`sweep`: grid parsing, the vectorised re-ranking against `candidates.choose` (open and
closed-set tasks, constraints, both threshold rules, refusal) and against `generate` run with
the same flags on a tiny random model, sharding over several devices, and the command's outputs."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from test_inference import make_items, make_selfrag_model

from selfrag_jax.cli import main
from selfrag_jax.evaluation import sweep as S
from selfrag_jax.metrics import match
from selfrag_jax.evaluation.synthetic import synthetic_cache
from selfrag_jax.inference.cache import load_cache, predictions
from selfrag_jax.inference.candidates import choose

GRID = ("mode=adaptive|always|hard,rule=paper|released,threshold=0|0.3|0.9,seqscore=on|off,"
        "hard=none|no_support|irrelevant|both,ndocs=0|1|3,w_rel=0:2:2,w_sup=0|1.5,w_use=-1|0.5,w_ret=0|2,"
        "ret_temperature=0.05|0.3,refuse=off|on,refuse_rel_threshold=0.3|0.6,refuse_issup=on|off,"
        "refuse_ret_threshold=-inf|0.5,refuse_use_threshold=-inf|0.2")


def choose_one(cache, config):
    """`candidates.choose` (numpy, one setting) on the cache's table, and the predictions."""
    choice = choose(cache.table(), config.options(cache.task, cache.refuse_options().message))
    return choice, predictions(cache, choice)


def test_grid_spec_and_file(tmp_path):
    grid = S.parse_grid("w_rel=0:2:5,threshold=0:1:3,rule=paper|released,seqscore=off")
    assert grid["w_rel"] == [0.0, 0.5, 1.0, 1.5, 2.0] and grid["threshold"] == [0.0, 0.5, 1.0]
    assert grid["rule"] == ["paper", "released"] and grid["seqscore"] == ["off"] and grid["w_use"] == [0.5]
    assert len(S.expand(grid)) == 5 * 3 * 2
    (tmp_path / "g.yaml").write_text("w_sup: 0:1:3\nhard: [none, both]\nseqscore: false\n")
    grid = S.parse_grid(str(tmp_path / "g.yaml"))
    assert grid["w_sup"] == [0.0, 0.5, 1.0] and grid["hard"] == ["none", "both"] and grid["seqscore"] == ["off"]
    assert S.parse_grid("ndocs=1:5:5")["ndocs"] == [1, 2, 3, 4, 5] and S.parse_grid("ndocs=2|4")["ndocs"] == [2, 4]
    assert S.parse_grid("refuse=on|off")["refuse"] == ["on", "off"] and S.parse_grid("hard=both")["hard"] == ["both"]
    for bad in ("w_rel=a:b:c", "colour=red", "rule=mine", "w_sup", "ret_temperature=0|0.1", "ndocs=1.5", "ndocs=-1",
                "refuse=maybe"):
        with pytest.raises(ValueError, match="grid"):
            S.parse_grid(bad)


@pytest.mark.parametrize("task", ["open", "arc_c", "pubhealth"])
def test_sweep_chooses_what_choose_chooses(task):
    cache = synthetic_cache(200, k=5, task=task, seed=3)
    configs = S.expand(S.parse_grid(GRID))
    result = S.run_sweep(S.prepare(cache), configs, with_choices=True, chunk=96)
    rng = np.random.default_rng(0)
    gold = S._gold_rule(task)
    for g in rng.choice(len(configs), 40, replace=False):
        choice, texts = choose_one(cache, configs[g])
        assert result.chosen[g].tolist() == choice.chosen.tolist(), configs[g]
        assert result.retrieved[g].tolist() == choice.retrieved.tolist()
        assert result.refused[g].tolist() == choice.refused.tolist()
        expected = np.mean([match(text, gold(line)) for text, line in zip(texts, cache.questions)])
        assert result.metric[g] == pytest.approx(expected, abs=1e-6)
        assert result.retrieval_frequency[g] == pytest.approx(choice.retrieved.mean(), abs=1e-6)
        assert result.refusal_rate[g] == pytest.approx(choice.refused.mean(), abs=1e-6)
    assert result.refusal_rate.max() > 0 and result.refusal_rate.min() == 0  # refusal is a dimension


def test_sweep_is_the_same_on_one_device_and_sharded():
    import jax

    prep = S.prepare(synthetic_cache(64, k=4, task="arc_c", seed=5))
    configs = S.expand(S.parse_grid("w_sup=0:2:7,threshold=0:1:5,hard=none|both"))
    many = S.run_sweep(prep, configs, with_choices=True)
    one = S.run_sweep(prep, configs, with_choices=True, devices=jax.local_devices()[:1], chunk=16)
    assert many.devices == len(jax.local_devices()) and one.devices == 1
    np.testing.assert_array_equal(many.chosen, one.chosen)
    np.testing.assert_allclose(many.metric, one.metric, atol=1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_selfrag_model(tmp_path_factory.mktemp("sweep") / "hf", seed=4)


def test_sweep_matches_generate_run_with_those_flags(model_dir, tmp_path):
    items = make_items(6, seed=11, k=3, scored=True)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({**it.record, "answers": [it.question.split()[0]]}) + "\n" for it in items))
    base = ["generate", "--model", str(model_dir), "--input", str(src), "--ndocs", "3", "--max-new-tokens", "8"]
    assert main(base + ["--output", str(tmp_path / "cached.jsonl"), "--cache", str(tmp_path / "cache")]) == 0
    configs = [S.Config(), S.Config(rule="released", threshold=0.5, w_use=-1.0),
               S.Config(mode="always", seqscore="off", w_sup=2.0), S.Config(threshold=0.0, hard="both", w_rel=0.0),
               S.Config(mode="hard", hard="no_support", w_use=1.0, w_rel=2.0),
               S.Config(mode="always", w_ret=3.0, ret_temperature=0.1), S.Config(w_ret=1.0, hard="irrelevant"),
               S.Config(mode="always", ndocs=2, w_ret=3.0), S.Config(mode="always", ndocs=1, seqscore="off"),
               S.Config(mode="always", refuse="on"), S.Config(refuse="on", refuse_rel_threshold=0.45, hard="both"),
               S.Config(mode="always", refuse="on", refuse_sup_threshold=0.0, refuse_rel_threshold=0.0),
               S.Config(refuse="on", refuse_issup="off", refuse_rel_threshold=0.45),
               S.Config(mode="always", refuse="on", refuse_issup="off", refuse_rel_threshold=0.0, refuse_ret_threshold=0.5),
               S.Config(mode="always", refuse="on", refuse_issup="off", refuse_rel_threshold=0.0, refuse_use_threshold=0.2)]
    result = S.run_sweep(S.prepare(load_cache(tmp_path / "cache")), configs, with_choices=True)
    cache = load_cache(tmp_path / "cache")
    for g, cfg in enumerate(configs):
        out = tmp_path / f"gen{g}.jsonl"
        assert main(base + ["--output", str(out)] + cfg.generate_flags()) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["retrieved"] for r in records] == result.retrieved[g].tolist(), cfg
        assert [-1 if r["chosen"] is None else r["chosen"] for r in records] == result.chosen[g].tolist(), cfg
        assert [r["refused"] for r in records] == result.refused[g].tolist(), cfg
        choice, texts = choose_one(cache, cfg)
        assert [r["prediction"] for r in records] == texts, cfg
        assert [r["refusal_reason"] for r in records] == choice.reasons, cfg


def test_sweep_command_writes_csv_summary_and_plots(tmp_path, capsys):
    from selfrag_jax.inference.cache import write_cache  # noqa: F401  (the schema synthetic_cache follows)

    cache = synthetic_cache(50, k=4, task="open", seed=2)
    folder = tmp_path / "cache"
    folder.mkdir()
    np.savez(folder / "arrays.npz", **cache.arrays)
    (folder / "index.jsonl").write_text("".join(json.dumps(q) + "\n" for q in cache.questions))
    (folder / "meta.json").write_text(json.dumps(cache.meta))
    out = tmp_path / "out"
    assert main(["sweep", "--cache", str(folder), "--out", str(out),
                 "--grid", "w_sup=0:2:5,threshold=0:1:6,rule=paper|released,hard=none|no_support,ndocs=2|0"]) == 0
    assert "240 configurations x 50 questions" in capsys.readouterr().out
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert len(rows) == 240 and {"w_sup", "threshold", "rule", "metric", "retrieval_frequency"} <= set(rows[0])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["configurations"] == 240 and summary["best"]["metric"] == max(float(r["metric"]) for r in rows)
    assert all((out / f"{name}.png").stat().st_size > 1000 for name in ("w_sup", "threshold", "ndocs"))
    assert main(["sweep", "--cache", str(folder), "--out", str(tmp_path / "x"), "--grid", "w_sup=oops"]) == 2
    assert not (tmp_path / "x").exists()


def test_a_cache_without_retriever_scores_has_no_prior():
    """Caches written before `c_ret_score` choose and sweep as the paper's score at any w_ret."""
    cache = synthetic_cache(40, k=4, task="open", seed=9)
    with_scores = choose_one(cache, S.Config(w_ret=5.0))[0].chosen
    del cache.arrays["c_ret_score"]
    paper = choose_one(cache, S.Config())[0].chosen
    assert choose_one(cache, S.Config(w_ret=5.0))[0].chosen.tolist() == paper.tolist()
    assert with_scores.tolist() != paper.tolist()  # the scores did matter
    result = S.run_sweep(S.prepare(cache), [S.Config(), S.Config(w_ret=5.0)], with_choices=True)
    np.testing.assert_array_equal(result.chosen[0], result.chosen[1])


def test_depth_refuses_a_corrective_cache():
    """Corrective re-retrieval appends later rounds' passages: the first K are not the top K."""
    cache = synthetic_cache(10, k=4, task="open", seed=1)
    cache.meta["options"] = {"corrective": {"enabled": True}}
    S.run_sweep(S.prepare(cache), [S.Config()])  # every candidate: fine
    with pytest.raises(ValueError, match="ndocs cannot re-rank"):
        S.run_sweep(S.prepare(cache), [S.Config(ndocs=2)])
