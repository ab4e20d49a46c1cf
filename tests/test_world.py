"""The bundled world: deterministic, leak-free, well-formed Self-RAG data, balanced critic data,
and a tokenizer that loads with AutoTokenizer and keeps values identical wherever they stand."""

from __future__ import annotations

import collections
import os
import re

import pytest

from selfrag_jax.tokens import (
    CONTINUE_EVIDENCE, CRITIC_PROMPT, FULLY_SUPPORTED, IRRELEVANT, ISSUP_GROUP, NO_RETRIEVAL, NO_SUPPORT,
    PARTIALLY_SUPPORTED, RELEVANT, RETRIEVAL, passage_text,
)
from selfrag_jax.world import REFUSAL, WorldConfig, build_world, critic_prompt, make_world, parse_output, read_jsonl
from selfrag_jax.data.critic_prompts import LABELS
from selfrag_jax.world.pretrain import PretrainConfig

SMALL = WorldConfig(seed=3, n_people=400, n_ghosts=80, n_generator=1500, n_raw=400, n_critic_per_type=120,
                    n_practice_people=300, n_raw_practice=300, n_critic_practice_per_type=60,
                    vocab_size=1500, pretrain=PretrainConfig(n_lookups=400, n_reading=400, n_fresh_reading=1500, n_no_retrieval=100,
                                            n_anneal_reading=300, n_relevance=300, n_repeat=300),
                    n_eval_factcheck=40, n_eval_mc=40, n_eval_longform=20, n_eval_no_retrieval=20)
RECORD_KEYS = ["instruction", "input", "output", "id", "dataset_name"]
TRAINING_FILES = ("train/generator.jsonl", "train/generator_meta.jsonl", "train/raw.jsonl", "train/raw_meta.jsonl",
                  "train/critic.jsonl", "train/critic_reading.jsonl", "train/practice_raw.jsonl", "train/practice_passages.jsonl",
                  "pretrain.jsonl", "anneal.jsonl", "relevance.jsonl", "relevance_forms.jsonl", "repeat.jsonl",
                  "tokenizer/tokenizer.json")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("world"))
    manifest = build_world(out, config=SMALL)
    return out, manifest


def load(out: str, rel: str) -> list[dict]:
    return read_jsonl(os.path.join(out, rel))


def test_same_seed_gives_byte_identical_files(built, tmp_path):
    out, manifest = built
    again = build_world(str(tmp_path), config=SMALL)
    assert again == manifest
    for rel in manifest["files"]:
        with open(os.path.join(out, rel), "rb") as a, open(os.path.join(tmp_path, rel), "rb") as b:
            assert a.read() == b.read(), rel
    with open(os.path.join(out, "manifest.json"), "rb") as a, open(os.path.join(tmp_path, "manifest.json"), "rb") as b:
        assert a.read() == b.read()
    other = make_world(seed=4, n_people=400, n_ghosts=80)
    assert other.passages[0].text != make_world(seed=3, n_people=400, n_ghosts=80).passages[0].text


def test_eval_only_world_has_the_same_eval_files_and_no_training_files(built, tmp_path):
    out, manifest = built
    eval_only = build_world(str(tmp_path), config=SMALL, training=False)
    assert set(eval_only["files"]) == {"passages.jsonl", "entities.jsonl", *manifest["eval"].values(),
                                       *manifest["unanswerable"].values()}
    for rel, info in eval_only["files"].items():
        assert info["sha256"] == manifest["files"][rel]["sha256"], rel
    assert not os.path.exists(os.path.join(tmp_path, "pretrain.jsonl"))
    assert not os.path.exists(os.path.join(tmp_path, "tokenizer"))


def test_manifest_lists_every_file(built):
    out, manifest = built
    for rel, info in manifest["files"].items():
        assert os.path.getsize(os.path.join(out, rel)) == info["bytes"]
    for rel in [manifest["passages"], manifest["generator"], manifest["critic"], manifest["critic_reading"],
                *manifest["eval"].values()]:
        assert rel in manifest["files"]
    assert manifest["splits"]["heldout_people"] == 60


