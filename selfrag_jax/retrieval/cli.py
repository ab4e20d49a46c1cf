"""`selfrag-jax index build | index search | serve-retrieval`."""

from __future__ import annotations

import argparse
import json
import sys

from selfrag_jax.cli import CLIError


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "index build":
        _build_arguments(parser)
    elif name == "index search":
        parser.add_argument("index", metavar="DIR", help="index folder (from `index build`)")
        parser.add_argument("--query", required=True, help="query text")
        parser.add_argument("-k", type=int, default=5, help="passages to return (default 5)")
        parser.add_argument("--json", action="store_true", help="print the hits as JSON")
        parser.add_argument("--encoder", metavar="ENC", help="encoder folder to use instead of the manifest's (same model)")
    elif name == "serve-retrieval":
        from selfrag_jax.retrieval.server import ServerConfig

        d = ServerConfig()
        parser.add_argument("index", metavar="DIR", nargs="?", help="index folder (from `index build`); or --shard instead")
        parser.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
        parser.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port}; 0 picks a free one)")
        parser.add_argument("--encoder", metavar="ENC", help="encoder folder to use instead of the manifest's (same model)")
        fan_out = parser.add_argument_group("fan-out over shards' services (instead of DIR)")
        fan_out.add_argument("--shard", metavar="URL", action="append", default=[],
                             help="a shard's `serve-retrieval` (repeat per shard): each request is searched on all, hits merged by score")  # fmt: skip
        fan_out.add_argument("--allow-partial", action="store_true",
                             help="a shard that does not answer: 200 with \"partial\": true and \"missing\" (default: 503 naming it)")  # fmt: skip
        fan_out.add_argument("--shard-timeout", type=float, default=30.0, metavar="S",
                             help="seconds a shard may take to connect or answer before it counts as missing (default 30)")  # fmt: skip
        parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger bodies get 413")
        parser.add_argument("--max-queries", type=int, default=d.max_queries, help="queries per request")
        parser.add_argument("--max-query-chars", type=int, default=d.max_query_chars, help="characters per query")
        parser.add_argument("--max-k", type=int, default=d.max_k, help="largest k a request may ask for")
        parser.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms, help="how long a batch waits for more requests")
        parser.add_argument("--max-batch", type=int, default=d.max_batch, help="queries per batched encode + search")
    else:  # pragma: no cover - the registry only routes the three names above here
        raise CLIError(f"unknown command {name!r}")


