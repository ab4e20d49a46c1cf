"""`selfrag-jax generate`: Self-RAG (or a baseline) over a JSON-lines file (docs/generate-format.md).

Reads and validates every record first (bad input fails with file:line before any model
work), batches questions of similar length together (less padding, fewer shapes), runs
the engine, and writes the output in input order under a temporary name, renamed into
place at the end, so an interrupted run never leaves a half-written file. Beside it goes
`<output>.report.json` (cost and quality, see `report`), also printed as a short table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from selfrag_jax.inference.corrective import QUERY_MODES, CorrectiveOptions
from selfrag_jax.inference.scoring import (MODES, PIPELINES, THRESHOLD_RULES, Hard, RefuseOptions, RetrieveOptions,
                                           ScoreOptions)
from selfrag_jax.inference.settings import refusal_bar
from selfrag_jax.models.config import INFERENCE_DTYPES

# Honest refusal (not in the paper) is on by default only for `open`; the paper's tasks keep
# the paper's behaviour unless --refuse is given.
REFUSE_TASKS = ("open",)
# the flags' defaults are the option dataclasses' (one place for each default)
RETRIEVE, SCORE, REFUSE, CORRECTIVE = RetrieveOptions(), ScoreOptions(), RefuseOptions(), CorrectiveOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint of this project or Hugging Face Llama folder")
    p.add_argument("--input", required=True, help="JSON lines: question|instruction, ctxs?, answers?, ...")
    p.add_argument("--output", required=True, help="JSON lines of predictions (written atomically)")
    add_engine_arguments(p)
    add_answer_arguments(p)
    p.add_argument("--cache", metavar="DIR", help="write what `sweep` needs (both paths) to DIR")


def add_answer_arguments(p: argparse.ArgumentParser) -> None:
    """Flags `generate` and `serve` share (`compare` sets these itself): pipeline, refusal, rounds."""
    p.add_argument("--pipeline", choices=PIPELINES, default="selfrag",
                   help="selfrag, or a baseline in the same engine: naive (top-k passages in one prompt), "
                        "top1 (standard RAG), none (no retrieval)")
    p.add_argument("--refuse", dest="refuse", action="store_true", default=None,
                   help=f"answer the refusal message when no candidate passes the support bar "
                        f"(not in the paper; default: on for --task {'/'.join(REFUSE_TASKS)} with selfrag short "
                        "form, off for the paper's tasks)")
    p.add_argument("--no-refuse", dest="refuse", action="store_false")
    p.add_argument("--max-rounds", type=int, default=CORRECTIVE.max_rounds,
                   help="corrective re-retrieval: up to this many retrieval rounds when every passage is irrelevant")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags `generate` and `compare` share: retrieval, scoring, refusal, re-retrieval."""
    p.add_argument("--mode", choices=MODES, default=RETRIEVE.mode)
    p.add_argument("--threshold", type=float, default=RETRIEVE.threshold, help="delta of the retrieve rule")
    p.add_argument("--threshold-rule", choices=THRESHOLD_RULES, default=RETRIEVE.rule,
                   help="paper: ratio of probabilities; released: ratio of raw log-probabilities")
    p.add_argument("--ndocs", type=int, default=5, help="passages per question (K)")
    p.add_argument("--keep-top", type=int, default=0, metavar="M",
                   help="read all K passages, decode only the M with the highest IsRel (0: all K, the paper)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--w-rel", type=float, default=SCORE.w_rel)
    p.add_argument("--w-sup", type=float, default=SCORE.w_sup)
    p.add_argument("--w-use", type=float, default=SCORE.w_use)
    p.add_argument("--w-ret", type=float, default=SCORE.w_ret,
                   help="weight of the retriever's p(passage|question) in the final score (0: the paper's score)")
    p.add_argument("--ret-temperature", type=float, default=SCORE.ret_temperature,
                   help="temperature of that softmax over the question's passages' retriever scores")
    p.add_argument("--no-seqscore", action="store_true", help="leave exp(mean log-prob) out of the final score")
    p.add_argument("--drop-no-support", action="store_true", help="hard constraint: drop [No support] candidates")
    p.add_argument("--drop-irrelevant", action="store_true", help="hard constraint: drop [Irrelevant] candidates")
    p.add_argument("--task", default="open",
                   help="open | popqa | triviaqa | fever | pubhealth | arc_c | asqa | ... On the paper's tasks every "
                        "default is the paper's (no refusal, no retriever prior, one round); refusal is on by "
                        "default only for open")
    p.add_argument("--long-form", action="store_true", help="segment-level beam search")
    p.add_argument("--beam-width", type=int, default=2)
    p.add_argument("--max-depth", type=int, default=7)
    p.add_argument("--static-passages", action="store_true", help="long form: the same passages at every step")
    p.add_argument("--refusal-message", default=REFUSE.message, help="what a refusal answers")
    p.add_argument("--refuse-rel-threshold", type=float, default=None,
                   help="support bar: rel above this (default: the bar chosen on dev data in the model's decoding.json, "
                        f"else {REFUSE.rel_threshold})")
    p.add_argument("--refuse-sup-threshold", type=float, default=None,
                   help=f"support bar: sup above this (default: as --refuse-rel-threshold, else {REFUSE.sup_threshold})")
    p.add_argument("--refuse-issup", choices=("on", "off"), default=None,
                   help="support bar: consult the generated IsSup (off: IsRel alone; default: as "
                        "--refuse-rel-threshold, else on)")
    p.add_argument("--refuse-ret-threshold", type=float, default=None,
                   help="support bar: the retriever's score of the passage above this (its scale is the index's; "
                        "default: as --refuse-rel-threshold, else not consulted; give -inf as --refuse-ret-threshold=-inf)")
    p.add_argument("--refuse-use-threshold", type=float, default=None,
                   help="support bar: the answer's utility score (-1..1) above this (default: as "
                        "--refuse-rel-threshold, else not consulted; give -inf as --refuse-use-threshold=-inf)")
    p.add_argument("--crag-rel-threshold", type=float, default=CORRECTIVE.rel_threshold,
                   help="re-retrieve when every passage's rel is below this")
    p.add_argument("--retry-token-budget", type=int, default=CORRECTIVE.token_budget,
                   help="tokens (passages + generated) extra rounds may spend per question")
    p.add_argument("--crag-query", choices=QUERY_MODES, default=CORRECTIVE.query,
                   help="query of extra rounds: the question, + its entity words, + the model's best answer")
    p.add_argument("--batch-size", type=int, default=8, help="questions per compiled step")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="decode sharded over a device mesh, as `train` takes it: data,fsdp,tensor sizes "
                        "(e.g. 1,1,8 or data=2,tensor=-1); default: one device, or data=-1 over all hosts' devices")
    p.add_argument("--dtype", choices=INFERENCE_DTYPES, default="float32",
                   help="parameters and KV cache (critique softmax and log-prob sums stay float32)")
    p.add_argument("--trace", action="store_true", help="add token ids (prompt and generated) to the output")
    p.add_argument("--index", metavar="DIR", help="retrieve from this index folder when a record has no ctxs")
    p.add_argument("--retriever-url", metavar="URL[,URL...]",
                   help="retrieve from this `serve-retrieval` service instead; several, comma-separated, are one "
                        "index's shards: searched together, hits merged by score, and a shard that does not "
                        "answer fails the retrieval (naming it) rather than returning fewer passages")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from selfrag_jax.cli import CLIError
    from selfrag_jax.distributed import is_main
    from selfrag_jax.inference.items import read_items
    from selfrag_jax.inference.report import format_table
    from selfrag_jax.utils import atomic_file

    check_arguments(args, CLIError)
    opts = options_from_args(args)
    items = read_items(args.input, args.task)
    session = Session.load(args)
    out = session.run(items, opts, args.batch_size)
    if not is_main():  # every host ran the same program on the same input; one writes
        return 0
    with atomic_file(args.output) as handle:
        for record in out.records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    report = out.report([it.record for it in items], refusal_message=opts.refuse.message)
    with atomic_file(f"{args.output}.report.json") as handle:
        handle.write(json.dumps(report, indent=1) + "\n")
    print(format_table({opts.pipeline: report}))
    if args.cache:
        from selfrag_jax.inference.cache import write_cache

        write_cache(args.cache, out.results, opts)
    return 0