def test_records_have_the_released_fields(built):
    out, _ = built
    for rel in ("train/generator.jsonl", "train/raw.jsonl", "train/critic.jsonl", "train/critic_reading.jsonl"):
        for r in load(out, rel):
            assert list(r) == RECORD_KEYS
    for r in load(out, "passages.jsonl"):
        assert list(r) == ["id", "title", "text"]
    ids = [r["id"] for r in load(out, "train/generator.jsonl")]
    assert len(ids) == len(set(ids))
    assert [m["id"] for m in load(out, "train/generator_meta.jsonl")] == ids


def test_heldout_people_never_reach_training_files(built):
    out, _ = built
    entities = load(out, "entities.jsonl")
    heldout = [e for e in entities if e["split"] == "heldout"]
    assert heldout
    words = set()
    for e in heldout:
        words.add(e["name"])
        if e["type"] == "person":
            words.add(e["name"].split()[1])  # surnames are unique words in the world
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(words))) + r")\b")
    for rel in TRAINING_FILES:
        with open(os.path.join(out, rel), encoding="utf-8") as f:
            hit = pattern.search(f.read())
        assert hit is None, f"{hit.group(0)} in {rel}"
    # ...but retrieval can find them: their passages are in the corpus.
    titles = {p["title"] for p in load(out, "passages.jsonl")}
    assert all(e["name"] in titles for e in heldout if e["type"] == "person")


def test_practice_people_are_in_no_pretraining_text_but_in_critic_and_raw_data(built):
    """Fine-tuning examples about people the base model cannot have memorised: only reading
    the passage answers them."""
    out, manifest = built
    practice = load(out, manifest["practice"]["passages"])
    people = {p["title"] for p in practice if p["id"].startswith("pw")} - {p["title"] for p in load(out, "passages.jsonl")}
    assert len(people) > 100
    with open(os.path.join(out, "pretrain.jsonl"), encoding="utf-8") as f:
        pretrain = f.read()
    assert not [name for name in people if name in pretrain]
    raw = " ".join(r["instruction"] for r in load(out, manifest["practice"]["raw"]))
    critic = [r for r in load(out, "train/critic.jsonl") if r["id"].startswith("critic_practice_")]
    assert len(critic) == 5 * SMALL.n_critic_practice_per_type
    assert sum(name in raw for name in people) > 100
    assert any(name in r["input"] for r in critic for name in list(people)[:50])


def test_hard_lookalike_reading_asks_what_both_passages_state():
    """With hard_lookalikes the passage beside the person's own states the first asked
    attribute too (when the look-alike has it), so only the name tells which one answers."""
    import random

    from selfrag_jax.world.pretrain import reading_doc

    world = make_world(seed=3, n_people=400, n_ghosts=80)
    by_text = {passage_text(p.title, p.text): p for p in world.passages}

    def share_of_docs_asking_a_shared_attribute(hard: bool) -> float:
        rng, shared, pairs = random.Random(0), 0, 0
        for person in world.kb.train_people[:300]:
            blocks = reading_doc(world, person, rng, "train", 3, hard=hard).split("\n\n")
            shown = [by_text[b] for b in blocks if not b.startswith("Question:")]
            if len(shown) < 2:
                continue
            own = next(p for p in shown if p.entity_id == person.id)
            other = next(p for p in shown if p.entity_id != person.id)
            answer = blocks[len(shown)].split("\nAnswer: ")[1]
            asked = next(a for a, v in own.facts.items() if v == answer)
            pairs += 1
            shared += asked in other.facts
        return shared / pairs

    hard, easy = share_of_docs_asking_a_shared_attribute(True), share_of_docs_asking_a_shared_attribute(False)
    assert hard > 0.9 and hard > easy + 0.2, (hard, easy)


