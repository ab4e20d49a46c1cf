"""`selfrag-jax generate`: Self-RAG inference over a JSON-lines file (interfaces.md).

Reads and validates every record first (bad input fails with file:line before any model
work), batches questions of similar length together (less padding, fewer shapes), runs
the engine, and writes the output in input order under a temporary name, renamed into
place at the end, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from selfrag_jax.inference.scoring import MODES, THRESHOLD_RULES, RetrieveOptions, ScoreOptions

PIPELINES = ("selfrag", "naive", "top1", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint of this project or Hugging Face Llama folder")
    p.add_argument("--input", required=True, help="JSON lines: question|instruction, ctxs?, answers?, ...")
    p.add_argument("--output", required=True, help="JSON lines of predictions (written atomically)")
    p.add_argument("--mode", choices=MODES, default="adaptive")
    p.add_argument("--threshold", type=float, default=0.2, help="delta of the retrieve rule")
    p.add_argument("--threshold-rule", choices=THRESHOLD_RULES, default="paper",
                   help="paper: ratio of probabilities; released: ratio of raw log-probabilities")
    p.add_argument("--ndocs", type=int, default=5, help="passages per question (K)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--w-rel", type=float, default=1.0)
    p.add_argument("--w-sup", type=float, default=1.0)
    p.add_argument("--w-use", type=float, default=0.5)
    p.add_argument("--no-seqscore", action="store_true", help="leave exp(mean log-prob) out of the final score")
    p.add_argument("--drop-no-support", action="store_true", help="hard constraint: drop [No support] candidates")
    p.add_argument("--drop-irrelevant", action="store_true", help="hard constraint: drop [Irrelevant] candidates")
    p.add_argument("--task", default="open", help="open | fever | pubhealth | arc_c | asqa | ...")
    p.add_argument("--long-form", action="store_true", help="segment-level beam search")
    p.add_argument("--beam-width", type=int, default=2)
    p.add_argument("--max-depth", type=int, default=7)
    p.add_argument("--static-passages", action="store_true", help="long form: the same passages at every step")
    p.add_argument("--pipeline", choices=PIPELINES, default="selfrag")
    p.add_argument("--refuse", dest="refuse", action="store_true", default=False)
    p.add_argument("--no-refuse", dest="refuse", action="store_false")
    p.add_argument("--max-rounds", type=int, default=1, help="corrective re-retrieval rounds")
    p.add_argument("--batch-size", type=int, default=8, help="questions per compiled step")
    p.add_argument("--trace", action="store_true", help="add token ids (prompt and generated) to the output")
    p.add_argument("--cache", metavar="DIR", help="write what `sweep` needs (both paths) to DIR")
    p.add_argument("--index", metavar="DIR", help="retrieve from this index folder when a record has no ctxs")
    p.add_argument("--retriever-url", metavar="URL", help="retrieve from this HTTP service instead")


def run(args: argparse.Namespace) -> int:
    from selfrag_jax.cli import CLIError
    from selfrag_jax.inference.items import read_items
    from selfrag_jax.inference.selfrag import GenerateOptions

    _check_supported(args, CLIError)
    opts = GenerateOptions(
        task=args.task, ndocs=args.ndocs, trace=args.trace, keep_both_paths=bool(args.cache),
        retrieve=RetrieveOptions(args.mode, args.threshold, args.threshold_rule),
        score=ScoreOptions(args.w_rel, args.w_sup, args.w_use, not args.no_seqscore,
                           args.drop_no_support, args.drop_irrelevant),
        beam_width=args.beam_width, max_depth=args.max_depth, static_passages=args.static_passages)
    items = read_items(args.input, args.task)
    records, results = generate(items, args, opts)
    from selfrag_jax.utils import atomic_file

    with atomic_file(args.output) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    if args.cache:
        from selfrag_jax.inference.cache import write_cache

        write_cache(args.cache, results, opts)
    return 0


def _check_supported(args: argparse.Namespace, error: type[Exception]) -> None:
    if args.pipeline != "selfrag":
        raise error(f"--pipeline {args.pipeline}: not implemented yet (only selfrag)")
    if args.refuse or args.max_rounds != 1:
        raise error("--refuse / --max-rounds: not implemented yet")
    if args.long_form and args.cache:
        raise error("--cache is for short form (sweep re-ranks short-form candidates)")
    for name in ("ndocs", "max_new_tokens", "batch_size", "beam_width", "max_depth"):
        if getattr(args, name) < 1:
            raise error(f"--{name.replace('_', '-')} must be at least 1")


def generate(items, args: argparse.Namespace, opts) -> tuple[list[dict[str, Any]], list]:
    """Output records (input order) and the raw per-question results."""
    from selfrag_jax.inference.engine import ControlIds, Engine
    from selfrag_jax.models.checkpoint import load_model

    config, params, tok, _ = load_model(args.model)
    if tok is None:
        raise ValueError(f"{args.model}: no tokenizer files next to the model")
    engine = Engine(params, config, ControlIds.from_tokenizer(tok), args.max_new_tokens)
    retrieve_fn = make_retriever(args)
    if args.long_form:
        from selfrag_jax.inference.longform import LongForm

        runner = LongForm(engine, tok, opts, retrieve_fn)
    else:
        from selfrag_jax.inference.selfrag import ShortForm

        runner = ShortForm(engine, tok, opts, retrieve_fn)
    results = run_batches(runner, items, args.batch_size)
    return [runner.record(r) for r in results], results


def run_batches(runner, items: list, batch_size: int) -> list:
    """Run `runner` over batches of questions of similar length; results in input order."""
    from selfrag_jax.utils import progress

    order = sorted(range(len(items)), key=lambda i: len(items[i].instruction) + len(items[i].input))
    results: list = [None] * len(items)
    with progress(total=len(items), desc="generate", unit="q") as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            for i, result in zip(batch, runner.run([items[i] for i in batch])):
                results[i] = result
            bar.update(len(batch))
    return results


def make_retriever(args: argparse.Namespace):
    """`retrieve(queries, k)` of an index folder or HTTP service (imported only when asked)."""
    if args.index and args.retriever_url:
        raise ValueError("give --index or --retriever-url, not both")
    if args.index:
        from selfrag_jax.retrieval.retriever import Retriever

        return Retriever.from_dir(args.index).retrieve
    if args.retriever_url:
        from selfrag_jax.retrieval.retriever import RetrieverClient

        return RetrieverClient(args.retriever_url).retrieve
    return None