def check_arguments(args: argparse.Namespace, error: type[Exception]) -> None:
    if args.long_form and args.cache:
        raise error("--cache is for short form (sweep re-ranks short-form candidates)")
    if args.cache and args.pipeline != "selfrag":
        raise error("--cache is for --pipeline selfrag (sweep re-ranks Self-RAG candidates)")
    if args.pipeline != "selfrag" and (args.refuse or args.max_rounds > 1):
        raise error(f"--refuse and --max-rounds judge with reflection scores: --pipeline selfrag, not {args.pipeline}")
    if args.long_form and (args.refuse or args.max_rounds > 1 or args.pipeline != "selfrag"):
        raise error("--refuse, --max-rounds and --pipeline baselines are short-form options")
    for name in ("ndocs", "max_new_tokens", "batch_size", "beam_width", "max_depth", "max_rounds"):
        if getattr(args, name) < 1:
            raise error(f"--{name.replace('_', '-')} must be at least 1")
    if args.keep_top < 0:
        raise error("--keep-top must not be negative")
    if args.keep_top and (args.cache or args.long_form or args.pipeline != "selfrag"):
        raise error("--keep-top prunes short-form Self-RAG candidates: not with --cache, --long-form or a baseline")
    if args.retry_token_budget < 0:
        raise error("--retry-token-budget must not be negative")