def test_relevance_docs_refuse_exactly_when_the_passage_does_not_answer(built):
    """Question first, one passage, then its answer or REFUSAL: a look-alike's passage states
    the asked kind of fact too (when the look-alike has it), so only the name decides; in the
    second anneal's set the person's own passage may also lack the asked fact (another of
    their passages states it), so the passage must state what is asked."""
    import random

    from selfrag_jax.world.pretrain import relevance_doc
    from selfrag_jax.world.tasks import QUESTIONS

    out, manifest = built
    assert len(load(out, manifest["relevance"])) == SMALL.pretrain.n_relevance
    forms = collections.Counter(r["text"].split(":")[0] + ("/evidence" if "from the evidence" in r["text"] else "")
                                for r in load(out, manifest["relevance_forms"]))
    assert len(forms) == 4 and min(forms.values()) > SMALL.pretrain.n_relevance / 8, forms
    assert all(r["text"].startswith("Question: ") for r in load(out, manifest["relevance"]))
    world = make_world(seed=3, n_people=400, n_ghosts=80)
    by_text = {passage_text(p.title, p.text): p for p in world.passages}
    people = world.kb.train_people[:300]
    for lacking_share in (0.0, 0.3):
        rng, kinds = random.Random(0), collections.Counter()
        for person in people:
            question, passage, answer = relevance_doc(world, person, rng, "train", 0.4,
                                                      lacking_share=lacking_share).split("\n\n")
            shown, answer = by_text[passage], answer.removeprefix("Answer: ")
            asked = next(a for a, qs in QUESTIONS.items() if question in {"Question: " + q.format(name=person.name) for q in qs})
            if answer != REFUSAL:
                assert shown.entity_id == person.id and answer == shown.facts[asked]
                kinds["answer"] += 1
            elif shown.entity_id != person.id:
                kinds["lookalike"] += 1
                kinds["same_kind"] += asked in shown.facts
            else:  # their own passage, asked about a fact it lacks and another of theirs states
                assert asked not in shown.facts and any(asked in p.facts for p in world.by_entity[person.id])
                kinds["lacking"] += 1
        assert 0.3 < kinds["lookalike"] / len(people) < 0.5 and kinds["same_kind"] / kinds["lookalike"] > 0.8, kinds
        assert (kinds["lacking"] == 0) if not lacking_share else (0.12 < kinds["lacking"] / len(people) < 0.3), kinds


def test_generator_outputs_parse_and_cover_every_class(built):
    out, _ = built
    corpus = {passage_text(p["title"], p["text"]) for p in load(out, "passages.jsonl")}
    seen = collections.Counter()
    for r in load(out, "train/generator.jsonl"):
        parsed = parse_output(r["output"])
        seen[parsed.utility] += 1
        for seg in parsed.segments:
            seen[seg.retrieve] += 1
            seen[seg.isrel] += 1
            seen[seg.issup] += 1
            if seg.passage is not None:
                assert seg.passage in corpus
            if seg.isrel == IRRELEVANT:
                assert seg.issup is None
    for token in (RETRIEVAL, NO_RETRIEVAL, CONTINUE_EVIDENCE, RELEVANT, IRRELEVANT, *ISSUP_GROUP, "[Utility:5]", "[Utility:1]"):
        assert seen[token] > 0, token
    # relevant and look-alike passages are roughly balanced for the [Irrelevant] decision
    assert 0.3 < seen[IRRELEVANT] / (seen[RELEVANT] + seen[IRRELEVANT]) < 0.6


def test_contrast_pairs_give_each_chosen_question_another_value_of_its_attribute(built):
    from selfrag_jax.world.generator_data import CONTRAST_SUFFIX, contrast_pairs

    out, _ = built
    records, metas = load(out, "train/raw.jsonl"), load(out, "train/raw_meta.jsonl")
    pairs = contrast_pairs(records, metas, 0.5, seed=1)
    qa = {m["id"]: m for m in metas if m["kind"] == "qa"}
    values = {a: {m["answers"][0] for m in qa.values() if m["attributes"][0] == a} for a in {m["attributes"][0] for m in qa.values()}}
    assert 0.35 * len(qa) < len(pairs) < 0.65 * len(qa)
    for p in pairs:
        meta = qa[p["id"].removesuffix(CONTRAST_SUFFIX)]
        assert p["output"] not in meta["answers"] and p["output"] in values[meta["attributes"][0]]
        assert p["instruction"] == records[[r["id"] for r in records].index(meta["id"])]["instruction"]
    assert contrast_pairs(records, metas, 0.5, seed=1) == pairs and not contrast_pairs(records, metas, 0.0)


