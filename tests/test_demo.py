"""The demo's machinery end to end (a fast variant): world, index, four settings, critic
agreement, report files. Uses tiny random models and a tiny random encoder, so it checks
the plumbing, not the numbers (those come from the shipped models' report)."""

from __future__ import annotations

import json

import pytest
from test_retrieval_support import make_tiny_bert

from selfrag_jax.cli import main
from selfrag_jax.demo.demo import SETTINGS, TASKS
from selfrag_jax.world.kb import ATTRIBUTES


def demo_inputs(tmp_path):
    """A test world (its world stage marked done), random tiny generator and critic in
    `tmp_path/models`, a tiny random encoder: (work folder, models folder, encoder folder)."""
    from helpers import build_test_world

    from selfrag_jax.models.config import preset
    from selfrag_jax.models.hf import export_hf
    from selfrag_jax.models.llama import init_params
    from selfrag_jax.tokenizer import SelfRAGTokenizer

    work, models = tmp_path / "work", tmp_path / "models"
    build_test_world(work / "world")
    (work / "world.done").write_text("{}")
    tok = SelfRAGTokenizer.from_pretrained(work / "world" / "tokenizer")
    tok.save(tmp_path / "tok")
    config = preset("tiny", vocab_size=len(tok), eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
    for seed, name in enumerate(("generator", "critic")):
        export_hf(init_params(config, seed), config, models / name, tokenizer_dir=tmp_path / "tok")
    return work, models, make_tiny_bert(tmp_path / "bert")


def test_demo_models_pair(tmp_path, capsys):
    from pathlib import Path

    from selfrag_jax.demo.demo import Models

    assert Models.of(Path("m")) == Models(Path("m/generator"), Path("m/critic"), Path("m"))
    assert Models.of(Path("m"), "g.gguf") == Models(Path("g.gguf"), Path("m/critic"), Path("g.gguf"))  # its own depth
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--models", str(tmp_path), "--critic", "c"]) == 2
    assert "no generator" in capsys.readouterr().err and not (tmp_path / "w").exists()


@pytest.mark.slow
def test_demo_fast_variant(tmp_path, capsys):
    work, _, encoder = demo_inputs(tmp_path)
    models = tmp_path / "models"  # named one by one: `demo --generator --critic` evaluates any pair
    rc = main(["demo", "--workdir", str(work), "--models", str(tmp_path / "nowhere"), "--generator",
               str(models / "generator"), "--critic", str(models / "critic"), "--encoder", str(encoder),
               "--limit", "4", "--batch-size", "4"])
    assert rc == 0
    report = json.loads((work / "report.json").read_text())
    assert report["models"] == {"generator": str(models / "generator"), "critic": str(models / "critic")}
    assert set(report["tasks"]) == set(TASKS)
    for rows in report["tasks"].values():
        assert set(rows) == set(SETTINGS)
        for row in rows.values():
            assert row["n"] == 4 and 0 <= row["accuracy"] <= 1 and 0 <= row["retrieval_frequency"] <= 1
        assert rows["always_top1"]["retrieval_frequency"] == 1 and rows["no_retrieval"]["retrieval_frequency"] == 0
    assert report["gold_passage"]["n"] == 4 and 0 <= report["gold_passage"]["accuracy"] <= 1
    assert set(report["gold_passage"]["by_attribute"]) <= set(ATTRIBUTES) and report["gold_passage"]["by_attribute"]
    # the reading ceiling gives each question exactly its gold passage, and nothing else
    gold = [json.loads(line)["meta"]["gold_passage_ids"]
            for line in (work / "world" / "eval" / "world_qa.jsonl").read_text().splitlines()[:4]]
    rows = [json.loads(line) for line in (work / "shipped" / "predictions" / "world_qa.gold_passage.jsonl").read_text().splitlines()]
    assert [[c["passage"]["id"] for c in r["candidates"]] for r in rows] == [ids[:1] for ids in gold]
    # the retriever-prior setting re-chooses among Self-RAG's own candidates, never decodes again
    pred = {s: [json.loads(line) for line in (work / "shipped" / "predictions" / f"world_qa.{s}.jsonl").read_text().splitlines()]
            for s in ("selfrag", "selfrag_ret")}
    assert [[c["text"] for c in r["candidates"]] for r in pred["selfrag"]] == \
        [[c["text"] for c in r["candidates"]] for r in pred["selfrag_ret"]]
    assert all(c["passage"]["score"] is not None and c["scores"]["ret"] >= 0 for r in pred["selfrag_ret"] for c in r["candidates"])
    assert set(report["distractor_top1"]) == {"selfrag", "selfrag_ret", "always_top1"}
    assert set(report["critic_agreement"]) == {"retrieve_input", "retrieve_sentence", "isrel", "issup", "isuse"}
    assert report["seconds"] > 0
    assert (work / "report.md").read_text().startswith("# Self-RAG demo")
    assert (work / "accuracy.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "A traced example" in out and "selfrag_no_issup" in out and "reading ceiling" in out
    assert report["ndocs"] == 5 and report["depth"] is None  # no decoding.json: the paper's depth

    # the depth stage: its dev numbers are the released match of each depth's choice, by `choose`
    from selfrag_jax.demo.decoding import choose_depth
    from selfrag_jax.metrics import match
    from selfrag_jax.inference.cache import load_cache, predictions
    from selfrag_jax.inference.candidates import ChoiceOptions, choose

    info = choose_depth(tmp_path / "models" / "generator", work / "world", work / "index", tmp_path / "depth",
                        n=4, batch_size=3, log=lambda m: None)
    cache = load_cache(tmp_path / "depth")
    assert len(cache.questions) == 4 and cache.questions[0]["id"].startswith("world_dev_")
    for k, value in info["dev_match"].items():
        texts = predictions(cache, choose(cache.table(), ChoiceOptions(ndocs=int(k))))
        assert value == pytest.approx(sum(match(t, q["answers"]) for t, q in zip(texts, cache.questions)) / 4, abs=1e-4)
    assert info["dev_match"][str(info["ndocs"])] == max(info["dev_match"].values())

    from selfrag_jax.demo.probe import RELEVANCE_FORMS, reading_accuracy, reading_prompts, relevance_accuracy

    prompts, closed, answers = reading_prompts(work / "world", n=3)
    assert len(prompts) == 3 and all(p.endswith("\nAnswer: ") and "\n\nQuestion: " in p for p in prompts)
    assert all(a and isinstance(a[0], str) for a in answers)
    assert all(c.startswith("Question: ") and p.endswith(c) for c, p in zip(closed, prompts))
    probe = reading_accuracy(tmp_path / "models" / "generator", work / "world", n=4, batch_size=3)
    assert probe["n"] == 4 and 0 <= probe["with_passage"] <= 1 and 0 <= probe["closed_book"] <= 1
    *_, attributes = reading_prompts(work / "world", n=4, with_attributes=True)
    assert set(probe["by_attribute"]) == set(attributes) and attributes[0] in ATTRIBUTES
    counts = {a: attributes.count(a) for a in attributes}  # the overall rate is the questions' mean of the parts
    assert abs(sum(probe["by_attribute"][a] * c for a, c in counts.items()) / 4 - probe["with_passage"]) < 1e-9
    rel = relevance_accuracy(tmp_path / "models" / "generator", work / "world", n=4, batch_size=3)
    assert rel["n"] == 4 and set(rel) == {"n", *RELEVANCE_FORMS}
    for form in RELEVANCE_FORMS:
        assert all(0 <= rel[form][k] <= 1 for k in ("answered_own", "refused_own", "refused_lookalike", "refused_lacking",
                                                    "refusal_auc"))


def test_refusal_auc_reads_the_next_token():
    """The AUC is the pairwise rate with ties at half, and the log-probabilities it ranks are the
    model's own next-token ones at each prompt's last real position, whatever the padding."""
    import jax
    import numpy as np

    from selfrag_jax.bundled import ASSETS
    from selfrag_jax.demo.probe import auc, next_token_logprobs, probe_model
    from selfrag_jax.models.llama import Llama

    assert auc([0, 1], [2, 3]) == 1.0 and auc([2, 3], [0, 1]) == 0.0 and auc([1, 1], [1, 1]) == 0.5
    assert auc([0, 2], [1]) == 0.5 and np.isnan(auc([], [1]))
    model = probe_model(ASSETS / "critic")
    config, params, tok = model
    prompts = ["Question: Who was Trouzy Rawyth?\nAnswer: ", "Hi"]
    got = next_token_logprobs(model, prompts, 5, batch_size=2)
    for p, g in zip(prompts, got):  # each alone, unpadded
        ids = np.asarray([[tok.bos_id, *tok.encode_text(p)]])
        want = jax.nn.log_softmax(Llama(config).apply({"params": params}, ids)[0][0, -1].astype("float32"))[5]
        assert abs(float(want) - float(g)) < 1e-3


def test_pipeline_stage_configs_chain(tmp_path):
    """`make train-default` reads each stage's paths from its config: every run, init_from,
    tokenizer and data file lands under the pipeline's folder, and each stage starts from the
    one before it."""
    from selfrag_jax.demo.pipeline import Stages

    stages = Stages(tmp_path, budget="reduced")
    cfgs = {name: stages.config(name) for name in ("base", "anneal", "anneal2", "critic", "generator")}
    for name, cfg in cfgs.items():
        assert cfg.run_dir == str(tmp_path / name)
        assert all(f.startswith(str(tmp_path) + "/") for f in cfg.data.train_files), (name, cfg.data.train_files)
    assert cfgs["base"].model.tokenizer == str(tmp_path / "world" / "tokenizer")
    chain = {"anneal": "base", "anneal2": "anneal", "critic": "anneal2", "generator": "anneal2"}
    assert {n: cfgs[n].model.init_from for n in chain} == {n: str(tmp_path / b) for n, b in chain.items()}
    assert cfgs["generator"].data.train_files == [str(tmp_path / "annotated.jsonl")]
    assert cfgs["anneal2"].data.train_files[1] == str(tmp_path / "world" / "relevance_forms.jsonl")
    assert cfgs["critic"].num_steps == 150  # the reduced budget
    full = Stages(tmp_path, budget="full").config("base")  # the configs as they are: the shipped models
    assert (full.optim.schedule, full.num_steps, full.optim.schedule_steps) == ("cosine", 3500, 0)
    assert cfgs["base"].num_steps == 1800 and cfgs["base"].optim.schedule_steps == full.num_steps  # a prefix of it
    assert (full.optim.b2, cfgs["base"].optim.b2) == (0.999, 0.95)  # only the reduced base changes Adam's b2
    # and only the reduced base reads the repeat documents, its WORLD placeholder filled in
    assert cfgs["base"].data.train_files == [str(tmp_path / "world" / f) for f in ("pretrain.jsonl", "repeat.jsonl")]
    assert (cfgs["base"].data.mixture_rates, full.data.train_files) == ({"repeat": 0.25}, cfgs["base"].data.train_files[:1])
    # heads of 32 in the reduced base, the shipped models' 16 in the full one (base.yaml names it)
    assert (full.model.overrides["head_dim"], cfgs["base"].model.overrides["head_dim"]) == (16, 32)
    assert stages.config("base", ["num_steps=7"]).num_steps == 7  # a caller's override wins over the budget
    assert stages.config("critic", ["optim.learning_rate=3e-4"]).optim.learning_rate == 3e-4


def test_pipeline_reading_and_isuse_critic_stages(tmp_path):
    """The full budget continues the critic on the reading-form data, then on the same data with
    IsUse drawn more often, and ships and annotates with that last critic; the reduced budget
    skips both stages and uses the critic as it is."""
    from selfrag_jax.demo.pipeline import Stages

    full = Stages(tmp_path, budget="full")
    cfg = full.config("critic_reading")
    assert cfg.model.init_from == str(tmp_path / "critic") and cfg.run_dir == str(tmp_path / "critic_reading")
    assert cfg.data.train_files == [str(tmp_path / "world" / "train" / "critic_reading.jsonl")]
    assert cfg.data.mixture_rates == {**full.config("critic").data.mixture_rates, "isuse": 3}
    assert (cfg.num_steps, cfg.optim.learning_rate) == (300, 5e-4)
    isuse = full.config("critic_isuse")
    assert isuse.model.init_from == str(tmp_path / "critic_reading") and isuse.run_dir == str(tmp_path / "critic_isuse")
    assert isuse.data.train_files == cfg.data.train_files and isuse.data.mixture_rates["isuse"] == 8
    assert full.critic_dir == tmp_path / "critic_isuse" and not full.skips("critic_reading")
    reduced, said = Stages(tmp_path, budget="reduced", log=lambda m: said.append(m)), []
    assert reduced.skips("critic_reading") and reduced.skips("critic_isuse") and reduced.critic_dir == tmp_path / "critic"
    reduced.stage("critic_reading", lambda: pytest.fail("a skipped stage ran"))
    assert said == ["[critic_reading] skipped by the reduced budget"] and not reduced.done("critic_reading")


def test_pipeline_does_not_export_a_base_that_did_not_learn_to_read(tmp_path, monkeypatch):
    """A full run whose base reads below MIN_BASE_READING warns with the way to draw again and
    leaves the shipped models alone unless forced; --seed reaches the base stage only."""
    from selfrag_jax.demo import pipeline

    exported = []
    monkeypatch.setattr(pipeline.Stages, "export", lambda self: exported.append(self.out) or {})
    for reads, force, ships in ((0.6, False, False), (0.6, True, True), (pipeline.MIN_BASE_READING, False, True)):
        out, said = tmp_path / f"{reads}-{force}", []
        out.mkdir()
        stages = pipeline.Stages(out, log=said.append, base_seed=4)
        for name in ("world", "index", "practice_index", "base", "anneal", "anneal2", "critic", "critic_reading",
                     "critic_isuse", "annotate", "generator", "depth", "refusal"):
            stages.mark(name, {})
        stages.mark("base_reading", {"with_passage": reads})
        stages.run_all(force_export=force)
        assert (exported[-1:] == [out]) == ships, (reads, force, said)
        warned = [m for m in said if "WARNING" in m]
        assert bool(warned) == (reads < pipeline.MIN_BASE_READING)
        assert not warned or "--seed 5" in warned[0] and "0.60" in warned[0]
        assert any("[export] skipped" in m for m in said) == (not ships)
    reduced = pipeline.Stages(tmp_path / "r", budget="reduced", base_seed=4)
    assert reduced.config("base").seed == 4 and reduced.config("anneal").seed == 0
    assert reduced.base_reads() is None  # not probed yet


def test_pipeline_budget_placeholder(tmp_path, monkeypatch):
    """`{config_steps}` is the stage YAML's num_steps; a stage counted in epochs has none, which
    is an error, and other braces (a YAML mapping) pass through untouched."""
    from selfrag_jax.demo import pipeline

    monkeypatch.setitem(pipeline.BUDGETS, "t", {"critic": ["optim.schedule_steps={config_steps}"],
                                                 "base": ["data.mixture_rates={a: 2}"]})
    stages = pipeline.Stages(tmp_path, budget="t")
    assert stages.config("base").data.mixture_rates == {"a": 2}
    with pytest.raises(ValueError, match=r"critic\.yaml: no num_steps for the t budget's \{config_steps\}"):
        stages.config("critic")


@pytest.mark.slow
def test_demo_retrain_evaluates_the_shipped_models_in_a_second_process(tmp_path, monkeypatch):
    """`--retrain` evaluates the shipped models in a child process while the pipeline trains.
    With the pipeline stubbed to "retrain" the very same models, the child's numbers must
    equal the parent's own evaluation of them."""
    import shutil

    from selfrag_jax.demo.decoding import model_ndocs
    from selfrag_jax.demo.pipeline import Stages
    from selfrag_jax.inference.settings import SETTINGS_FILE

    work, models, encoder = demo_inputs(tmp_path)
    (models / SETTINGS_FILE).write_text(json.dumps({"ndocs": 2, "dev_match": {"1": 0.5, "2": 0.75}, "n": 4}))
    monkeypatch.setattr(Stages, "run_all", lambda self, export=True: None)
    monkeypatch.setattr(Stages, "export", lambda self, dest: {"dest": str(shutil.copytree(models, dest))})
    assert main(["demo", "--retrain", "--workdir", str(work), "--models", str(models), "--encoder", str(encoder),
                 "--limit", "3", "--batch-size", "3"]) == 0
    report = json.loads((work / "report.json").read_text())
    assert (work / "shipped" / "report.json").exists() and (work / "retrain" / "models" / "generator").is_dir()
    assert report["retrained"]["tasks"] == report["tasks"] and set(report["tasks"]) == set(TASKS)
    assert report["retrained"]["critic_agreement"] == report["critic_agreement"]
    # the models' own depth (chosen on the dev split) rules Self-RAG's candidates
    assert report["ndocs"] == report["retrained"]["ndocs"] == 2 and "top 2, the depth chosen" in (work / "report.md").read_text()
    for name in ("shipped", "retrained"):
        rows = [json.loads(line) for line in (work / name / "predictions" / "world_qa.selfrag.jsonl").read_text().splitlines()]
        assert all(len(r["candidates"]) <= 2 for r in rows) and any(len(r["candidates"]) == 2 for r in rows)
    (models / SETTINGS_FILE).write_text(json.dumps({"ndocs": 9}))
    with pytest.raises(ValueError, match=r"decoding\.json: ndocs must be a whole number from 1 to 5, got 9"):
        model_ndocs(models)


def test_induction_probe_scores_a_perfect_copier_one():
    """The induction probe's rows repeat name pieces, never control tokens, glued or as words;
    its scoring gives a model that predicts every next piece 1.0 on the second copy, and
    uniform logits none."""
    import numpy as np

    from selfrag_jax.bundled import ASSETS
    from selfrag_jax.demo.probe import copy_scores, induction_accuracy, repeat_rows
    from selfrag_jax.tokenizer import SelfRAGTokenizer

    ASSETS_CRITIC = ASSETS / "critic"
    tok = SelfRAGTokenizer.from_pretrained(ASSETS_CRITIC)
    x = repeat_rows(tok, rows=3, length=10, seed=1)
    assert x.shape == (3, 21) and (x[:, 0] == tok.bos_id).all() and (x[:, 1:11] == x[:, 11:]).all()
    assert not set(x[:, 1:].ravel()) & tok.forbidden_in_text
    assert all(tok.decode([i]).isalpha() and tok.decode([i])[0].isupper() for i in x[:, 1:].ravel())
    perfect = np.eye(tok.vocab_size, dtype=np.float32)[x[:, 1:]] * 50.0
    scores = copy_scores(perfect, x, 10)
    assert scores["second_accuracy"] == 1.0 and scores["first_loss"] < 1e-6 and scores["second_loss"] < 1e-6
    uniform = copy_scores(np.zeros((3, 20, tok.vocab_size), np.float32), x, 10)
    assert abs(uniform["second_loss"] - np.log(tok.vocab_size)) < 1e-4 and uniform["second_accuracy"] == 0.0
    # as words: the text of a repeat document, exactly as the tokenizer encodes it; only the
    # pieces are scored (a copier that gets every space wrong still scores 1.0)
    w = repeat_rows(tok, rows=3, length=10, seed=1, spaced=True)
    assert w.shape == (3, 40) and (w[:, 1:20] == w[:, 21:]).all() and (w[:, 1:20:2] == x[:, 1:11]).all()
    for row in w:
        text = tok.decode(row[1:].tolist())
        first = text.split("\n")[0]
        assert text == first + "\n" + first and len(first.split(" ")) == 10
        assert tok.encode_text(text) == row[1:].tolist()
    perfect = np.eye(tok.vocab_size, dtype=np.float32)[w[:, 1:]] * 50.0
    perfect[:, 21::2] = 0.0  # wrong about every space of the second copy
    scores = copy_scores(perfect, w, 10, spaced=True)
    assert scores["second_accuracy"] == 1.0 and scores["first_loss"] < 1e-6 and scores["second_loss"] < 1e-6
    uniform = copy_scores(np.zeros((3, 39, tok.vocab_size), np.float32), w, 10, spaced=True)
    assert abs(uniform["first_loss"] - np.log(tok.vocab_size)) < 1e-4 and uniform["second_accuracy"] == 0.0
    for spaced in (False, True):
        shipped = induction_accuracy(ASSETS_CRITIC, rows=4, length=12, spaced=spaced)
        assert set(shipped) == {"first_loss", "second_loss", "second_accuracy", "rows", "length", "spaced"}
        assert 0 <= shipped["second_accuracy"] <= 1 and shipped["spaced"] == spaced


def test_critic_agreement_scores_a_reading_critic_by_its_line(monkeypatch):
    """A scripted critic that writes, for a short answer, a reading line equal to the output and
    then the No-support label, and for a sentence the Partially label: agreement counts the
    line's decision (Fully), and the label after the line comes back apart."""
    from pathlib import Path

    import numpy as np

    import selfrag_jax.models.checkpoint as checkpoint
    from selfrag_jax import tokens as T
    from selfrag_jax.data.annotate import Critic
    from selfrag_jax.demo.demo import critic_agreement
    from selfrag_jax.world import WorldConfig
    from selfrag_jax.world.build import world_of
    from selfrag_jax.data.critic_prompts import issup_output
    from selfrag_jax.world.critic_data import make_critic_records

    def generate(self, prompts, desc="critic"):
        out = []
        for p in prompts:
            o = issup_output(p) if "Does the evidence support" in p else None
            out.append("[Retrieval]" if o is None else T.PARTIALLY_SUPPORTED if o.endswith(".")
                       else f"Answer: {o}\n{T.NO_SUPPORT}")
        return out

    monkeypatch.setattr(checkpoint, "load_model", lambda path: (None, None, None, None))
    monkeypatch.setattr(Critic, "generate", generate)
    out, own = critic_agreement(Path("unused"), per_type=60)
    assert set(out) == {"retrieve_input", "retrieve_sentence", "isrel", "issup", "isuse"}
    sup = [r for r in make_critic_records(world_of(WorldConfig()), 60, seed=1, split="heldout")
           if r["dataset_name"] == "critic_issup"]
    sentence = [issup_output(r["input"]).endswith(".") for r in sup]
    decided = [T.PARTIALLY_SUPPORTED if s else T.FULLY_SUPPORTED for s in sentence]
    own_labels = [T.PARTIALLY_SUPPORTED if s else T.NO_SUPPORT for s in sentence]
    assert out["issup"] == float(np.mean([d == r["output"] for d, r in zip(decided, sup)]))
    assert own == float(np.mean([d == r["output"] for d, r in zip(own_labels, sup)]))
    assert out["issup"] != own


def test_annotate_stage_keeps_contrast_pairs_only_where_the_critic_rates_them_down(tmp_path, monkeypatch):
    """The annotate stage adds contrast pairs (another question's value) and kind contrast pairs
    (the person's other attribute) to the raw pairs; a scripted critic rates half of all IsSup
    inputs unsupported and half of all IsUse inputs [Utility:2]: every contrast pair kept has a
    [No support / Contradictory] segment, every kind pair kept is rated [Utility:2] and answers
    with another of its person's values (any of them, asked what no passage records), every raw
    pair is kept, and the report counts them."""
    import zlib

    import selfrag_jax.models.checkpoint as checkpoint
    import selfrag_jax.retrieval.retriever as retriever
    from selfrag_jax import tokens as T
    from selfrag_jax.data.annotate import Critic
    from selfrag_jax.demo import pipeline
    from selfrag_jax.world import WorldConfig, build_world, parse_output, read_jsonl
    from selfrag_jax.world.generator_data import CONTRAST_SUFFIX, KIND_SUFFIX
    from selfrag_jax.world.tasks import UNRECORDED
    from selfrag_jax.world.pretrain import PretrainConfig

    build_world(str(tmp_path / "world"), config=WorldConfig(  # test_world's small world, fewer raw pairs
        seed=3, n_people=400, n_ghosts=80, n_generator=1500, n_raw=120, n_critic_per_type=120, n_practice_people=300,
        n_raw_practice=80, n_critic_practice_per_type=60, vocab_size=1500,
        pretrain=PretrainConfig(n_lookups=400, n_reading=400, n_fresh_reading=1500, n_no_retrieval=100,
                                n_anneal_reading=300, n_relevance=300, n_repeat=300),
        n_eval_factcheck=40, n_eval_mc=40, n_eval_longform=20, n_eval_no_retrieval=20))
    passages = read_jsonl(str(tmp_path / "world" / "passages.jsonl"))

    class Fixed:
        def retrieve(self, queries, k=5):
            return [[{**passages[zlib.crc32(q.encode()) % len(passages)], "score": 1.0}] for q in queries]

    def generate(self, prompts, desc="critic"):
        def one(p):
            if "Does the evidence support" in p:
                return T.NO_SUPPORT if zlib.crc32(p.encode()) % 2 else T.FULLY_SUPPORTED
            if "Rate how well" in p:
                return "[Utility:2]" if zlib.crc32(p.encode()) % 2 else "[Utility:5]"
            return T.RELEVANT if "Is the evidence about" in p else T.RETRIEVAL
        return [one(p) for p in prompts]

    monkeypatch.setattr(checkpoint, "load_model", lambda path: (None, None, None, None))
    monkeypatch.setattr(retriever.Retriever, "from_dir", classmethod(lambda cls, path: Fixed()))
    monkeypatch.setattr(Critic, "generate", generate)
    stages = pipeline.Stages(tmp_path)
    report = stages.annotate()["report"]
    out = read_jsonl(str(tmp_path / "annotated.jsonl"))
    contrast = [r for r in out if r["id"].endswith(CONTRAST_SUFFIX)]
    unsupported = [any(s.issup == T.NO_SUPPORT for s in parse_output(r["output"]).segments) for r in contrast]
    assert contrast and all(unsupported)
    kinds = [r for r in out if r["id"].endswith(KIND_SUFFIX)]
    metas = {m["id"]: m for raw in ("raw", "practice_raw") for m in read_jsonl(str(tmp_path / "world" / "train" / f"{raw}_meta.jsonl"))}
    assert kinds and all(parse_output(r["output"]).utility == "[Utility:2]" for r in kinds)
    for r in kinds:
        meta = metas[r["id"][:-len(KIND_SUFFIX)]]
        assert meta["answers"][0] not in meta["other_values"].values()
        answer = parse_output(r["output"]).segments[0].text
        if r["instruction"] in {q.format(name=meta["name"]) for qs in UNRECORDED.values() for q in qs}:
            assert answer in [*meta["other_values"].values(), *meta["answers"]]  # none answers what no passage records
        else:  # another of the person's values answers the question asked
            assert answer in meta["other_values"].values()
    assert len(out) == 200 + len(contrast) + len(kinds)
    for name, kept in (("contrast", contrast), ("kind_contrast", kinds)):
        made = sum(r[name]["made"] for r in report.values())
        assert made > len(kept) == sum(r[name]["kept"] for r in report.values())


def test_pick_refusal_keeps_accuracy_then_raises_the_least_refused_kind():
    import numpy as np

    from selfrag_jax.demo.decoding import pick_refusal

    inf = float("-inf")
    bars = [(0.5, 0.5, True, inf, inf), (0.9, 0.5, True, inf, inf), (0.99, 0.5, True, inf, inf), (0.99, 0.9, True, inf, inf)]
    answerable = np.array([0.90, 0.89, 0.875, 0.80])
    refused = {"a": np.array([0.2, 0.6, 0.9, 1.0]), "b": np.array([0.3, 0.7, 0.5, 1.0])}
    # the last bar refuses everything but costs 10 points; of the rest, (0.9, 0.5) has the best worst kind
    assert pick_refusal(bars, answerable, refused, no_refusal=0.90, max_drop=0.03) == 1
    assert pick_refusal(bars, answerable, refused, no_refusal=0.90, max_drop=0.2) == 3
    # ties go to the lower bar; nothing within reach: the most accurate bar
    assert pick_refusal(bars[:2], answerable[:2], {"a": np.array([0.5, 0.5])}, no_refusal=0.9) == 0
    assert pick_refusal(bars, answerable - 0.5, refused, no_refusal=0.9) == 0
    # equal rates: no retriever floor before one
    floors = [(0.9, 0.5, True, 0.6, inf), (0.9, 0.5, True, inf, inf)]
    assert pick_refusal(floors, np.array([0.9, 0.9]), {"a": np.array([0.5, 0.5])}, no_refusal=0.9) == 1
    uses = [(0.9, 0.5, True, inf, 0.0), (0.9, 0.5, True, inf, inf)]  # nor a utility bar
    assert pick_refusal(uses, np.array([0.9, 0.9]), {"a": np.array([0.5, 0.5])}, no_refusal=0.9) == 1


def test_learned_bar_scores_as_choose_does():
    """`DevSet.metric`, which scores many thresholds at once for the search, is
    `candidates.choose` with the combination as the bar (open task, at the depth)."""
    import dataclasses

    import numpy as np

    from selfrag_jax.demo.decoding import DevSet
    from selfrag_jax.evaluation import sweep as S
    from selfrag_jax.evaluation.synthetic import synthetic_cache
    from selfrag_jax.inference.cache import predictions
    from selfrag_jax.inference.candidates import choose
    from selfrag_jax.inference.scoring import BAR_FEATURES, Combination, RefuseOptions
    from selfrag_jax.metrics import match

    cache = synthetic_cache(300, k=4, task="open", seed=5)
    prep, rng = S.prepare(cache), np.random.default_rng(1)
    dev = DevSet.of(prep, ndocs=3)
    gold = S._gold_rule("open")
    for _ in range(3):
        comb = Combination(tuple(rng.normal(size=len(BAR_FEATURES))), tuple(rng.normal(size=len(BAR_FEATURES))), 0.0)
        scores = comb.score(dev.features.reshape(-1, len(BAR_FEATURES))).reshape(dev.valid.shape)
        opts = S.Config(ndocs=3).options("open")
        choice = choose(prep.table, dataclasses.replace(opts, refuse=RefuseOptions(enabled=True, combination=comb)))
        expected = np.mean([match(p, gold(line)) for p, line in zip(predictions(cache, choice), cache.questions)])
        assert 0 < choice.refused.mean() < 1
        assert dev.metric(scores, np.array([0.0]))[0] == pytest.approx(expected)


def test_learned_bar_draws_a_boundary_no_pair_of_thresholds_can():
    """Right answers lie above use + ret = 1, one unanswerable kind below it with high ret,
    another with high use: the fitted combination refuses nearly all of both and keeps
    answerable accuracy within the window."""
    import numpy as np

    from selfrag_jax.demo.decoding import DevSet, fit_combination
    from selfrag_jax.inference.scoring import BAR_FEATURES

    rng = np.random.default_rng(0)

    def dev_set(n, use, ret, right):
        features = rng.normal(size=(n, 1, len(BAR_FEATURES)))  # noise in the other signals
        features[:, 0, 1], features[:, 0, 2] = ret, use
        return DevSet(features, np.zeros((n, 1)), right[:, None].astype(float), np.ones((n, 1), bool),
                      np.ones(n, bool), np.zeros(n), np.zeros(n) if right.any() else np.ones(n))

    u = rng.uniform(0, 1, 300)
    answerable = dev_set(300, u, 1 - u + rng.uniform(0.05, 0.6, 300), np.ones(300, bool))
    high_ret = rng.uniform(0.7, 1.0, 100)
    kinds = {"well_retrieved": dev_set(100, 0.9 - high_ret - 0.05, high_ret, np.zeros(100, bool)),
             "rated_useful": dev_set(100, high_ret, 0.9 - high_ret - 0.05, np.zeros(100, bool))}
    comb, dev = fit_combination({"answerable": answerable, **kinds}, no_refusal=1.0, steps=200)
    assert dev["answerable"] >= 0.97 and min(dev["well_retrieved"], dev["rated_useful"]) >= 0.95
    assert comb.weights[1] > 0 and comb.weights[2] > 0


def test_continue_budget_trains_the_shipped_models_again_without_a_base(tmp_path):
    from selfrag_jax.bundled import ASSETS
    from selfrag_jax.demo.pipeline import Stages

    stages = Stages(tmp_path, budget="continue")
    assert all(stages.skips(n) for n in ("base", "anneal", "anneal2", "base_reading", "critic"))
    reading, generator = stages.config("critic_reading"), stages.config("generator")
    assert reading.model.init_from == str(ASSETS / "critic") and stages.critic_dir == tmp_path / "critic_isuse"
    assert generator.model.init_from == str(ASSETS / "generator")
    assert (generator.epochs, generator.optim.learning_rate) == (8, 1e-3)  # the stage's own config
    assert generator.data.train_files == [str(tmp_path / "annotated.jsonl")] and generator.data.unsupported_weight == 0.0