def options_from_args(args: argparse.Namespace, pipeline: str | None = None, refuse: bool | None = None,
                      max_rounds: int | None = None, keep_top: int | None = None):
    """GenerateOptions from the flags; `compare` overrides pipeline, refusal, rounds and keep_top."""
    from selfrag_jax.inference.selfrag import GenerateOptions

    pipeline = pipeline or args.pipeline
    refuse = args.refuse if refuse is None else refuse
    if refuse is None:
        refuse = pipeline == "selfrag" and not args.long_form and args.task in REFUSE_TASKS
    bar = refusal_bar(args.model) or {}  # chosen on dev data; flags given win
    given = {"rel_threshold": args.refuse_rel_threshold, "sup_threshold": args.refuse_sup_threshold,
             "issup": None if args.refuse_issup is None else args.refuse_issup == "on",
             "ret_threshold": args.refuse_ret_threshold, "use_threshold": args.refuse_use_threshold}
    given = {k: v for k, v in given.items() if v is not None}
    return GenerateOptions(
        task=args.task, ndocs=args.ndocs, pipeline=pipeline, trace=args.trace,
        keep_top=(args.keep_top if keep_top is None else keep_top) if pipeline == "selfrag" else 0,
        keep_both_paths=bool(getattr(args, "cache", None)),
        retrieve=RetrieveOptions(mode=args.mode, threshold=args.threshold, rule=args.threshold_rule),
        score=ScoreOptions(w_rel=args.w_rel, w_sup=args.w_sup, w_use=args.w_use, seqscore=not args.no_seqscore,
                           hard=Hard.of(args.drop_no_support, args.drop_irrelevant), w_ret=args.w_ret,
                           ret_temperature=args.ret_temperature),
        refuse=RefuseOptions(enabled=bool(refuse), message=args.refusal_message, **bar).with_thresholds(**given),
        corrective=CorrectiveOptions(max_rounds=max_rounds or args.max_rounds, rel_threshold=args.crag_rel_threshold,
                                     token_budget=args.retry_token_budget, query=args.crag_query),
        beam_width=args.beam_width, max_depth=args.max_depth, static_passages=args.static_passages)


