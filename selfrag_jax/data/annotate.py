"""`selfrag-jax annotate`: the critic turns instruction-output pairs into generator data.

The paper's offline pipeline (docs/method.md section 4), batched stage by stage so every
critic call of a stage shares compiled programs:
1. Retrieve (input only): does the instruction need evidence?
2. For those that do, split the output into sentences and retrieve the top passages for
   `instruction + " " + sentence`.
3. IsRel and IsSup for every (sentence, passage); keep per sentence the first passage that
   is Relevant and Fully supported, else Relevant and Partially supported, else Relevant,
   else the top passage (written as `[Irrelevant]`, with no IsSup token). With
   `irrelevant_share` > 0, that share of sentences instead keeps the best-ranked passage the
   critic calls Irrelevant, when there is one: the reference's rule writes `[Irrelevant]` only
   when retrieval failed, which in a small corpus with a strong retriever is almost never
   (40 of 3,600 segments in the bundled world), so the generator never saw the negative class.
4. Retrieve (per sentence) for later sentences: `[Continue to Use Evidence]` keeps the
   previous passage instead of retrieving again.
5. IsUse for the whole output, written once at the end.
The critic writes labels as text; they are mapped to tokens robustly (exact label string,
then yes/no and digits), and anything unreadable falls back to a safe default that is
counted in the report.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.data.critic_prompts import (
    INSTRUCTIONS, LABELS, isrel_input, issup_input, isuse_input, retrieve_input, retrieve_sentence_input,
)

SAFE_DEFAULT = {"retrieve_input": T.RETRIEVAL, "retrieve_sentence": T.RETRIEVAL, "isrel": T.IRRELEVANT,
                "issup": T.NO_SUPPORT, "isuse": "[Utility:3]"}


def read_support(text: str, output: str) -> str | None:
    """IsSup decided from the critic's reading (beyond the paper; the world's
    critic data): each comma-separated value of the output is supported when the critic's
    `Answer:` line states it (SQuAD-normalised); all -> Fully, some -> Partially, none -> No
    support. None when the critic wrote no `Answer:` line (sentences, or a critic trained
    without them)."""
    from selfrag_jax.metrics import normalize_answer

    found = re.search(r"Answer:([^\n]*)", text)
    if found is None:
        return None
    read = {normalize_answer(v) for v in found.group(1).split(",")} - {normalize_answer(T.REFUSAL), ""}
    values = [normalize_answer(v) for v in output.split(",")]
    hits = sum(v in read for v in values)
    return T.FULLY_SUPPORTED if hits == len(values) else T.PARTIALLY_SUPPORTED if hits else T.NO_SUPPORT


def parse_label(kind: str, text: str, output: str | None = None) -> str | None:
    """The critic's free text -> one of the type's label strings, or None if unreadable.
    For IsSup with the output given, a reading line decides (`read_support`)."""
    if kind == "issup" and output is not None and (read := read_support(text, output)) is not None:
        return read

    labels = LABELS[kind]
    for label in sorted(labels, key=len, reverse=True):
        if label in text:
            return label
    low = text.strip().lower()
    if kind == "isuse":
        digit = re.search(r"[1-5]", low)
        return f"[Utility:{digit.group()}]" if digit else None
    if low.startswith("yes"):
        return {"retrieve_input": T.RETRIEVAL, "retrieve_sentence": T.RETRIEVAL, "isrel": T.RELEVANT,
                "issup": T.FULLY_SUPPORTED}[kind]
    if low.startswith("no"):
        return {"retrieve_input": T.NO_RETRIEVAL, "retrieve_sentence": T.NO_RETRIEVAL, "isrel": T.IRRELEVANT,
                "issup": T.NO_SUPPORT}[kind]
    for word, label in (("no support", T.NO_SUPPORT), ("contradict", T.NO_SUPPORT), ("fully", T.FULLY_SUPPORTED),
                        ("partial", T.PARTIALLY_SUPPORTED), ("irrelevant", T.IRRELEVANT),
                        ("relevant", T.RELEVANT), ("continue", T.CONTINUE_EVIDENCE)):
        if word in low:
            return label if label in labels else None
    return None


def split_sentences(text: str) -> list[str]:
    parts = [p.strip() for p in re.split(r"(?<=[.!?])\s+", text.strip())]
    return [p for p in parts if p] or [text]


@dataclass
class Critic:
    """Greedy label generation with a critic checkpoint, batched and length-bucketed."""

    params: Any
    config: Any
    tokenizer: Any
    batch_size: int = 64
    max_new_tokens: int = 40  # "[No support / Contradictory]" as plain text is 18 pieces, a reading line up to ~15 more
    calls: dict[str, int] = field(default_factory=dict)

    def generate(self, prompts: Sequence[str], desc: str = "critic") -> list[str]:
        import jax.numpy as jnp

        from selfrag_jax.inference.decode import greedy_generate, pad_batch
        from selfrag_jax.models.params import for_decoding
        from selfrag_jax.utils import progress

        # decoding runs unscanned layers: a scanned checkpoint is split here, not in every batch's program
        params, config = for_decoding(self.params, self.config)
        tok = self.tokenizer
        encoded = [([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_text(p) for p in prompts]
        limit = config.max_position_embeddings - self.max_new_tokens
        encoded = [e[-limit:] for e in encoded]  # keep the end: the output and evidence sit there
        order = np.argsort([len(e) for e in encoded], kind="stable")
        out: list[str] = [""] * len(prompts)
        stop = jnp.array([tok.eos_id])
        for start in progress(range(0, len(order), self.batch_size), desc=desc, unit="batch"):  # annotation: minutes
            rows = order[start: start + self.batch_size]
            batch = [encoded[i] for i in rows]
            width = -(-max(len(b) for b in batch) // 64) * 64  # length buckets of 64: few programs
            batch += [[tok.pad_id]] * (self.batch_size - len(batch))  # fixed row count
            ids, lengths = pad_batch(batch, tok.pad_id, width)
            gen, counts = greedy_generate(params, config, ids, lengths, self.max_new_tokens, stop,
                                          pad_id=tok.pad_id)
            gen, counts = np.asarray(gen), np.asarray(counts)
            for j, i in enumerate(rows):
                out[i] = tok.decode(gen[j, : counts[j]])
        return out

    def label(self, kind: str, inputs: Sequence[str], report: dict[str, Any],
              outputs: Sequence[str] | None = None) -> list[str]:
        """One label per input; for IsSup, `outputs` (the sentences judged) let a critic
        trained with reading lines decide by `read_support`."""
        if not inputs:
            return []
        prompts = [T.CRITIC_PROMPT.format(instruction=INSTRUCTIONS[kind], input=x) for x in inputs]
        labels = []
        for j, text in enumerate(self.generate(prompts, desc=f"critic {kind}")):
            label = parse_label(kind, text, outputs[j] if outputs is not None else None)
            if label is None:
                report["defaults"][kind] = report["defaults"].get(kind, 0) + 1
                label = SAFE_DEFAULT[kind]
            report["labels"].setdefault(kind, {}).setdefault(label, 0)
            report["labels"][kind][label] += 1
            labels.append(label)
        return labels


def annotate(records: list[dict], critic: Critic, retriever, ndocs: int = 3, irrelevant_share: float = 0.0,
             seed: int = 0) -> tuple[list[dict], dict]:
    """Annotated generator records (same ids) and a report of the critic's decisions."""
    if not 0.0 <= irrelevant_share <= 1.0:
        raise ValueError(f"irrelevant_share must be in [0, 1], got {irrelevant_share}")

    report: dict[str, Any] = {"records": len(records), "labels": {}, "defaults": {}}
    task = [r["instruction"] + (("\n\n" + r["input"]) if r.get("input") else "") for r in records]
    need = critic.label("retrieve_input", [retrieve_input(t) for t in task], report)
    sentences = [split_sentences(r["output"]) if n == T.RETRIEVAL else [] for r, n in zip(records, need)]

    # Retrieval for every (record, sentence), then IsRel and IsSup for every passage.
    keys = [(i, s) for i, sents in enumerate(sentences) for s in range(len(sents))]
    hits = retriever.retrieve([records[i]["instruction"] + " " + sentences[i][s] for i, s in keys], ndocs) if keys else []
    pairs = [(i, s, h) for (i, s), hs in zip(keys, hits) for h in hs]
    evidence = [T.passage_text(h["title"], h["text"]) for _, _, h in pairs]
    rel = critic.label("isrel", [isrel_input(task[i], ev) for (i, _, _), ev in zip(pairs, evidence)], report)
    sup = critic.label("issup", [issup_input(task[i], " ".join(sentences[i][:s]), sentences[i][s], ev)
                                 for (i, s, _), ev in zip(pairs, evidence)], report,
                       outputs=[sentences[i][s] for i, s, _ in pairs])
    rank = {T.FULLY_SUPPORTED: 0, T.PARTIALLY_SUPPORTED: 1, T.NO_SUPPORT: 2}
    chosen: dict[tuple[int, int], tuple[dict, str, str, tuple[int, int]]] = {}
    for (i, s, h), r_lab, s_lab in zip(pairs, rel, sup):
        score = (0, rank[s_lab]) if r_lab == T.RELEVANT else (1, 3)
        if (i, s) not in chosen or score < chosen[(i, s)][3]:
            chosen[(i, s)] = (h, r_lab, s_lab, score)
    if irrelevant_share:
        first_irrelevant: dict[tuple[int, int], dict] = {}
        for (i, s, h), r_lab in zip(pairs, rel):  # pairs are in rank order
            if r_lab == T.IRRELEVANT:
                first_irrelevant.setdefault((i, s), h)
        draw = np.random.default_rng(seed).random(len(keys)) < irrelevant_share
        for key, negative in zip(keys, draw):
            if negative and key in first_irrelevant:
                chosen[key] = (first_irrelevant[key], T.IRRELEVANT, T.NO_SUPPORT, (1, 3))
    report["irrelevant_segments"] = sum(v[1] == T.IRRELEVANT for v in chosen.values())

    # Later sentences: keep using the previous passage when the critic says so.
    later = [(i, s) for i, s in keys if s > 0]
    prev_ev = [T.passage_text(chosen[(i, s - 1)][0]["title"], chosen[(i, s - 1)][0]["text"]) for i, s in later]
    cont = critic.label("retrieve_sentence", [
        retrieve_sentence_input(task[i], " ".join(sentences[i][:s]), ev, sentences[i][s])
        for (i, s), ev in zip(later, prev_ev)], report)
    continue_at = {k for k, lab in zip(later, cont) if lab == T.CONTINUE_EVIDENCE}

    use = critic.label("isuse", [isuse_input(t, r["output"]) for t, r in zip(task, records)], report)
    out = []
    for i, r in enumerate(records):
        if not sentences[i]:
            body = T.NO_RETRIEVAL + r["output"]
        else:
            body = ""
            for s, sentence in enumerate(sentences[i]):
                gap = " " if s else ""
                if (i, s) in continue_at:
                    body += T.CONTINUE_EVIDENCE + gap + sentence
                    continue
                h, r_lab, s_lab, _ = chosen[(i, s)]
                body += (T.RETRIEVAL + T.PARAGRAPH_OPEN + T.passage_text(h["title"], h["text"]) + T.PARAGRAPH_CLOSE
                         + r_lab + gap + sentence + (s_lab if r_lab == T.RELEVANT else ""))
        out.append({"instruction": r["instruction"], "input": r.get("input", ""), "output": body + use[i],
                    "id": r.get("id", str(i)), "dataset_name": r.get("dataset_name", r.get("type", ""))})
    report["retrieval_rate"] = float(np.mean([n == T.RETRIEVAL for n in need])) if need else 0.0
    return out, report


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--critic", required=True, help="critic checkpoint (run folder, step folder or model folder)")
    parser.add_argument("--input", required=True, help="JSON lines of {instruction, input?, output, id?}")
    parser.add_argument("--index", required=True, help="index folder (selfrag-jax index build)")
    parser.add_argument("--out", required=True, help="generator training data (JSON lines)")
    parser.add_argument("--ndocs", type=int, default=3, help="passages per sentence [3]")
    parser.add_argument("--batch-size", type=int, default=64, help="critic rows per call [64]")
    parser.add_argument("--irrelevant-share", type=float, default=0.0,
                        help="share of sentences that keep a passage the critic calls irrelevant, when one "
                             "was retrieved, so the generator learns [Irrelevant] [0]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --irrelevant-share draw [0]")


def read_pairs(path: str) -> list[dict]:
    from selfrag_jax.data.records import iter_records

    return [rec for _, rec in iter_records(path, "generator")]


def run(args: argparse.Namespace) -> int:
    from selfrag_jax.models.checkpoint import load_model
    from selfrag_jax.retrieval.retriever import Retriever
    from selfrag_jax.utils import atomic_file

    records = read_pairs(args.input)
    config, params, tok, _ = load_model(args.critic)
    critic = Critic(params, config, tok, batch_size=args.batch_size)
    out, report = annotate(records, critic, Retriever.from_dir(args.index), ndocs=args.ndocs,
                           irrelevant_share=args.irrelevant_share, seed=args.seed)
    with atomic_file(args.out) as f:
        for rec in out:
            f.write(json.dumps(rec) + "\n")
    Path(str(args.out) + ".report.json").write_text(json.dumps(report, indent=2))
    print(f"annotated {len(out)} records -> {args.out}; retrieval rate {report['retrieval_rate']:.2f}; "
          f"unreadable critic outputs: {report['defaults'] or 'none'}")
    return 0
