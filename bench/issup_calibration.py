"""Does the generator's IsSup mean support, and its IsUse an answer to the question?
p([Fully supported]) for answers a passage states against values it does not state, and the
utility score for the asked value against another value the same passage states, on the
bundled world's held-out questions.

`python -m bench.issup_calibration [--model DIR] [--n 300]` -> bench/results/issup_calibration.json
and issup_calibration.png (a reliability plot).

For each held-out world_qa question: its gold passage (the one that states the asked fact),
then `[Relevant]` and either the stated value (the gold answer) or an invented one (the same
attribute's value from another held-out question, one the passage does not contain), teacher
forced; the generator's next-token distribution over the IsSup group, normalised within the
group as the paper's score reads it (docs/method.md section 5), gives p(Fully supported). AUC
is the chance that a stated answer gets a higher p(Fully supported) than an invented one
(ties count a half). IsUse: the same passage, `[Relevant]`, either the asked value or another
of the person's values that the passage states (a birth year where the birthplace was asked),
then `[Fully supported]`; the utility group's expected weight (-1..1, docs/method.md section 5)
after it, AUC of asked over other. Not a timing: `run_all` does not run it.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, machine_info, now, repo_path, versions, write_result

GOAL_AUC = 0.9


def examples(world: Path, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """(question, passage, answer, stated) pairs: each question with its stated and one invented value."""
    from selfrag_jax.world import read_jsonl

    passages = {p["id"]: p for p in read_jsonl(str(world / "passages.jsonl"))}
    qa = read_jsonl(str(world / "eval" / "world_qa.jsonl"))
    values: dict[str, list[str]] = {}
    for r in qa:
        values.setdefault(r["meta"]["attributes"][0], []).append(r["answers"][0])
    rng = random.Random(seed)
    out = []
    for r in qa[:n]:
        psg = passages[r["meta"]["gold_passage_ids"][0]]
        gold = r["answers"][0]
        pool = sorted({v for v in values[r["meta"]["attributes"][0]] if v != gold and v not in psg["text"]})
        if gold not in psg["text"] or not pool:
            continue
        for answer, stated in ((gold, True), (rng.choice(pool), False)):
            out.append({"id": r["id"], "question": r["question"], "passage": psg, "answer": answer, "stated": stated,
                        "attribute": r["meta"]["attributes"][0]})
    return out


def other_kind_examples(world: Path, n: int) -> list[dict[str, Any]]:
    """(question, passage, answer, asked) pairs: each question with its gold value and another of
    the person's values that the gold passage also states."""
    from selfrag_jax.world import read_jsonl
    from selfrag_jax.world.kb import ATTRIBUTES

    passages = {p["id"]: p for p in read_jsonl(str(world / "passages.jsonl"))}
    people = {e["id"]: e for e in read_jsonl(str(world / "entities.jsonl"))}
    out = []
    for r in read_jsonl(str(world / "eval" / "world_qa.jsonl"))[:n]:
        psg, person, asked = passages[r["meta"]["gold_passage_ids"][0]], people[r["meta"]["entity_ids"][0]], r["meta"]["attributes"][0]
        others = [person[a] for a in ATTRIBUTES if a != asked and person[a] in psg["text"]]
        if r["answers"][0] not in psg["text"] or not others:
            continue
        for answer, is_asked in ((r["answers"][0], True), (others[0], False)):
            out.append({"id": r["id"], "question": r["question"], "passage": psg, "answer": answer, "asked": is_asked,
                        "attribute": asked})
    return out


