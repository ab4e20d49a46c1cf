"""bfloat16 against float32 on the shipped models: `python -m bench.bench_dtype [--small]`.

The demo's Self-RAG setting (the shipped generator, its dev-chosen depth, the bundled index)
on the demo's held-out questions, decoded once with float32 parameters and KV cache and once
with bfloat16 (`generate --dtype bfloat16`). Reports, per task and over all, the share of
questions with the same retrieve decision and the same chosen passage, and the accuracy of
each. Goal (the sharded-decoding issue): at least 95% the same, accuracy within 1 point.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.common import machine_info, now, versions, write_result


def decode(models: Path, work: Path, dtype: str, limit: int, batch_size: int) -> dict[str, list[dict]]:
    from selfrag_jax.demo.decoding import load_engine, load_items, model_ndocs, run_batches
    from selfrag_jax.demo.demo import TASKS
    from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
    from selfrag_jax.retrieval.retriever import Retriever

    engine, tok = load_engine(models / "generator", dtype=dtype)
    retrieve = Retriever.from_dir(work / "index").retrieve
    ndocs, _ = model_ndocs(models)
    out = {}
    for name, (task, default_n) in TASKS.items():
        items = load_items(work / "world" / "eval" / f"{name}.jsonl", limit or default_n)
        runner = ShortForm(engine, tok, replace(GenerateOptions(ndocs=ndocs), task=task), retrieve)
        out[name] = [(runner.record(r), it.record["answers"])
                     for r, it in zip(run_batches(runner, items, batch_size, f"{dtype}/{name}"), items)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/bench_dtype", help="world and index folder (built when missing)")
    parser.add_argument("--small", action="store_true", help="20 questions per task")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    from selfrag_jax.bundled import ASSETS
    from selfrag_jax.demo.pipeline import Stages
    from selfrag_jax.metrics import match

    work = Path(args.work)
    stages = Stages(work)
    stages.stage("world", lambda: stages.world(training=False))
    stages.stage("index", stages.index)
    limit = 20 if args.small else 0
    runs, seconds = {}, {}
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        runs[dtype] = decode(ASSETS, work, dtype, limit, args.batch_size)
        seconds[dtype] = round(time.perf_counter() - start, 1)

    def chosen(rec):
        return rec["candidates"][rec["chosen"]]["passage"]["id"] if rec["chosen"] is not None else None

    tasks, all_same = {}, {"retrieve": [], "passage": [], "f32": [], "bf16": []}
    for name in runs["float32"]:
        f32, bf16 = runs["float32"][name], runs["bfloat16"][name]
        same_ret = [a["retrieved"] == b["retrieved"] for (a, _), (b, _) in zip(f32, bf16)]
        same_psg = [chosen(a) == chosen(b) for (a, _), (b, _) in zip(f32, bf16)]
        acc = {k: [match(r["prediction"], answers) for r, answers in v] for k, v in (("f32", f32), ("bf16", bf16))}
        tasks[name] = {"n": len(f32), "same_retrieve": float(np.mean(same_ret)), "same_passage": float(np.mean(same_psg)),
                       "accuracy_float32": float(np.mean(acc["f32"])), "accuracy_bfloat16": float(np.mean(acc["bf16"]))}
        for key, values in (("retrieve", same_ret), ("passage", same_psg), ("f32", acc["f32"]), ("bf16", acc["bf16"])):
            all_same[key] += values
    overall = {"n": len(all_same["retrieve"]), "same_retrieve": float(np.mean(all_same["retrieve"])),
               "same_passage": float(np.mean(all_same["passage"])), "accuracy_float32": float(np.mean(all_same["f32"])),
               "accuracy_bfloat16": float(np.mean(all_same["bf16"]))}
    same = min(overall["same_retrieve"], overall["same_passage"])
    gap = abs(overall["accuracy_bfloat16"] - overall["accuracy_float32"])
    for name, row in {**tasks, "all": overall}.items():
        print(f"{name:18s} n={row['n']:4d} same retrieve {row['same_retrieve']:.3f} same passage "
              f"{row['same_passage']:.3f} accuracy f32 {row['accuracy_float32']:.3f} bf16 {row['accuracy_bfloat16']:.3f}")
    result = {"date": now(), "machine": machine_info(), "versions": versions("flax"), "small": args.small,
              "seconds": seconds, "tasks": tasks, "all": overall,
              "summary": [{"what": "shipped models in bfloat16 vs float32: same retrieve decision and passage",
                           "ours": f"{same:.1%} same", "peer": f"n={overall['n']}", "ratio": None,
                           "goal": ">= 95% same", "met": same >= 0.95},
                          {"what": "shipped models in bfloat16 vs float32: demo accuracy",
                           "ours": f"{overall['accuracy_bfloat16']:.3f}", "peer": f"{overall['accuracy_float32']:.3f}",
                           "ratio": None, "goal": "within 1 point", "met": gap <= 0.01}]}
    write_result("dtype_small" if args.small else "dtype", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