def test_kind_contrast_pairs_answer_with_another_attribute_of_the_same_person(built):
    from selfrag_jax.world.generator_data import KIND_SUFFIX, kind_contrast_pairs
    from selfrag_jax.world.kb import ATTRIBUTES
    from selfrag_jax.world.tasks import UNRECORDED, UNRECORDED_YEARS

    out, _ = built
    records, metas = load(out, "train/raw.jsonl"), load(out, "train/raw_meta.jsonl")
    people = {e["id"]: e for e in load(out, "entities.jsonl")}
    pairs = kind_contrast_pairs(records, metas, 0.5)
    qa = {m["id"]: m for m in metas if m["kind"] == "qa"}
    assert 0.35 * len(qa) < len(pairs) < 0.65 * len(qa)
    source = {r["id"]: r for r in records}
    unrecorded = {q.format(name=e["name"]) for e in people.values() for qs in UNRECORDED.values() for q in qs}
    years = {e["name"]: {q.format(name=e["name"]) for a in UNRECORDED_YEARS for q in UNRECORDED[a]} for e in people.values()}
    asked_else = asked_year = 0
    for p in pairs:
        meta = qa[p["id"].removesuffix(KIND_SUFFIX)]
        person = people[meta["entity_ids"][0]]
        asked = meta["attributes"][0]
        if p["instruction"] == source[meta["id"]]["instruction"]:  # another recorded attribute asked
            assert p["output"] in {person[a] for a in ATTRIBUTES if a != asked} and p["output"] != person[asked]
        else:  # a thing no passage records, about the same person, answered with any of their values
            asked_else += 1
            assert p["instruction"] in unrecorded and person["name"] in p["instruction"]
            assert p["output"] in {person[a] for a in ATTRIBUTES}
            if p["instruction"] in years[person["name"]]:  # a year asked: the birth year, the asked kind
                asked_year += 1
                assert p["output"] == person["birth_year"]
    assert 0.35 * len(pairs) < asked_else < 0.65 * len(pairs) and asked_year > 0.1 * asked_else
    assert kind_contrast_pairs(records, metas, 0.5) == pairs and not kind_contrast_pairs(records, metas, 0.0)
    assert all(p["instruction"] == source[p["id"].removesuffix(KIND_SUFFIX)]["instruction"]
               for p in kind_contrast_pairs(records, metas, 0.5, unrecorded_share=0.0))


def test_isuse_rates_a_bare_value_by_its_kind_as_often_helpful_as_not():
    """Bare values answering one question: [Utility:5] when of the asked kind, [Utility:2] when
    another, in about equal numbers (a majority label is what a small critic learns instead;
    [Utility:3] is half of a two-part answer). A question about what no passage records is never
    answered by a value: always [Utility:2]."""
    from selfrag_jax.world.critic_data import make_critic_records
    from selfrag_jax.world.kb import ATTRIBUTES
    from selfrag_jax.world.tasks import UNRECORDED

    world = make_world(seed=3, n_people=400, n_ghosts=80)
    values = {v: a for a in ATTRIBUTES for v in world.values(a)}
    unrecorded = {q.format(name=p.name) for p in world.kb.people for qs in UNRECORDED.values() for q in qs}
    counts, unrecorded_counts = collections.Counter(), collections.Counter()
    for r in make_critic_records(world, 500, seed=2):
        if r["dataset_name"] == "critic_isuse" and r["input"].rsplit("\nOutput: ", 1)[1] in values:
            counts[r["output"]] += 1
            question = r["input"].removeprefix("Task instruction: ").rsplit("\nOutput: ", 1)[0]
            unrecorded_counts[r["output"]] += question in unrecorded
    assert set(counts) == {"[Utility:2]", "[Utility:3]", "[Utility:5]"} and 0.8 < counts["[Utility:2]"] / counts["[Utility:5]"] < 1.25, counts
    assert +unrecorded_counts == {"[Utility:2]": unrecorded_counts["[Utility:2]"]} and unrecorded_counts["[Utility:2]"] > 15


