"""Recall of `index build`'s default search settings on real embeddings, against exact search.

    python -m bench.retrieval_real --corpus docstrings   # 100k passages: ~30 min of embedding on 2 cores
    python -m bench.retrieval_real --corpus world --world runs/default/world

Corpora, embedded by the bundled MiniLM (384 dimensions, unit vectors):
- docstrings: the docstrings of the Python packages installed beside this one (numpy, jax,
  transformers, torch, ...), whitespace-collapsed, cut into passages of at most 60 words,
  deduplicated, a seeded sample of --passages. Queries: 1,000 further passages held out of
  the index (same distribution), and the dotted names of 1,000 indexed passages' objects
  (`numpy.linalg.svd`: short queries, another distribution).
- world: the bundled world's passages; its held-out QA questions as queries.

Each corpus is indexed by `build_index_folder` with no tuning flags (automatic parameters,
search settings calibrated for --target-recall; the embeddings kept), then searched with the
manifest's settings as they are; recall@10 against `ExactIndex` over the same embeddings.
The work folder keeps the passages and the index, so a rerun reuses the embedding. `run_all`
does not run it (the embedding is its cost). Writes bench/results/retrieval_real_<corpus>.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

from bench.common import machine_info, median_time, versions, write_result
from selfrag_jax.retrieval.build import BuildConfig, build_index_folder, read_manifest
from selfrag_jax.retrieval.embed import EmbedConfig, load_embeddings
from selfrag_jax.retrieval.encoder import EncoderConfig, TextEncoder, read_encoder_spec
from selfrag_jax.retrieval.index import ExactIndex, load_vector_index
from selfrag_jax.retrieval.synthetic import recall_at_k

MAX_WORDS = 60
MIN_WORDS = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=("docstrings", "world"), required=True)
    parser.add_argument("--passages", type=int, default=100_000, help="docstrings: passages indexed")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--world", help="world: the world folder (passages.jsonl, eval/world_qa.jsonl)")
    parser.add_argument("--workdir", default="runs/retrieval_real", help="passages and index kept here")
    parser.add_argument("--max-length", type=int, default=128, help="encoder token limit")
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(args.workdir) / args.corpus
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    if args.corpus == "docstrings":
        passages_file, query_sets = docstring_corpus(work, args.passages, args.queries)
    else:
        if not args.world:
            parser.error("--corpus world needs --world DIR")
        passages_file, query_sets = world_corpus(Path(args.world), args.queries)
    corpus_s = time.perf_counter() - t0
    print(f"corpus: {passages_file} ({corpus_s:.0f}s); queries: {', '.join(f'{k} {len(v)}' for k, v in query_sets.items())}", flush=True)

    out = work / "index"
    embed = EmbedConfig(shard_size=25_000, batch_size=64)
    t0 = time.perf_counter()
    if not (out / "manifest.json").exists():
        config = BuildConfig(passages=str(passages_file), out=str(out), max_length=args.max_length, embed=embed,
                             target_recall=args.target_recall, keep_embeddings=True)  # fmt: skip
        build_index_folder(config, log=lambda msg: print(msg, flush=True))
    build_s = time.perf_counter() - t0
    manifest = read_manifest(out)
    vectors = load_embeddings(out / "embeddings", manifest["count"], embed.shard_size, manifest["dimension"])
    index = load_vector_index(out, manifest["backend"], manifest["params"], manifest["count"])
    encoder = TextEncoder(read_encoder_spec(manifest["encoder"]["path"], max_length=args.max_length), EncoderConfig(batch_size=64))
    exact = ExactIndex(vectors)

    result = {
        "machine": machine_info(),
        "versions": versions("scann"),
        "config": {"corpus": args.corpus, "passages": manifest["count"], "dim": manifest["dimension"], "k": args.k,
                   "target_recall": args.target_recall, "max_length": args.max_length, "encoder": manifest["encoder"]["path"]},  # fmt: skip
        "index": {"params": manifest["params"], "calibration": _drop(manifest.get("calibration"), "sweep"),
                  "bytes": _drop(manifest["bytes"], "index_files"), "build_s_this_run": build_s},  # fmt: skip
        "queries": {},
    }
    for name, texts in query_sets.items():
        queries = encoder.encode(texts)
        _, truth = exact.search(queries, args.k)
        found = index.search(queries, args.k)[1]
        entry = {"count": len(texts), "recall": recall_at_k(found, truth), "example": texts[0][:120]}
        entry["qps"] = len(texts) / median_time(lambda: index.search(queries, args.k), args.repeats)[0]
        entry["exact_qps"] = len(texts) / median_time(lambda: exact.search(queries, args.k), args.repeats)[0]
        result["queries"][name] = entry
        print(f"{name}: recall@{args.k} {entry['recall']:.4f}, {entry['qps']:,.0f} QPS (exact {entry['exact_qps']:,.0f})", flush=True)
    result["summary"] = [{
        "what": f"retrieval_real: recall@{args.k} at the default search settings, {args.corpus} {name} ({manifest['count']:,} x {manifest['dimension']}, {manifest['backend']}{' brute force' if manifest['params'].get('brute_force') else ''})",
        "ours": f"{q['recall']:.3f} ({q['qps']:,.0f} QPS)", "peer": f"exact search ({q['exact_qps']:,.0f} QPS)",
        "ratio": None, "goal": f"recall >= {args.target_recall}", "met": q["recall"] >= args.target_recall,
    } for name, q in result["queries"].items()]  # fmt: skip
    path = write_result(f"retrieval_real_{args.corpus}", result)
    print(f"-> {path}")


def docstring_corpus(work: Path, n_passages: int, n_queries: int) -> tuple[Path, dict[str, list[str]]]:
    """passages.jsonl (indexed) and the query texts; written once, reused."""
    passages_file, queries_file = work / "passages.jsonl", work / "queries.json"
    if passages_file.exists() and queries_file.exists():
        return passages_file, json.loads(queries_file.read_text())
    pool = sorted(_docstring_passages().items())  # (text, title), deterministic order
    order = np.random.default_rng(0).permutation(len(pool))
    if len(pool) < n_passages + n_queries:
        raise SystemExit(f"only {len(pool)} docstring passages installed; ask for fewer (--passages)")
    held_out = [pool[i][0] for i in order[:n_queries]]
    chosen = [pool[i] for i in order[n_queries : n_queries + n_passages]]
    tmp = passages_file.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row, (text, title) in enumerate(chosen):
            f.write(json.dumps({"id": f"d{row:07d}", "title": title, "text": text}) + "\n")
    names = [title for _, title in chosen[:: max(1, len(chosen) // n_queries)][:n_queries]]
    queries_file.write_text(json.dumps({"held_out_passages": held_out, "object_names": names}))
    tmp.replace(passages_file)
    return passages_file, {"held_out_passages": held_out, "object_names": names}


def _docstring_passages() -> dict[str, str]:
    """text -> dotted name of its object, over every installed package's modules."""
    roots = sorted({Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")})
    out: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            try:
                tree = ast.parse(path.read_bytes())
            except (SyntaxError, ValueError, OSError, RecursionError):
                continue
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                words = (ast.get_docstring(node) or "").split()
                name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                for start in range(0, len(words), MAX_WORDS):
                    chunk = words[start : start + MAX_WORDS]
                    if len(chunk) >= MIN_WORDS:
                        out.setdefault(" ".join(chunk), name)
    return out


def world_corpus(world: Path, n_queries: int) -> tuple[Path, dict[str, list[str]]]:
    questions = [json.loads(line)["question"] for line in open(world / "eval" / "world_qa.jsonl", encoding="utf-8")]
    return world / "passages.jsonl", {"world_qa_questions": questions[:n_queries]}


def _drop(d: dict | None, key: str) -> dict | None:
    return None if d is None else {k: v for k, v in d.items() if k != key}


if __name__ == "__main__":
    main()
