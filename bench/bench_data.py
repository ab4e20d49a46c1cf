"""Throughput of the training data path: read, tokenize, mask and pack 10,000 Self-RAG
generator records of the bundled world into [8, 2048] batches, one epoch.

`python -m bench.bench_data [--records N] [--repeats R]` -> bench/results/data.json with the
median examples/s of R runs for the numpy path and (when TensorFlow/seqio are installed)
the seqio + TFDS path (TFDS preparation timed separately; it runs once per file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib import metadata

OUT = os.path.join(os.path.dirname(__file__), "results", "data.json")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("numpy", "jax", "transformers", "tokenizers", "tensorflow", "seqio", "tensorflow-datasets"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}


def one_epoch(cfg, tok, backend: str) -> dict:
    from selfrag_jax.data import batches

    t0 = time.perf_counter()
    it = batches(cfg, tok, backend=backend)
    t_setup = time.perf_counter() - t0
    n_batches = sum(1 for _ in it)
    seconds = time.perf_counter() - t0
    s = it.stats
    return {"seconds": seconds, "setup_seconds": t_setup, "examples_per_s": s["examples"] / seconds,
            "tokens_per_s": s["tokens"] / seconds, "batches": n_batches, **s,
            "fill": s["tokens"] / (n_batches * cfg.batch_size * cfg.seq_len)}


def summarise(runs: list[dict]) -> dict:
    return {"median_examples_per_s": statistics.median(r["examples_per_s"] for r in runs),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_seconds": statistics.median(r["seconds"] for r in runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)

    from selfrag_jax.data import DataConfig, generator_task
    from selfrag_jax.tokenizer import SelfRAGTokenizer
    from selfrag_jax.utils import atomic_file
    from selfrag_jax.world import WorldConfig, build_world

    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build_world(tmp, config=WorldConfig(n_generator=args.records))
        world_s = time.perf_counter() - t0
        tok = SelfRAGTokenizer.from_pretrained(os.path.join(tmp, "tokenizer"))
        path = os.path.join(tmp, "train", "generator.jsonl")
        cfg = DataConfig((generator_task(path),), batch_size=args.batch_size, seq_len=args.seq_len, seed=0,
                         num_epochs=1, shard_index=0, num_shards=1)
        result = {"benchmark": "data pipeline: read + tokenize + mask + pack, one epoch",
                  "records": args.records, "seq_len": args.seq_len, "batch_size": args.batch_size, "masking": "paper",
                  "world_build_seconds": world_s, "machine": info, "versions": versions(),
                  "note": "2-core machine that may have been shared with other jobs while this ran; numbers are noisy"}
        result["numpy"] = summarise([one_epoch(cfg, tok, "numpy") for _ in range(args.repeats)])
        print(f"numpy: {result['numpy']['median_examples_per_s']:.0f} examples/s", file=sys.stderr)
        try:
            from selfrag_jax.data.seqio_tasks import prepare_jsonl
        except ImportError as err:
            result["seqio"] = {"skipped": f"not installed: {err}"}
        else:
            os.environ["SELFRAG_JAX_TFDS_DIR"] = os.path.join(tmp, "tfds")
            t0 = time.perf_counter()
            prepare_jsonl(path, "generator")
            prep = time.perf_counter() - t0
            result["seqio"] = {"tfds_prepare_seconds": prep,
                               **summarise([one_epoch(cfg, tok, "seqio") for _ in range(args.repeats)])}
            print(f"seqio: {result['seqio']['median_examples_per_s']:.0f} examples/s", file=sys.stderr)
    result["machine"]["loadavg_end"] = os.getloadavg()
    with atomic_file(args.out) as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: result[k]["median_examples_per_s"] for k in ("numpy", "seqio") if "median_examples_per_s" in result[k]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