def test_unanswerable_kinds_have_disjoint_dev_and_test_and_no_passage_answers_them(built):
    from selfrag_jax.world.tasks import UNRECORDED
    from selfrag_jax.world.unanswerable import KINDS, SPLITS, UNSTATED

    out, manifest = built
    assert set(manifest["unanswerable"]) == {f"{k}_{s}" for k in KINDS for s in SPLITS}
    passages = load(out, "passages.jsonl")
    text = "\n".join(p["text"] for p in passages)
    people = {e["id"]: e for e in load(out, "entities.jsonl")}
    for kind in KINDS:
        sets = {s: load(out, manifest["unanswerable"][f"{kind}_{s}"]) for s in SPLITS}
        assert {s: len(r) for s, r in sets.items()} == SPLITS
        dev_ids, test_ids = ({i for r in sets[s] for i in r["meta"]["entity_ids"]} for s in ("dev", "test"))
        if kind in ("unstated", "others_only"):  # about held-out or name-only people, different ones per split
            assert dev_ids and not dev_ids & test_ids
            assert all(people[i]["split"] == "heldout" for i in dev_ids | test_ids)
        parts = {w for e in people.values() for w in e["name"].split()}
        for r in sets["dev"] + sets["test"]:
            assert r["answers"] == [] and r["answerable"] is False and r["meta"]["unanswerable_kind"] == kind
            name = r["meta"]["name"]
            assert name in r["question"]
            if kind in ("unseen_name", "recombined"):  # a name nobody has and no passage states
                assert name not in {e["name"] for e in people.values()} and name not in text
                first, last = name.split()
                assert (first in parts, last in parts) == ((False, False) if kind == "unseen_name" else (True, True))
            else:
                assert name == people[r["meta"]["entity_ids"][0]]["name"]
    assert not re.search(r"\b(die|died|tall|height|food|dish)\b", text)  # what `unstated` asks, no passage states
    # what training asks and no passage records, none of it what `unstated` asks
    assert not re.search(r"\b(retire|school|father|sport|eyes?|nickname|pet|heavy|weigh|colou?r|book|hair|shoe|feet|car|drive"
                         r"|religion|faith|mother|perform|concert|wed|wedding|graduate)\b", text)
    assert not set(UNRECORDED) & set(UNSTATED)
    assert not re.search(r"\b(die|tall|height|food|dish)\b", " ".join(q for qs in UNRECORDED.values() for q in qs))


def test_parse_output_rejects_bad_grammar():
    for bad in ("answer[Utility:5]", f"{RETRIEVAL}answer[Utility:5]", f"{NO_RETRIEVAL}answer",
                f"{RETRIEVAL}<paragraph>t\nx</paragraph>{RELEVANT}answer[Utility:5]",
                f"{RETRIEVAL}<paragraph>t\nx</paragraph>{IRRELEVANT}answer{FULLY_SUPPORTED}[Utility:5]"):
        with pytest.raises(ValueError):
            parse_output(bad)
    ok = parse_output(f"{RETRIEVAL}<paragraph>T\nx</paragraph>{RELEVANT}a{FULLY_SUPPORTED}{CONTINUE_EVIDENCE}b[Utility:4]")
    assert [s.text for s in ok.segments] == ["a", "b"] and ok.utility == "[Utility:4]"


def test_oracle_labels_match_the_passages(built):
    out, _ = built
    passages = {p["id"]: p for p in load(out, "passages.jsonl")}
    people = {e["id"]: e for e in load(out, "entities.jsonl")}
    title_of = {pid: p["title"] for pid, p in passages.items()}
    for r, m in zip(load(out, "train/generator.jsonl"), load(out, "train/generator_meta.jsonl")):
        if m["kind"] != "qa":
            continue
        value = m["answers"][0]
        gold = passages[m["gold_passage_ids"][0]]
        assert value in gold["text"] and gold["title"] == people[m["entity_ids"][0]]["name"]
        seg = parse_output(r["output"]).segments[0]
        shown = m["labels"]["passage_ids"][0]
        if seg.isrel == IRRELEVANT:  # a look-alike: someone else, sharing a first name, occupation or birthplace
            assert title_of[shown] != gold["title"]
        elif seg.issup == FULLY_SUPPORTED:
            assert value in passages[shown]["text"]
        elif seg.issup == NO_SUPPORT:
            assert title_of[shown] == gold["title"] and value not in passages[shown]["text"]