def group_probs(loaded: tuple, items: list[dict[str, Any]], isuse: bool = False, batch: int = 32) -> np.ndarray:
    """[n, 3] IsSup-group probabilities (normalised in the group) after each teacher-forced
    answer; with `isuse`, [n, 5] utility-group probabilities after the answer and `[Fully
    supported]`. `loaded`: `load_model`'s (config, params, tokenizer, ...), read once per model."""
    import jax
    import jax.numpy as jnp

    from selfrag_jax import tokens as T
    from selfrag_jax.inference.engine import bucket_length
    from selfrag_jax.models.llama import Llama

    config, params, tok = loaded[:3]
    model = Llama(config)
    group = jnp.array(tok.isuse_ids if isuse else tok.issup_ids)
    tail = [tok.control_id(T.FULLY_SUPPORTED)] if isuse else []

    @jax.jit
    def last_group(params, tokens, last):
        logits = model.apply({"params": params}, tokens)[0]
        at = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return jax.nn.softmax(at.astype(jnp.float32), axis=-1)[:, group]

    seqs = [tok.encode_prompt(it["question"]) + tok.encode_passage(it["passage"]["title"], it["passage"]["text"])
            + [tok.control_id(T.ISREL_GROUP[1])] + tok.encode_text(it["answer"]) + tail for it in items]
    out = []
    for start in range(0, len(seqs), batch):
        chunk = seqs[start:start + batch]
        width = bucket_length(max(map(len, chunk)))
        tokens = np.full((batch, width), tok.pad_id, np.int32)
        for i, s in enumerate(chunk):
            tokens[i, :len(s)] = s
        last = np.array([len(s) - 1 for s in chunk] + [0] * (batch - len(chunk)), np.int32)
        probs = np.asarray(last_group(params, tokens, last))[:len(chunk)]
        out.append(probs / probs.sum(-1, keepdims=True))
    return np.concatenate(out)


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a positive scores above a negative), ties a half (Mann-Whitney)."""
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def reliability(p: np.ndarray, stated: np.ndarray, bins: int = 10) -> list[dict[str, Any]]:
    edges = np.linspace(0, 1, bins + 1)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (p >= lo) & ((p < hi) if hi < 1 else (p <= hi))
        if inside.any():
            rows.append({"bin": [float(lo), float(hi)], "n": int(inside.sum()), "mean_p_full": float(p[inside].mean()),
                         "stated_share": float(stated[inside].mean())})
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="calibrated")
    ax.plot([r["mean_p_full"] for r in rows], [r["stated_share"] for r in rows], "o-", label="generator")
    for r in rows:
        ax.annotate(str(r["n"]), (r["mean_p_full"], r["stated_share"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("p(Fully supported)")
    ax.set_ylabel("share of answers the passage states")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from selfrag_jax.bundled import ASSETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ASSETS / "generator"), help="the generator [the shipped one]")
    parser.add_argument("--n", type=int, default=300, help="held-out questions (each: one stated, one invented)")
    parser.add_argument("--work", default="runs/bench_serve", help="where the bundled world is built once")
    parser.add_argument("--name", default="issup_calibration")
    args = parser.parse_args(argv)
    os.environ.setdefault("SELFRAG_NO_PROGRESS", "1")
    world = Path(args.work) / "world"
    if not (world / "eval" / "world_qa.jsonl").exists():
        from selfrag_jax.demo.pipeline import Stages

        Stages(Path(args.work), log=lambda *_: None).world(training=False)
    from selfrag_jax.models.checkpoint import load_model
    from selfrag_jax.tokens import UTILITY_WEIGHTS

    loaded = load_model(args.model)
    items = examples(world, args.n)
    probs = group_probs(loaded, items)
    stated = np.array([it["stated"] for it in items])
    full, score = probs[:, 0], probs[:, 0] + 0.5 * probs[:, 1]
    result_auc, score_auc = auc(full[stated], full[~stated]), auc(score[stated], score[~stated])
    attribute = np.array([it["attribute"] for it in items])
    by_attr = {a: auc(full[stated & (attribute == a)], full[~stated & (attribute == a)]) for a in sorted(set(attribute))}
    rows = reliability(full, stated)
    kinds = other_kind_examples(world, args.n)
    use = group_probs(loaded, kinds, isuse=True) @ np.asarray(UTILITY_WEIGHTS)
    asked = np.array([it["asked"] for it in kinds])
    use_auc = auc(use[asked], use[~asked])
    png = RESULTS / f"{args.name}.png"
    plot(rows, png, f"IsSup of {Path(args.model).name}: AUC {result_auc:.3f}, n={len(items)}")
    summary = [{"what": "IsSup: p(Fully supported), answers the passage states vs invented values (AUC)",
                "ours": f"{result_auc:.3f}", "peer": f"n={len(items)}", "ratio": None,
                "goal": f">= {GOAL_AUC}", "met": result_auc >= GOAL_AUC},
               {"what": "IsUse: utility score, the asked value vs another value the passage states (AUC)",
                "ours": f"{use_auc:.3f}", "peer": f"n={len(kinds)}", "ratio": None, "goal": None, "met": None}]
    result = {"machine": machine_info(), "versions": versions(), "model": repo_path(args.model), "n": len(items),
              "auc_p_full": result_auc, "auc_paper_sup_score": score_auc, "auc_by_attribute": by_attr,
              "mean_p_full": {"stated": float(full[stated].mean()), "invented": float(full[~stated].mean())},
              "share_full_argmax": {"stated": float((probs[stated].argmax(1) == 0).mean()),
                                    "invented": float((probs[~stated].argmax(1) == 0).mean())},
              "reliability": rows, "plot": png.name,
              "isuse": {"n": len(kinds), "auc_use_score": use_auc,
                        "mean_use_score": {"asked": float(use[asked].mean()), "other": float(use[~asked].mean())}},
              "summary": summary, "date": now()}
    path = write_result(args.name, result)
    print(f"AUC p(Fully supported) stated vs invented: {result_auc:.3f} (paper's sup score {score_auc:.3f}); "
          f"mean p_full stated {full[stated].mean():.3f}, invented {full[~stated].mean():.3f}; by attribute "
          + ", ".join(f"{a} {v:.2f}" for a, v in by_attr.items())
          + f"; IsUse AUC asked vs other value {use_auc:.3f} (mean use {use[asked].mean():.2f} vs {use[~asked].mean():.2f})"
          + f"; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
