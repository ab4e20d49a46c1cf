"""Can the base model read? The question Self-RAG fine-tuning depends on.

Self-RAG fine-tunes a pretrained model that can already copy an answer out of a passage; a
model that only memorised its training people cannot, and no amount of generator training
teaches it (`docs/tiny-models.md`). This probe asks the held-out people's
factual questions with their gold passage in the pretraining format
(`title\\ntext\\n\\nQuestion: q\\nAnswer: `, the trailing space included: the world's
tokenizer glues it to the colon), decodes greedily and scores with the released match. The
same questions without the passage give the closed-book floor.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.world.pretrain import RELEVANCE_FORMS as PRETRAIN_RELEVANCE_FORMS
from selfrag_jax.world.pretrain import qa_text


def reading_prompts(world_dir: str | Path, n: int = 200, with_attributes: bool = False) -> tuple:
    """(prompts with the gold passage, the same prompts without it, gold answers) of the
    first `n` held-out factual questions, and each question's attribute if asked."""
    world = Path(world_dir)
    with open(world / "passages.jsonl") as f:
        passages = {p["id"]: p for p in map(json.loads, f)}
    with open(world / "eval" / "world_qa.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    closed = [qa_text(r["question"], "") for r in records]
    gold = [passages[r["meta"]["gold_passage_ids"][0]] for r in records]
    reading = [T.passage_text(g["title"], g["text"]) + "\n\n" + c for g, c in zip(gold, closed)]
    answers = [r["answers"] for r in records]
    if with_attributes:
        return reading, closed, answers, ["+".join(r["meta"]["attributes"]) for r in records]
    return reading, closed, answers


def _greedy_lines(model, prompts: list[str], batch_size: int, max_new_tokens: int) -> list[str]:
    """The first line each prompt's greedy continuation gives; `model` = (config, params, tok)."""
    from selfrag_jax.inference.decode import greedy_generate, pad_batch

    config, params, tok = model
    stop = jnp.asarray(sorted({tok.eos_id, *tok.encode_text("\n")[-1:]}), jnp.int32)  # an answer is one line
    lines = []
    for start in range(0, len(prompts), batch_size):
        tokens, lengths = pad_batch([[tok.bos_id, *tok.encode_text(p)] for p in prompts[start:start + batch_size]],
                                    tok.eos_id)
        new, _ = greedy_generate(params, config, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens,
                                 stop, tok.eos_id)
        lines += [tok.decode(row[row != tok.eos_id]).strip().split("\n")[0] for row in np.asarray(new)]
    return lines


@partial(jax.jit, static_argnames=("config",))
def _last_logprobs(params, config, tokens, lengths):
    """Next-token log-probabilities at each row's last real position only: [B, V] float32."""
    from selfrag_jax.models.llama import Llama

    model = Llama(config)
    hidden, _ = model.apply({"params": params}, tokens, return_hidden=True)
    return jax.nn.log_softmax(model.apply({"params": params}, hidden, lengths, method=Llama.last_logits), -1)


def next_token_logprobs(model, prompts: list[str], token_id: int, batch_size: int = 50) -> np.ndarray:
    """log p(`token_id`) as the next token after each prompt: one forward pass per batch, rows
    right-padded (causal attention never sees the padding) to the engine's length buckets so a
    few shapes compile."""
    from selfrag_jax.inference.decode import pad_batch
    from selfrag_jax.inference.engine import bucket_length

    config, params, tok = model
    out = []
    for start in range(0, len(prompts), batch_size):
        rows = [[tok.bos_id, *tok.encode_text(p)] for p in prompts[start:start + batch_size]]
        tokens, lengths = pad_batch(rows, tok.eos_id, bucket_length(max(map(len, rows))))
        out.append(np.asarray(_last_logprobs(params, config, jnp.asarray(tokens), jnp.asarray(lengths))[:, token_id]))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def auc(negatives, positives) -> float:
    """P(a positive scores above a negative), ties counted half: 0.5 is no separation."""
    a, b = np.asarray(negatives, np.float64)[None], np.asarray(positives, np.float64)[:, None]
    if not a.size or not b.size:
        return float("nan")
    return float((b > a).mean() + 0.5 * (b == a).mean())


def probe_model(model):
    """(config, params, tokenizer) of a checkpoint folder; an already loaded triple as it is,
    so a caller probing one model several ways reads it once."""
    if isinstance(model, tuple):
        return model
    from selfrag_jax.models.checkpoint import load_model

    config, params, tok, _ = load_model(model)
    return config, params, tok


def reading_accuracy(model_dir: str | Path | tuple, world_dir: str | Path, n: int = 200, batch_size: int = 50,
                     max_new_tokens: int = 12) -> dict:
    """{"with_passage": match rate, "closed_book": match rate, "n": questions, "examples": [...],
    "by_attribute": {attribute: with-passage match rate}}. The breakdown is there because
    bases fail by attribute: one that read 0.62 overall copied birthplaces, employers and
    occupations (0.99-1.00) but not birth years (0.01: the century's digits, a wrong last one)
    or instruments (0.11: one instrument for all)."""
    from selfrag_jax.metrics import match

    model = probe_model(model_dir)
    reading, closed, answers, attributes = reading_prompts(world_dir, n, with_attributes=True)
    out: dict = {"n": len(answers), "examples": []}
    for key, prompts in (("with_passage", reading), ("closed_book", closed)):
        texts = _greedy_lines(model, prompts, batch_size, max_new_tokens)
        hits = [match(t, g) for t, g in zip(texts, answers)]
        out[key] = sum(hits) / max(len(prompts), 1)
        if key == "with_passage":
            out["examples"] = [{"prompt_tail": p[-60:], "answer": t, "gold": g}
                               for p, t, g in list(zip(prompts, texts, answers))[:5]]
            by: dict[str, list[bool]] = {}
            for a, h in zip(attributes, hits):
                by.setdefault(a, []).append(bool(h))
            out["by_attribute"] = {a: sum(v) / len(v) for a, v in sorted(by.items())}
    return out


# The orders a relevance probe asks in: the relevance documents' first two forms (their own
# order, and the critic's IsRel input fields), ending at the answer cue: a base can match
# names in one form and not the other (docs/experiments/default-models.md).
RELEVANCE_FORMS = {name: form.format(q="{q}", p="{p}", a="")
                   for name, form in zip(("question", "evidence"), PRETRAIN_RELEVANCE_FORMS)}


def relevance_accuracy(model_dir: str | Path | tuple, world_dir: str | Path, n: int = 200, batch_size: int = 50,
                       max_new_tokens: int = 12, forms: dict[str, str] = RELEVANCE_FORMS) -> dict:
    """Does the base model match the question's name to the passage's, question first (the
    order of the critic's and the generator's input)? Held-out factual questions, each once
    with its gold passage, once with a look-alike's and once with another passage of the
    person's that lacks the asked fact (where they have one), in each of `forms`: {form:
    {"answered_own": match rate with the gold passage, "refused_own", "refused_lookalike",
    "refused_lacking": rates of T.REFUSAL, "refusal_auc": P(p(T.REFUSAL) is higher after a
    look-alike's passage than after the gold one)}}. The rates are greedy and a base unsure of
    the name refuses both alike (0.92 vs 0.84 for one that did not match names at all); the
    AUC of T.REFUSAL's first-token probability shows matching before it moves the argmax."""
    import random

    from selfrag_jax.metrics import match
    from selfrag_jax.world.build import WorldConfig, world_of
    from selfrag_jax.world.generator_data import lookalike_passage

    world_dir = Path(world_dir)
    manifest = json.loads((world_dir / "manifest.json").read_text())
    world = world_of(WorldConfig(**{k: v for k, v in manifest["config"].items() if not isinstance(v, dict)}))
    with open(world_dir / "eval" / "world_qa.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    rng, own, other, lacking = random.Random(0), [], [], []
    for r in records:
        person = next(p for p in world.kb.people if p.id == r["meta"]["entity_ids"][0])
        own.append((r["question"], world.by_id[r["meta"]["gold_passage_ids"][0]]))
        other.append((r["question"], lookalike_passage(world, person, rng, person.split)))
        missing = world.passage_without(person, r["meta"]["attributes"][0])
        if missing is not None:  # one-passage people have no lacking case
            lacking.append((r["question"], missing))
    model, out = probe_model(model_dir), {"n": len(records)}
    rate = lambda hits, of: sum(hits) / max(len(of), 1)  # noqa: E731
    for name, form in forms.items():
        # all three sets in one generation call: one compiled shape, fewer dispatches
        prompts = [form.format(q=q, p=T.passage_text(p.title, p.text)) for q, p in own + other + lacking]
        texts = _greedy_lines(model, prompts, batch_size, max_new_tokens)
        refusal = next_token_logprobs(model, prompts[:2 * len(own)], model[2].encode_text(T.REFUSAL)[0], batch_size)
        a, b = len(own), len(own) + len(other)
        said_own, said_other, said_lacking = texts[:a], texts[a:b], texts[b:]
        out[name] = {"answered_own": rate((match(t, r["answers"]) for t, r in zip(said_own, records)), records),
                     "refused_own": rate((t == T.REFUSAL for t in said_own), records),
                     "refused_lookalike": rate((t == T.REFUSAL for t in said_other), records),
                     "refused_lacking": rate((t == T.REFUSAL for t in said_lacking), lacking),
                     "refusal_auc": auc(refusal[:a], refusal[a:]),
                     "lookalike_examples": said_other[:3]}
    return out


def repeat_rows(tok, rows: int, length: int, seed: int = 0, spaced: bool = False) -> np.ndarray:
    """BOS, then `length` name pieces of the world's vocabulary drawn at random (capitalised
    alphabetic tokens, never a control token), then the same pieces again: [rows, 1 + 2 *
    length]. `spaced`: the pieces as words, a space token between them and a newline between
    the copies (the text "P1 P2 .. Pn\nP1 P2 .. Pn", as a pretraining document of repeats
    reads): [rows, 1 + 2 * (2 * length - 1) + 1]."""
    pool = [i for i in range(tok.vocab_size) if i not in tok.forbidden_in_text
            and (piece := tok.decode([i], skip_control=False)).isalpha() and piece[0].isupper() and len(piece) > 2]
    seq = np.random.default_rng(seed).choice(np.asarray(pool), (rows, length))
    bos = np.full((rows, 1), tok.bos_id)
    if not spaced:
        return np.concatenate([bos, seq, seq], 1).astype(np.int32)
    (space,), (newline,) = tok.encode_text(" "), tok.encode_text("\n")
    words = np.full((rows, 2 * length - 1), space)
    words[:, ::2] = seq
    return np.concatenate([bos, words, np.full((rows, 1), newline), words], 1).astype(np.int32)


def induction_accuracy(model_dir: str | Path | tuple, rows: int = 32, length: int = 40, seed: int = 0,
                       spaced: bool = False) -> dict:
    """Does the model copy by content? Random name pieces, then the same pieces again: a model
    with induction heads predicts the second copy from the first (pretrained LMs do: Olsson et
    al., 2022), one that reads only by attribute keys predicts neither. {"first_loss",
    "second_loss": mean next-token loss on each copy's name pieces, "second_accuracy": greedy
    next-token accuracy on the second copy's, its first piece excepted}. The plain rows
    (pieces glued together) are text no document has; `spaced` rows are the world's repeat
    documents' form (`repeat_rows`)."""
    from selfrag_jax.models.llama import Llama

    config, params, tok = probe_model(model_dir)
    x = repeat_rows(tok, rows, length, seed, spaced)
    logits, _ = Llama(config).apply({"params": params}, jnp.asarray(x[:, :-1]))
    return {**copy_scores(logits, x, length, spaced), "rows": rows, "length": length, "spaced": spaced}


def copy_scores(logits, x: np.ndarray, length: int, spaced: bool = False) -> dict:
    """Scores of `repeat_rows` rows from logits at positions 0.. of x[:, :-1] (position t
    predicts x[t + 1]). Only name pieces after each copy's first are scored: the first piece of
    the second copy cannot be copied, and a spaced row's space tokens say nothing."""
    from selfrag_jax.training.trainer import cross_entropy

    span, sep, stride = (2 * length - 1, 1, 2) if spaced else (length, 0, 1)
    pieces = np.arange(stride, span, stride)  # offsets of the scored pieces inside a copy
    first, second = 1 + pieces, 1 + span + sep + pieces  # their indices in x
    nll = np.asarray(cross_entropy(jnp.asarray(logits), jnp.asarray(x[:, 1:])))
    guess = np.asarray(jnp.argmax(logits, -1))
    return {"first_loss": float(nll[:, first - 1].mean()), "second_loss": float(nll[:, second - 1].mean()),
            "second_accuracy": float((guess[:, second - 1] == x[:, second]).mean())}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint folder (a run directory) or HF folder")
    parser.add_argument("world", help="world folder (passages.jsonl, eval/world_qa.jsonl)")
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args(argv)
    model = probe_model(args.model)
    result = {"reading": reading_accuracy(model, args.world, args.n),
              "relevance": relevance_accuracy(model, args.world, args.n),
              "induction": induction_accuracy(model), "induction_spaced": induction_accuracy(model, spaced=True)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
