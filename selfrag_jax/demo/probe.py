"""Can the base model read? The question Self-RAG fine-tuning depends on.

Self-RAG fine-tunes a pretrained model that can already copy an answer out of a passage; a
model that only memorised its training people cannot, and no amount of generator training
teaches it (`../shared/reference/small-models.md`). This probe asks the held-out people's
factual questions with their gold passage in the pretraining format
(`title\\ntext\\n\\nQuestion: q\\nAnswer: `, the trailing space included: the world's
tokenizer glues it to the colon), decodes greedily and scores with the released match. The
same questions without the passage give the closed-book floor.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.world.pretrain import qa_text


def reading_prompts(world_dir: str | Path, n: int = 200) -> tuple[list[str], list[str], list[list[str]]]:
    """(prompts with the gold passage, the same prompts without it, gold answers) of the
    first `n` held-out factual questions."""
    world = Path(world_dir)
    with open(world / "passages.jsonl") as f:
        passages = {p["id"]: p for p in map(json.loads, f)}
    with open(world / "eval" / "world_qa.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    closed = [qa_text(r["question"], "") for r in records]
    gold = [passages[r["meta"]["gold_passage_ids"][0]] for r in records]
    reading = [T.passage_text(g["title"], g["text"]) + "\n\n" + c for g, c in zip(gold, closed)]
    return reading, closed, [r["answers"] for r in records]


def reading_accuracy(model_dir: str | Path, world_dir: str | Path, n: int = 200, batch_size: int = 50,
                     max_new_tokens: int = 12) -> dict:
    """{"with_passage": match rate, "closed_book": match rate, "n": questions, "examples": [...]}."""
    from selfrag_jax.evaluation.metrics import match
    from selfrag_jax.inference.decode import greedy_generate, pad_batch
    from selfrag_jax.models.checkpoint import load_model

    config, params, tok, _ = load_model(model_dir)
    stop = jnp.asarray(sorted({tok.eos_id, *tok.encode_text("\n")[-1:]}), jnp.int32)  # an answer is one line
    reading, closed, answers = reading_prompts(world_dir, n)
    out: dict = {"n": len(answers), "examples": []}
    for key, prompts in (("with_passage", reading), ("closed_book", closed)):
        hits = 0
        for start in range(0, len(prompts), batch_size):
            tokens, lengths = pad_batch([[tok.bos_id, *tok.encode_text(p)] for p in prompts[start:start + batch_size]],
                                        tok.eos_id)
            new, _ = greedy_generate(params, config, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens,
                                     stop, tok.eos_id)
            for i, row in enumerate(np.asarray(new)):
                text = tok.decode(row[row != tok.eos_id]).strip().split("\n")[0]
                gold = answers[start + i]
                hits += match(text, gold)
                if key == "with_passage" and len(out["examples"]) < 5:
                    out["examples"].append({"prompt_tail": prompts[start + i][-60:], "answer": text, "gold": gold})
        out[key] = hits / max(len(prompts), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint folder (a run directory) or HF folder")
    parser.add_argument("world", help="world folder (passages.jsonl, eval/world_qa.jsonl)")
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args(argv)
    result = reading_accuracy(args.model, args.world, args.n)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
