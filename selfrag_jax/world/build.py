"""`build_world`: writes the whole bundled world to a folder, deterministically.

Same seed and options -> byte-identical files (no timestamps, fixed key order, one seeded
random stream per product). `manifest.json` is written last, so a folder with a manifest
is complete; it lists every file with its record count and sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass, field, replace

from .core import World, make_world
from .critic_data import INSTRUCTIONS, make_critic_records
from .generator_data import GeneratorConfig, make_generator_example
from .kb import KnowledgeBase
from .passages import write_jsonl
from .pretrain import PretrainConfig, anneal_texts, pretrain_texts, relevance_texts, repeat_texts
from .tasks import HELDOUT_WORDINGS, QUESTIONS, REFUSAL, Task, TaskMaker
from .tokenizer import train_tokenizer
from .unanswerable import unanswerable_sets

# Share of each task kind in the generator and raw instruction data.
TASK_MIX = {
    "qa": 0.40, "pair_qa": 0.07, "factcheck": 0.10, "mc": 0.10, "longform": 0.06, "compare": 0.03,
    "no_retrieval": 0.19, "unanswerable": 0.05,
}


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    n_people: int = 2000
    n_ghosts: int = 400
    heldout_fraction: float = 0.15
    n_generator: int = 6000
    n_raw: int = 2000
    n_critic_per_type: int = 500
    # The practice people: a separate knowledge base that appears in no pretraining text, so
    # examples about them can only be answered by reading (examples about memorised people
    # teach a generator to answer from memory). Their passages form a second corpus that
    # annotation retrieves from; the tokenizer never sees them.
    n_practice_people: int = 1500
    n_raw_practice: int = 2000
    # More critic labels about practice people than about the world's: IsRel and IsSup are
    # learnt by reading, not recall (docs/experiments/default-models.md, "What changed from v5").
    n_critic_practice_per_type: int = 2500
    vocab_size: int = 3000
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    eval_qa_per_person: int = 2
    n_eval_factcheck: int = 300
    n_eval_mc: int = 300
    n_eval_longform: int = 100
    n_eval_no_retrieval: int = 200


def world_of(cfg: WorldConfig) -> World:
    """The knowledge base and passages that `build_world(config=cfg)` writes."""
    return make_world(cfg.seed, cfg.n_people, n_ghosts=cfg.n_ghosts, heldout_fraction=cfg.heldout_fraction)


def sample_tasks(maker: TaskMaker, n: int, rng: random.Random) -> list[Task]:
    """n tasks drawn by TASK_MIX."""
    kinds, weights = list(TASK_MIX), list(TASK_MIX.values())
    return [getattr(maker, k)() for k in rng.choices(kinds, weights, k=n)]


def eval_record(task: Task) -> dict:
    """The released eval layout: question and answers (+ choices/answerKey for multiple
    choice); `instruction` is the full generator instruction as training formats it."""
    rec = {"id": task.id, "question": task.extra["question"], "answers": task.answers,
           "instruction": task.instruction}
    if task.kind == "mc":
        rec["choices"], rec["answerKey"] = task.extra["choices"], task.extra["answerKey"]
    if task.kind == "unanswerable":
        rec["answerable"] = False
    rec["meta"] = {"kind": task.kind, "entity_ids": task.entity_ids, "attributes": task.attributes,
                   "gold_passage_ids": task.gold_passage_ids}
    return rec


def eval_sets(world: World, cfg: WorldConfig) -> dict[str, list[dict]]:
    """Eval tasks about held-out people (and name-only people whose mention is in a held-out
    passage), none of which appears in any training file."""
    rng = random.Random(cfg.seed * 31337 + 11)
    m = TaskMaker(world, "heldout", rng, prefix="world")
    attrs = list(QUESTIONS)
    qa = [m.qa(p, a) for p in m.people for a in rng.sample(attrs, cfg.eval_qa_per_person)]
    fc = [m.factcheck(truth=i % 2 == 0) for i in range(cfg.n_eval_factcheck)]
    mc = [m.mc() for _ in range(cfg.n_eval_mc)]
    lf = [m.longform(p) for p in rng.sample(m.people, min(cfg.n_eval_longform, len(m.people)))]
    un = [m.unanswerable(g) for g in m.ghosts for _ in range(2)]
    kinds = ("copy", "reverse", "count", "sum")
    nr = [m.no_retrieval(kinds[i % 4]) for i in range(cfg.n_eval_no_retrieval)]
    # world_qa_dev: the held-out people's attributes that world_qa does not ask, for choosing
    # test-time knobs (the demo's retriever-prior weight) without looking at world_qa. Its own
    # generator, so the sets above are unchanged.
    asked = {(t.entity_ids[0], t.attributes[0]) for t in qa}
    dev_maker = TaskMaker(world, "heldout", random.Random(cfg.seed * 31337 + 29), prefix="world_dev")
    dev = [dev_maker.qa(p, a) for p in dev_maker.people for a in attrs if (p.id, a) not in asked]
    sets = {"world_qa": qa, "world_factcheck": fc, "world_mc": mc, "world_longform": lf,
            "world_unanswerable": un, "world_noretrieval": nr, "world_qa_dev": dev}
    out = {name: [eval_record(t) for t in tasks] for name, tasks in sets.items()}
    names = {p.id: p.name for p in m.people}
    out["world_qa_wordings"] = [reworded(r, names[t.entity_ids[0]], i) for i, (r, t) in enumerate(zip(out["world_qa"], qa))]
    out.update({f"unanswerable/{name}": recs for name, recs in unanswerable_sets(world, cfg.seed).items()})
    return out


def reworded(record: dict, name: str, i: int) -> dict:
    """A world_qa record about `name` asked in a held-out wording (`HELDOUT_WORDINGS`, the i-th in turn)."""
    templates = HELDOUT_WORDINGS[record["meta"]["attributes"][0]]
    question = templates[i % len(templates)].format(name=name)
    return {**record, "id": record["id"].replace("world_heldout_qa", "world_wordings_qa"), "question": question,
            "instruction": question}


def entity_records(world: World) -> list[dict]:
    """The ground truth knowledge base, one record per entity."""
    recs = []
    for p in world.kb.people:
        recs.append({"id": p.id, "type": "person", "name": p.name, "split": p.split,
                     **{a: p.value(a) for a in ("birthplace", "birth_year", "occupation", "employer", "instrument")},
                     "passage_ids": [x.id for x in world.by_entity[p.id]]})
    for g in world.kb.ghosts:
        recs.append({"id": g.id, "type": "name_only", "name": g.name, "split": g.split,
                     "mentioned_by": g.student_id, "passage_ids": []})
    for pl in world.kb.places:
        recs.append({"id": pl.id, "type": "place", "name": pl.name, "split": "train", "province": pl.province,
                     "river": pl.river, "founded": str(pl.founded), "passage_ids": [x.id for x in world.by_entity[pl.id]]})
    for o in world.kb.orgs:
        recs.append({"id": o.id, "type": "organisation", "name": o.name, "split": "train", "town": o.town,
                     "founded": str(o.founded), "passage_ids": [x.id for x in world.by_entity[o.id]]})
    return recs


def practice_world(cfg: WorldConfig, world: World) -> World:
    """The practice people's world (every person "train"), passage ids prefixed `p`. People
    or ghosts whose first or last name is a word of the main world's people or ghosts are
    dropped, so held-out names stay unseen by every training file."""
    full = make_world(cfg.seed + 2_000_003, cfg.n_practice_people, n_ghosts=cfg.n_practice_people // 5,
                      heldout_fraction=0.0)
    taken = {part for x in (*world.kb.people, *world.kb.ghosts) for part in (x.first, x.last)}
    ghosts = [g for g in full.kb.ghosts if not {g.first, g.last} & taken]
    named = {g.name for g in ghosts}
    people = [p for p in full.kb.people if not {p.first, p.last} & taken and (not p.mentor or p.mentor in named)]
    keep = {p.id for p in people}
    kb = KnowledgeBase(full.kb.seed, people, full.kb.places, full.kb.orgs, [g for g in ghosts if g.student_id in keep],
                       full.kb.instruments, full.kb.birth_years)
    return World(kb, [replace(p, id="p" + p.id) for p in full.passages
                      if p.entity_id in keep or not p.entity_id.startswith("person-")])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_training_data(world: World, cfg: WorldConfig, out_dir: str, put) -> dict:
    """The training files (generator, raw pairs, practice people, critic, pretraining text) and
    the tokenizer; returns their manifest entries."""
    rng = random.Random(cfg.seed * 7 + 1)
    gen = [make_generator_example(world, t, rng, cfg.generator)
           for t in sample_tasks(TaskMaker(world, "train", rng, prefix="gen"), cfg.n_generator, rng)]
    put("train/generator.jsonl", (e.record for e in gen))
    put("train/generator_meta.jsonl", (e.meta for e in gen))

    rng = random.Random(cfg.seed * 7 + 2)
    raw = sample_tasks(TaskMaker(world, "train", rng, prefix="raw"), cfg.n_raw, rng)
    put("train/raw.jsonl", (t.record() for t in raw))
    put("train/raw_meta.jsonl", (t.meta() for t in raw))

    practice = practice_world(cfg, world)
    put("train/practice_passages.jsonl", (p.record() for p in practice.passages))
    rng = random.Random(cfg.seed * 7 + 3)
    raw_practice = sample_tasks(TaskMaker(practice, "train", rng, prefix="praw"), cfg.n_raw_practice, rng)
    put("train/practice_raw.jsonl", (t.record() for t in raw_practice))
    put("train/practice_raw_meta.jsonl", (t.meta() for t in raw_practice))

    # The critic data twice: in the paper's form, and in the reading form the critic_reading
    # stage continues on (short-answer IsSup targets with an `Answer:` line before the label,
    # plus choice-letter and verdict IsSup examples without one: critic_data's docstring).
    for rel, reading in (("train/critic.jsonl", False), ("train/critic_reading.jsonl", True)):
        put(rel, make_critic_records(world, cfg.n_critic_per_type, cfg.seed, issup_reading=reading)
            + make_critic_records(practice, cfg.n_critic_practice_per_type, cfg.seed + 1, id_prefix="critic_practice",
                                  issup_reading=reading))
    pretrain = list(pretrain_texts(world, cfg.seed, cfg.pretrain))
    put("pretrain.jsonl", ({"text": t} for t in pretrain))
    put("anneal.jsonl", ({"text": t} for t in anneal_texts(world, cfg.seed, cfg.pretrain)))
    put("relevance.jsonl", ({"text": t} for t in relevance_texts(world, cfg.seed, cfg.pretrain)))
    put("relevance_forms.jsonl", ({"text": t} for t in relevance_texts(world, cfg.seed, cfg.pretrain, all_forms=True)))
    put("repeat.jsonl", ({"text": t} for t in repeat_texts(world, cfg.seed, cfg.pretrain)))

    # The tokenizer sees training text only: held-out names stay unseen by every trained part.
    tok_texts = pretrain + [f"{t.instruction}\n{t.answer}" for t in raw] + list(INSTRUCTIONS.values())
    train_tokenizer(tok_texts, os.path.join(out_dir, "tokenizer"), cfg.vocab_size)
    return {"pretrain": "pretrain.jsonl", "anneal": "anneal.jsonl", "relevance": "relevance.jsonl", "relevance_forms": "relevance_forms.jsonl", "repeat": "repeat.jsonl", "generator": "train/generator.jsonl", "raw": "train/raw.jsonl",
            "practice": {"passages": "train/practice_passages.jsonl", "raw": "train/practice_raw.jsonl",
                         "people": len(practice.kb.people)},
            "critic": "train/critic.jsonl", "critic_reading": "train/critic_reading.jsonl", "tokenizer": "tokenizer"}


TOKENIZER_FILES = ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "tokenizer/special_tokens_map.json")


def build_world(out_dir: str, seed: int = 0, n_people: int = 2000, config: WorldConfig | None = None,
                training: bool = True) -> dict:
    """Writes passages, entities, eval sets and (with `training`) the training data and a
    tokenizer under `out_dir`; returns the manifest (relative paths). `training=False` is the
    demo's world: what evaluation reads, without the minute the pretraining text takes."""
    cfg = config or WorldConfig(seed=seed, n_people=n_people)
    world = world_of(cfg)
    os.makedirs(out_dir, exist_ok=True)
    counts: dict[str, int] = {}

    def put(rel: str, records) -> None:
        counts[rel] = write_jsonl(os.path.join(out_dir, rel), records)

    put("passages.jsonl", (p.record() for p in world.passages))
    put("entities.jsonl", entity_records(world))
    for name, recs in eval_sets(world, cfg).items():
        put(f"eval/{name}.jsonl", recs)
    training_entries = write_training_data(world, cfg, out_dir, put) if training else {}

    files = {}
    for rel in [*counts, *(TOKENIZER_FILES if training else ())]:
        path = os.path.join(out_dir, rel)
        files[rel] = {"records": counts.get(rel), "bytes": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {
        "world": "selfrag_jax.world", "seed": cfg.seed, "config": asdict(cfg), "refusal": REFUSAL,
        "splits": {"train_people": len(world.kb.train_people), "heldout_people": len(world.kb.heldout_people),
                   "name_only": len(world.kb.ghosts), "places": len(world.kb.places), "organisations": len(world.kb.orgs),
                   "passages": len(world.passages)},
        "passages": "passages.jsonl", "entities": "entities.jsonl", **training_entries,
        "eval": {n: f"eval/{n}.jsonl" for n in ("world_qa", "world_factcheck", "world_mc", "world_longform",
                                                  "world_unanswerable", "world_noretrieval", "world_qa_dev",
                                                  "world_qa_wordings")},
        "unanswerable": {n: f"eval/unanswerable/{n}.jsonl" for n in unanswerable_sets(world, cfg.seed)},
        "files": files, "total_bytes": sum(f["bytes"] for f in files.values()),
    }
    tmp = os.path.join(out_dir, "manifest.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m selfrag_jax.world", description="write the bundled Self-RAG world")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-people", type=int, default=2000)
    args = ap.parse_args(argv)
    m = build_world(args.out_dir, args.seed, args.n_people)
    print(json.dumps({"out_dir": args.out_dir, "total_bytes": m["total_bytes"], "splits": m["splits"]}))
    return 0