def test_eval_answers_are_in_gold_passages_and_unanswerables_nowhere(built):
    out, manifest = built
    passages = {p["id"]: p for p in load(out, "passages.jsonl")}
    asked = set()
    for r in load(out, manifest["eval"]["world_qa"]):
        assert {"id", "question", "answers"} <= set(r)
        assert any(a in passages[g]["text"] for g in r["meta"]["gold_passage_ids"] for a in r["answers"])
        asked.add((r["meta"]["entity_ids"][0], r["meta"]["attributes"][0]))
    dev = load(out, manifest["eval"]["world_qa_dev"])  # the same people's other questions, never world_qa's
    assert dev and not asked & {(r["meta"]["entity_ids"][0], r["meta"]["attributes"][0]) for r in dev}
    assert {r["meta"]["entity_ids"][0] for r in dev} <= {e for e, _ in asked}
    for r in dev:
        assert any(a in passages[g]["text"] for g in r["meta"]["gold_passage_ids"] for a in r["answers"])
    mc = load(out, manifest["eval"]["world_mc"])
    for r in mc:
        assert r["answers"] == [r["answerKey"]] and r["choices"]["label"] == ["A", "B", "C", "D"]
        value = r["choices"]["text"][r["choices"]["label"].index(r["answerKey"])]
        assert value in passages[r["meta"]["gold_passage_ids"][0]]["text"]
    assert {r["answers"][0] for r in load(out, manifest["eval"]["world_factcheck"])} == {"true", "false"}
    ghosts = {e["name"]: e for e in load(out, "entities.jsonl") if e["type"] == "name_only"}
    unanswerable = load(out, manifest["eval"]["world_unanswerable"])
    assert unanswerable and all(r["answerable"] is False for r in unanswerable)
    for r in unanswerable:
        name = next(n for n in ghosts if n in r["question"])
        for p in passages.values():
            assert p["title"] != name
            if name in p["text"]:  # only ever named as someone's teacher, nothing about them
                assert re.findall(r"[^.]*" + re.escape(name) + r"[^.]*\.", p["text"]) == [
                    f" {p['title'].split()[1]} studied under {name}."]


def test_lookalike_distractors_exist():
    world = make_world(seed=3, n_people=400, n_ghosts=80)
    for person in world.kb.people:
        assert world.kb.lookalikes(person, None)["first"], person.name
    assert sum(p.n_passages == 2 for p in world.kb.people) > 100  # source of no-support / partial cases


def test_critic_data_is_balanced_per_type(built):
    out, _ = built
    records = load(out, "train/critic.jsonl")
    by_type = collections.defaultdict(collections.Counter)
    for r in records:
        kind = r["dataset_name"].removeprefix("critic_")
        label = r["output"].rsplit("\n", 1)[-1]  # after an IsSup reading line, when there is one
        assert label in LABELS[kind] and (label == r["output"] or kind == "issup")
        assert r["input"].startswith("Task instruction: ")
        by_type[kind][label] += 1
    assert set(by_type) == set(LABELS)
    for kind, counts in by_type.items():
        assert set(counts) == set(LABELS[kind]) and len(set(counts.values())) == 1, (kind, counts)
    r = next(r for r in records if r["dataset_name"] == "critic_issup")
    assert critic_prompt(r) == CRITIC_PROMPT.format(instruction=r["instruction"], input=r["input"])
    assert re.fullmatch(r"Task instruction: .*\nPreceding sentences: .*\nOutput: .*\nEvidence: .*", r["input"], re.S)
    assert any(r["output"] == PARTIALLY_SUPPORTED for r in records)