def _build_arguments(parser: argparse.ArgumentParser) -> None:
    from selfrag_jax.retrieval.embed import EmbedConfig
    from selfrag_jax.retrieval.encoder import DEFAULT_ENCODER, POOLING_MODES

    e = EmbedConfig()
    parser.add_argument("--passages", required=True, metavar="FILE", help="JSON lines {id,title,text} or DPR TSV (id, text, title)")
    parser.add_argument("--out", required=True, metavar="DIR", help="index folder to create")
    parser.add_argument("--encoder", default=DEFAULT_ENCODER, metavar="ENC", help=f"Hugging Face BERT folder (default: bundled {DEFAULT_ENCODER})")
    parser.add_argument("--backend", choices=("scann", "exact"), default="scann", help="index backend (default scann)")
    parser.add_argument("--pooling", choices=POOLING_MODES, help="override the encoder folder's pooling")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None, help="override the encoder folder's normalisation")
    parser.add_argument("--max-length", type=int, help="token limit per passage (default: the encoder's)")
    parser.add_argument("--batch-size", type=int, default=e.batch_size, help=f"encoder batch size (default {e.batch_size})")
    parser.add_argument("--shard-size", type=int, default=e.shard_size, help=f"passages per embedding shard (default {e.shard_size})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="encoder compute dtype")
    parser.add_argument("--process-index", type=int, help="this host's number on a pod (default: jax.process_index())")
    parser.add_argument("--process-count", type=int, help="hosts on the pod (default: jax.process_count())")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing index at --out")
    parser.add_argument("--keep-embeddings", action="store_true", help="keep the embedding shards in the index folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--target-recall", type=float, default=0.95,
                        help="recall@10 the ScaNN search settings are calibrated to at build time (default 0.95; 0: no calibration)")  # fmt: skip
    add_scann_arguments(parser)

SCANN_KEYS = ("brute_force", "num_leaves", "leaves_to_search", "training_sample_size", "dims_per_block",
              "anisotropic_threshold", "reorder", "reorder_dtype", "soar_lambda")  # fmt: skip


def add_scann_arguments(parser: argparse.ArgumentParser) -> None:
    """Overrides of the automatic ScaNN parameters (`index build`, bench_retrieval_index)."""
    scann = parser.add_argument_group("ScaNN (defaults chosen from the corpus size)")
    scann.add_argument("--brute-force", action="store_true", default=None, help="exact scoring inside ScaNN")
    scann.add_argument("--num-leaves", type=int, help="partitions of the tree (0: no tree)")
    scann.add_argument("--leaves-to-search", type=int, help="partitions searched per query")
    scann.add_argument("--training-sample-size", type=int, help="vectors used to train the tree and quantiser")
    scann.add_argument("--dims-per-block", type=int, help="asymmetric hashing dimensions per block")
    scann.add_argument("--anisotropic-threshold", type=float, help="anisotropic quantisation threshold")
    scann.add_argument("--reorder", type=int, help="candidates re-scored exactly (0: none)")
    scann.add_argument("--reorder-dtype", choices=("float32", "bfloat16", "int8"), help="precision of the re-scoring data")
    scann.add_argument("--soar-lambda", type=float, help="SOAR spilling strength (off by default)")



def scann_overrides(args: argparse.Namespace) -> dict:
    """The ScaNN flags that were given, as `ScannParams` overrides."""
    return {k: getattr(args, k) for k in SCANN_KEYS if getattr(args, k) is not None}


def run(args: argparse.Namespace) -> int:
    if args._name == "index build":
        return _run_build(args)
    if args._name == "index search":
        return _run_search(args)
    return _run_serve(args)


def _run_build(args: argparse.Namespace) -> int:
    from selfrag_jax.retrieval.build import BuildConfig, build_index_folder
    from selfrag_jax.retrieval.embed import EmbedConfig
    from selfrag_jax.retrieval.encoder import EncoderConfig

    for flag in ("batch_size", "shard_size"):
        if getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.target_recall < 1:
        raise CLIError(f"--target-recall {args.target_recall}: must be in [0, 1)")
    config = BuildConfig(
        passages=args.passages,
        out=args.out,
        encoder=args.encoder,
        backend=args.backend,
        pooling=args.pooling,
        normalize=args.normalize,
        max_length=args.max_length,
        scann=scann_overrides(args),
        target_recall=args.target_recall or None,
        embed=EmbedConfig(
            shard_size=args.shard_size,
            batch_size=args.batch_size,
            process_index=args.process_index,
            process_count=args.process_count,
            progress=not args.no_progress,
        ),
        encoder_run=EncoderConfig(batch_size=args.batch_size, dtype=args.dtype),
        overwrite=args.overwrite,
        keep_embeddings=args.keep_embeddings,
    )
    try:
        out = build_index_folder(config, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except TimeoutError as err:
        raise CLIError(str(err)) from None
    if out is not None:
        print(f"index written to {out}")
    return 0


def _run_search(args: argparse.Namespace) -> int:
    from selfrag_jax.retrieval.retriever import Retriever

    if args.k < 1:
        raise CLIError("-k must be at least 1")
    hits = Retriever.from_dir(args.index, encoder_path=args.encoder).retrieve([args.query], args.k)[0]
    if args.json:
        print(json.dumps(hits, ensure_ascii=False, indent=2))
        return 0
    for rank, hit in enumerate(hits, 1):
        text = hit["text"] if len(hit["text"]) <= 240 else hit["text"][:237] + "..."
        print(f"{rank}. [{hit['score']:.4f}] {hit['title']} (id {hit['id']})\n   {text}")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from selfrag_jax.retrieval.retriever import Retriever
    from selfrag_jax.retrieval.server import ServerConfig, serve

    if bool(args.index) == bool(args.shard):
        raise CLIError("give an index folder DIR or --shard URL (one per shard), not both" if args.index else
                       "give an index folder DIR or at least one --shard URL")  # fmt: skip
    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
        max_k=args.max_k,
        batch_wait_ms=args.batch_wait_ms,
        max_batch=args.max_batch,
    )
    passages = None
    if args.shard:
        retriever, passages = _fan_out(args)
    else:
        retriever = Retriever.from_dir(args.index, encoder_path=args.encoder)
        retriever.warmup(max_batch=min(16, config.max_batch))  # compile before the first request
    try:
        serve(retriever, config, log=lambda msg: print(msg, flush=True), passages=passages)
    except OSError as err:
        raise CLIError(f"cannot listen on {config.host}:{config.port}: {err}") from None
    return 0


def _fan_out(args: argparse.Namespace):
    """The `ShardedRetriever` of the --shard services and their passages summed; a shard down
    at start is an error (a warning with --allow-partial), so a typo fails before serving."""
    from selfrag_jax.retrieval.retriever import RetrieverClient, ShardedRetriever

    if args.encoder:
        raise CLIError("--encoder applies to an index folder DIR, not to --shard (each shard has its own)")
    if args.shard_timeout <= 0:
        raise CLIError(f"--shard-timeout {args.shard_timeout}: must be positive")
    try:
        retriever = ShardedRetriever([RetrieverClient(url, timeout=args.shard_timeout) for url in args.shard],
                                     allow_partial=args.allow_partial)  # fmt: skip
    except ValueError as err:
        raise CLIError(f"--shard: {err}") from None
    shards = retriever.health()
    down = [s["error"] for s in shards if s["status"] != "ok"]
    if not retriever.serving(len(down)):
        raise CLIError(down[0])
    for error in down:
        print(f"warning: {error}; serving without it until it answers (--allow-partial)", file=sys.stderr, flush=True)
    return retriever, sum(s.get("passages", 0) for s in shards)
