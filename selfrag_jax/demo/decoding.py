"""The demo's decoding helpers: a models folder's engine, the world's eval items, batches with
progress, and Self-RAG's retrieval depth chosen for a generator on the dev split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from selfrag_jax.bundled import DEPTH_FILE

# Self-RAG's retrieval depth K (the paper: 5 or 10) is chosen per set of models on the dev
# split and kept beside them (`decoding.json`, `choose_depth`): the paper's score chooses
# among the retriever's top K, and a critic that cannot match names (the reduced retrain's)
# chooses better among fewer look-alikes. Without the file: the paper's 5.
PAPER_NDOCS = 5


def model_ndocs(models: Path) -> tuple[int, dict[str, Any] | None]:
    """The depth chosen on the dev split for these models (`DEPTH_FILE`), else the paper's."""
    path = models / DEPTH_FILE
    if not path.exists():
        return PAPER_NDOCS, None
    info = json.loads(path.read_text())
    ndocs = info.get("ndocs")
    if not isinstance(ndocs, int) or not 1 <= ndocs <= PAPER_NDOCS:
        raise ValueError(f"{path}: ndocs must be a whole number from 1 to {PAPER_NDOCS}, got {ndocs!r}")
    return ndocs, info


def choose_depth(generator: Path, world: Path, index: Path, cache: Path, n: int = 300, batch_size: int = 32,
                 log=print) -> dict[str, Any]:
    """Self-RAG's retrieval depth for this generator: decode the first `n` dev questions
    (eval/world_qa_dev.jsonl, the held-out people's other attributes) once with the paper's
    top-5 and both paths (`generate --cache`, written to `cache`), then `sweep` K = 1..5 under
    the paper's score and retrieval rule. The best dev match wins, ties going to the deeper K
    (the paper's side)."""
    from selfrag_jax.evaluation import sweep as S
    from selfrag_jax.inference.cache import write_cache
    from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
    from selfrag_jax.retrieval.retriever import Retriever

    engine, tok = load_engine(generator)
    items = load_items(world / "eval" / "world_qa_dev.jsonl", n)
    runner = ShortForm(engine, tok, GenerateOptions(task="open", ndocs=PAPER_NDOCS, keep_both_paths=True),
                       Retriever.from_dir(index).retrieve)
    results = run_batches(runner, items, batch_size, "dev/depth")
    depths = list(range(1, PAPER_NDOCS + 1))
    result = S.run_sweep(S.prepare(write_cache(cache, results, runner.opts)), [S.Config(ndocs=k) for k in depths])
    dev = {str(k): round(float(m), 4) for k, m in zip(depths, result.metric)}
    best = max(depths, key=lambda k: (dev[str(k)], k))
    log(f"[depth] dev match by K (n={len(items)}): " + ", ".join(f"{k}: {v:.3f}" for k, v in dev.items())
        + f" -> K = {best}")
    return {"ndocs": best, "dev_match": dev, "n": len(items), "split": "world_qa_dev",
            "sweep_config": dataclasses.asdict(result.configs[best - 1])}


def load_engine(generator: Path, max_new_tokens: int = 24, mesh: str | None = None, dtype: str = "float32"):
    """(the compiled engine, tokenizer) of a generator folder or run, on `mesh` in `dtype`."""
    from selfrag_jax.inference.engine import Engine

    return Engine.load(str(generator), max_new_tokens, mesh, dtype)


def run_batches(runner, items: list, batch_size: int, desc: str) -> list:
    """`runner.run` over `items` in batches, with a progress bar."""
    from selfrag_jax.utils import progress

    results = []
    for start in progress(range(0, len(items), batch_size), desc=desc, unit="batch"):
        results += runner.run(items[start:start + batch_size])
    return results


def load_items(path: Path, limit: int):
    from selfrag_jax.inference.items import Item

    items = []
    for line in path.read_text().splitlines()[:limit]:
        rec = json.loads(line)
        items.append(Item(rec["id"], rec["question"], rec.get("instruction") or rec["question"], "", None, rec,
                          f"{path.name}:{len(items) + 1}"))
    return items