@dataclass
class RunOutput:
    """Records (input order), raw results, and what the run cost."""

    records: list[dict[str, Any]]
    results: list
    tokens: Any  # engine.TokenCount
    batch_size: int
    seconds: float

    def report(self, inputs: list[dict[str, Any]], judge=None, refusal_message: str | None = None) -> dict[str, Any]:
        from selfrag_jax.inference.report import cost_report, quality_report

        report = {"pipeline": self.records[0].get("pipeline", "selfrag") if self.records else None}
        report.update(cost_report(self.records, [r.latency_s for r in self.results], self.tokens,
                                  self.batch_size, self.seconds))
        report.update(quality_report(inputs, self.records, judge, refusal_message))
        return report


@dataclass
class Session:
    """One model, tokenizer, engine and retriever, reused by every pipeline run on it."""

    engine: Any
    tokenizer: Any
    retrieve_fn: Any
    long_form: bool = False

    @classmethod
    def load(cls, args: argparse.Namespace, shapes=None) -> "Session":
        """The engine on `--mesh` in `--dtype` (padded to `shapes`, for a server). On a multi-host
        slice every process joins one SPMD program (a data-parallel mesh over all hosts' devices
        unless `--mesh` says)."""
        import jax

        from selfrag_jax import distributed
        from selfrag_jax.inference.engine import Engine

        distributed.initialize()
        mesh = args.mesh or ("data=-1" if jax.process_count() > 1 else None)
        engine, tok = Engine.load(args.model, args.max_new_tokens, mesh, args.dtype, shapes=shapes)
        return cls(engine, tok, make_retriever(args), args.long_form)

    def runner(self, opts):
        if self.long_form:
            from selfrag_jax.inference.longform import LongForm

            return LongForm(self.engine, self.tokenizer, opts, self.retrieve_fn)
        from selfrag_jax.inference.selfrag import ShortForm

        return ShortForm(self.engine, self.tokenizer, opts, self.retrieve_fn)

    def run(self, items: list, opts, batch_size: int) -> RunOutput:
        from selfrag_jax.inference.engine import TokenCount

        runner = self.runner(opts)
        before = TokenCount(self.engine.tokens.prefill, self.engine.tokens.decode)
        start = time.perf_counter()
        results = run_batches(runner, items, batch_size)
        seconds = time.perf_counter() - start
        spent = TokenCount(self.engine.tokens.prefill - before.prefill, self.engine.tokens.decode - before.decode)
        return RunOutput([runner.record(r) for r in results], results, spent, batch_size, seconds)


def run_batches(runner, items: list, batch_size: int) -> list:
    """Run `runner` over batches of questions of similar length; results in input order.
    Each result's `latency_s` is its batch's wall time divided by the batch's questions."""
    from selfrag_jax.utils import progress

    order = sorted(range(len(items)), key=lambda i: len(items[i].instruction) + len(items[i].input))
    results: list = [None] * len(items)
    with progress(total=len(items), desc="generate", unit="q") as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            t0 = time.perf_counter()
            out = runner.run([items[i] for i in batch])
            share = (time.perf_counter() - t0) / len(batch)
            for i, result in zip(batch, out):
                result.latency_s = share
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
        from selfrag_jax.retrieval.retriever import RetrieverClient, ShardedRetriever

        urls = [url.strip() for url in args.retriever_url.split(",")]
        if not all(urls):
            raise ValueError(f"--retriever-url {args.retriever_url!r}: an empty URL between commas")
        if len(urls) == 1:
            return RetrieverClient(urls[0]).retrieve
        try:
            return ShardedRetriever([RetrieverClient(url) for url in urls]).retrieve
        except ValueError as err:
            raise ValueError(f"--retriever-url: {err}") from None
    return None
