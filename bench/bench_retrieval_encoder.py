"""Passages per second: the Flax encoder vs sentence-transformers (PyTorch), same passages.

    python -m bench.bench_retrieval_encoder           # 5,000 passages
    python -m bench.bench_retrieval_encoder --small   # 500 passages, a quick correctness run

Both embed the same Wikipedia-shaped passages (title + 40-160 words drawn from the model's
own vocabulary) with the bundled all-MiniLM-L6-v2 in float32 on the CPU cores, batch 64,
tokenisation included. Each side's first full run is untimed (Flax compiles there; its
time is reported apart). Medians of --repeats runs; the
result also records how close the two embeddings are. Writes
bench/results/retrieval_encoder[_small].json.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np

from bench.common import machine_info, median_time, versions, write_result


def make_passages(n: int, vocab_file: str, seed: int = 0) -> list[str]:
    words = [w.strip() for w in open(vocab_file, encoding="utf-8") if w.strip().isalpha() and len(w.strip()) > 2]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        title = " ".join(rng.choices(words, k=rng.randint(1, 4))).title()
        body = " ".join(rng.choices(words, k=rng.randint(40, 160)))
        out.append(f"{title} {body}.")
    return out


def summary(result: dict) -> list[dict]:
    """README row (bench/common.py convention)."""
    ratio = result["ratios"]["flax_vs_sentence_transformers"]
    return [{
        "what": f"retrieval_encoder: Flax MiniLM vs sentence-transformers, {result['config']['passages']:,} passages",
        "ours": f"{result['flax']['passages_per_s']:,.1f} passages/s",
        "peer": f"{result['sentence_transformers']['passages_per_s']:,.1f} passages/s",
        "ratio": ratio, "goal": "ratio >= 1", "met": ratio >= 1.0,
    }]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="500 passages")
    parser.add_argument("--n", type=int, help="passages (default 5,000; 500 with --small)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.n or (500 if args.small else 5_000)
    threads = os.cpu_count() or 1

    import torch
    from sentence_transformers import SentenceTransformer

    from selfrag_jax.retrieval.encoder import EncoderConfig, TextEncoder, resolve_encoder_path

    torch.set_num_threads(threads)
    folder = resolve_encoder_path("all-MiniLM-L6-v2")
    passages = make_passages(n, str(folder / "vocab.txt"))

    flax_encoder = TextEncoder.load(config=EncoderConfig(batch_size=args.batch_size))
    tokens = [len(t) for t in flax_encoder.tokenize(passages)]
    t0 = time.perf_counter()
    flax_out = flax_encoder.encode(passages)  # compiles every bucket it meets
    first_run_s = time.perf_counter() - t0
    flax_s, flax_runs = median_time(lambda: flax_encoder.encode(passages), args.repeats)
    print(f"flax: {n / flax_s:.1f} passages/s (first run with compiles {first_run_s:.1f}s)", flush=True)

    st = SentenceTransformer(str(folder), device="cpu")
    st_out = st.encode(passages, batch_size=args.batch_size)  # untimed, like the Flax first run
    st_s, st_runs = median_time(lambda: st.encode(passages, batch_size=args.batch_size), args.repeats)
    print(f"sentence-transformers: {n / st_s:.1f} passages/s", flush=True)

    cosine = (flax_out * st_out).sum(1) / np.linalg.norm(flax_out, axis=1) / np.linalg.norm(st_out, axis=1)
    result = {
        "machine": machine_info(),
        "versions": versions("jax", "jaxlib", "flax", "torch", "sentence-transformers", "transformers", "tokenizers"),
        "config": {"passages": n, "batch_size": args.batch_size, "repeats": args.repeats, "threads": threads,
                   "tokens_mean": float(np.mean(tokens)), "tokens_max": int(max(tokens)),
                   "encoder": "all-MiniLM-L6-v2 (max length 256, float32)", "jax_devices": len(flax_encoder.devices),
                   "buckets": list(flax_encoder.buckets)},  # fmt: skip
        "flax": {"passages_per_s": n / flax_s, "runs_s": flax_runs, "median_s": flax_s, "first_run_with_compile_s": first_run_s,
                 "compiled_shapes": sorted(flax_encoder.compiled_shapes)},  # fmt: skip
        "sentence_transformers": {"passages_per_s": n / st_s, "runs_s": st_runs, "median_s": st_s},
        "agreement": {"min_cosine": float(cosine.min()), "mean_cosine": float(cosine.mean())},
        "ratios": {"flax_vs_sentence_transformers": st_s / flax_s},
    }
    result["goals"] = {"flax_vs_sentence_transformers >= 1.0": result["ratios"]["flax_vs_sentence_transformers"] >= 1.0}
    result["summary"] = summary(result)
    path = write_result("retrieval_encoder_small" if args.small else "retrieval_encoder", result)
    print(f"ratio flax / sentence-transformers: {result['ratios']['flax_vs_sentence_transformers']:.2f}, "
          f"min cosine {cosine.min():.6f} -> {path}")  # fmt: skip


if __name__ == "__main__":
    main()
