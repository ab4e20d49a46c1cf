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


def reading_prompts(world_dir: str | Path, n: int = 200, with_passage: bool = True) -> tuple[list[str], list[list[str]]]:
    """Prompt texts and gold answers of the first `n` held-out factual questions."""
    world = Path(world_dir)
    with open(world / "passages.jsonl") as f:
        passages = {p["id"]: p for p in map(json.loads, f)}
    prompts, answers = [], []
    with open(world / "eval" / "world_qa.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            gold = passages[rec["meta"]["gold_passage_ids"][0]]
            head = T.passage_text(gold["title"], gold["text"]) + "\n\n" if with_passage else ""
            prompts.append(f"{head}Question: {rec['question']}\nAnswer: ")
            answers.append(rec["answers"])
            if len(prompts) == n:
                break
    return prompts, answers


def reading_accuracy(model_dir: str | Path, world_dir: str | Path, n: int = 200, batch_size: int = 50,
                     max_new_tokens: int = 12) -> dict:
    """{"with_passage": match rate, "closed_book": match rate, "n": questions, "examples": [...]}."""
    from selfrag_jax.evaluation.metrics import match
    from selfrag_jax.inference.decode import greedy_generate
    from selfrag_jax.models.checkpoint import load_model

    config, params, tok, _ = load_model(model_dir)
    newline = tok.encode_text("\n")
    stop = jnp.asarray(sorted({tok.eos_id, *newline[-1:]}), jnp.int32)  # an answer is one line
    out: dict = {"n": 0, "examples": []}
    for with_passage in (True, False):
        prompts, answers = reading_prompts(world_dir, n, with_passage)
        hits = 0
        for start in range(0, len(prompts), batch_size):
            chunk = [[tok.bos_id, *tok.encode_text(p)] for p in prompts[start:start + batch_size]]
            width = max(map(len, chunk))
            ids = np.zeros((len(chunk), width), np.int32)
            for i, row in enumerate(chunk):
                ids[i, :len(row)] = row
            new, _ = greedy_generate(params, config, jnp.asarray(ids), jnp.asarray([len(r) for r in chunk]),
                                     max_new_tokens, stop, tok.eos_id)
            for i, row in enumerate(np.asarray(new)):
                text = tok.decode(row[row != tok.eos_id]).strip().split("\n")[0]
                gold = answers[start + i]
                hits += match(text, gold)
                if with_passage and len(out["examples"]) < 5:
                    out["examples"].append({"prompt_tail": prompts[start + i][-60:], "answer": text, "gold": gold})
        out["with_passage" if with_passage else "closed_book"] = hits / max(len(prompts), 1)
        out["n"] = len(prompts)
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