def test_issup_reading_lines_decide_every_short_answer_label():
    """With issup_reading, the `Answer:` line of ground truth, compared with the output by
    annotation's rule, gives back the example's own label; choice letters and verdicts, which
    no passage states, and sentences keep the bare label. Without the flag: no lines."""
    from selfrag_jax.data.annotate import read_support
    from selfrag_jax.data.critic_prompts import issup_output
    from selfrag_jax.world.critic_data import make_critic_records

    world = make_world(seed=3, n_people=400, n_ghosts=80)
    assert not any("Answer:" in r["output"] for r in make_critic_records(world, 300, seed=2))
    read = make_critic_records(world, 300, seed=2, issup_reading=True)
    checked, bare = collections.Counter(), collections.Counter()
    for r in read:
        if "Answer:" not in r["output"]:
            assert r["output"] in LABELS[r["dataset_name"].removeprefix("critic_")]
            if r["dataset_name"] == "critic_issup":
                out = issup_output(r["input"])
                kind = "verdict" if out in ("A", "B", "C", "D", "true", "false") else "sentence"
                assert kind == "verdict" or out.endswith("."), out
                bare[kind] += 1
            continue
        line, label = r["output"].split("\n")
        assert r["dataset_name"] == "critic_issup" and line.startswith("Answer: ")
        assert read_support(line, issup_output(r["input"])) == label
        checked[label] += 1
    assert set(checked) == set(LABELS["issup"]) and min(checked.values()) > 30, checked
    assert bare["verdict"] > 20 and bare["sentence"] > 50, bare
    assert any("I don't know." in r["output"] for r in read)


def test_world_writes_the_critic_data_in_both_forms(built):
    """critic.jsonl is the paper's form (bare labels); critic_reading.jsonl, the same world's
    labels with IsSup reading lines, is what the critic_reading stage trains on."""
    out, _ = built
    paper, reading = load(out, "train/critic.jsonl"), load(out, "train/critic_reading.jsonl")
    assert not any("Answer:" in r["output"] for r in paper)
    lines = [r for r in reading if r["output"].startswith("Answer: ")]
    assert lines and all(r["dataset_name"] == "critic_issup" for r in lines)
    kinds = lambda recs: collections.Counter(r["dataset_name"] for r in recs)  # noqa: E731
    assert kinds(paper) == kinds(reading)


def test_unanswerable_training_examples_refuse(built):
    out, _ = built
    rows = [r for r in load(out, "train/generator.jsonl") if r["dataset_name"] == "world_unanswerable"]
    assert rows and all(r["output"].endswith(f"{IRRELEVANT}{REFUSAL}[Utility:1]") for r in rows)


def test_pretrain_text_has_passages_and_lookups(built):
    out, _ = built
    texts = [r["text"] for r in load(out, "pretrain.jsonl")]
    assert any("\nQuestion: " in t for t in texts)  # reading: passage, then a question about it
    assert any(t.startswith("Question: ") for t in texts)


def test_fresh_reading_people_have_values_no_prior_predicts(built):
    """The fresh people of the reading documents play any of 78 instruments and were born in
    any year 1000-1999 (a base answered one instrument, and one year, for every held-out
    question when the reading documents drew them from the world's 16 and 1780-1960); the
    world's own people keep the world's values, so evaluation is unchanged."""
    from selfrag_jax.world.kb import INSTRUMENTS, MORE_INSTRUMENTS

    out, _ = built
    text = "\n".join(r["text"] for r in load(out, "pretrain.jsonl"))
    played = set(re.findall(r"play(?:ed|ing) the ([a-z]+)\.", text))
    assert played <= set(INSTRUMENTS + MORE_INSTRUMENTS) and len(played & set(MORE_INSTRUMENTS)) > 40
    years = {int(y) for y in re.findall(r"born in (?:the year )?(\d{4})", text)}
    assert min(years) < 1100 and max(years) > 1900 and len(years) > 300
    people = [e for e in load(out, "entities.jsonl") if e["type"] == "person"]
    assert {e["instrument"] for e in people} <= set(INSTRUMENTS)
    assert all(1780 <= int(e["birth_year"]) <= 1960 for e in people)


def test_world_values_follow_the_knowledge_base_sets():
    """Wrong answer choices and false claims come from the sets the people drew from, so a
    knowledge base with wider sets (the fresh reading people's) offers its own values."""
    from selfrag_jax.world.kb import INSTRUMENTS, MORE_INSTRUMENTS

    world = make_world(5, 60)
    assert world.values("instrument") == list(INSTRUMENTS)
    assert world.values("birth_year") == [str(y) for y in range(1780, 1961)]
    wide = make_world(5, 60, instruments=INSTRUMENTS + MORE_INSTRUMENTS, birth_years=(1000, 1999))
    assert wide.values("instrument") == list(INSTRUMENTS + MORE_INSTRUMENTS)
    assert wide.values("birth_year") == [str(y) for y in range(1000, 2000)]
    assert {p.instrument for p in wide.kb.people} <= set(wide.values("instrument"))


def test_repeat_docs_say_the_same_training_names_twice(built):
    """Only copying predicts a repeat document's second half: random words of the world's
    training names, the same words again."""
    out, manifest = built
    texts = [r["text"] for r in load(out, manifest["repeat"])]
    assert len(texts) == 300
    lines = [t.split("\n") for t in texts]
    assert all(len(ls) == 2 and ls[0] == ls[1] for ls in lines)
    lengths = [len(ls[0].split(" ")) for ls in lines]
    assert min(lengths) >= 10 and max(lengths) <= 40 and len(set(lengths)) > 10
    words = collections.Counter(w for ls in lines for w in ls[0].split(" "))
    assert len(words) > 200 and all(w[:1].isupper() and w.isalpha() for w in words)
    names = {w for e in load(out, "entities.jsonl") if e["split"] != "heldout" for w in e["name"].split()}
    assert set(words) <= names
    starts = [ls[0].split(" ")[:3] for ls in lines]
    assert len({tuple(s) for s in starts}) == len(starts)  # no two documents alike


def test_tokenizer_loads_round_trips_and_keeps_values_identical(built):
    from transformers import AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"))
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert 1000 < len(tok) <= SMALL.vocab_size
    assert "[Relevant]" not in tok.get_vocab()
    samples = [passage_text(p["title"], p["text"]) for p in load(out, "passages.jsonl")[:50]]
    samples += [r["instruction"] + "\n" + r["output"] for r in load(out, "train/generator.jsonl")[:50]]
    for s in samples + ["Ünïcödé and émoji 🙂 survive."]:
        ids = tok(s).input_ids
        assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == s
    pieces = tok.convert_ids_to_tokens(tok("born in 1874", add_special_tokens=False).input_ids)
    assert pieces[-4:] == ["1", "8", "7", "4"]
    entity = next(e for e in load(out, "entities.jsonl") if e["type"] == "person")
    passage = load(out, "passages.jsonl")[int(entity["passage_ids"][0][1:])]["text"]
    for value in (entity["name"].split()[1], entity["birthplace"], entity["occupation"]):
        alone = tok(value, add_special_tokens=False).input_ids
        for context in (f"Where was {value}?", f"]{value}", passage):
            ids = tok(context, add_special_tokens=False).input_ids
            if value in context:
                assert any(ids[i:i + len(alone)] == alone for i in range(len(ids))), (value, context)


def test_world_package_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, selfrag_jax.world; heavy = [m for m in ('jax', 'tokenizers', 'transformers', 'torch') "
            "if m in sys.modules]; print(heavy)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_heldout_wordings_ask_world_qa_in_words_no_training_file_uses(built):
    """world_qa_wordings: world_qa's questions (same people, attributes, answers) in the
    held-out wordings, and no training or critic file holds any of those wordings."""
    from selfrag_jax.world.tasks import HELDOUT_WORDINGS

    out, manifest = built
    qa, reworded = load(out, manifest["eval"]["world_qa"]), load(out, manifest["eval"]["world_qa_wordings"])
    names = {e["id"]: e["name"] for e in load(out, "entities.jsonl")}
    assert len(reworded) == len(qa)
    for i, (a, b) in enumerate(zip(qa, reworded)):
        attribute = a["meta"]["attributes"][0]
        assert b["answers"] == a["answers"] and b["meta"] == a["meta"] and b["question"] != a["question"]
        template = HELDOUT_WORDINGS[attribute][i % len(HELDOUT_WORDINGS[attribute])]
        assert b["question"] == b["instruction"] == template.format(name=names[a["meta"]["entity_ids"][0]])
    name = r"[A-Z][\w']*(?: [A-Z][\w']*)*"  # a capitalised name where the template has {name}
    pattern = re.compile("|".join(re.escape(t).replace(re.escape("{name}"), name)
                                  for ts in HELDOUT_WORDINGS.values() for t in ts))
    for rel in TRAINING_FILES:
        with open(os.path.join(out, rel), encoding="utf-8") as f:
            hit = pattern.search(f.read())
        assert hit is None, f"{hit.group(0)!r} in {rel}"
