"""What an index of the paper's 21M x 768 passages costs, extrapolated from measured builds.

    python -m bench.retrieval_scale                       # 0.5M, 1M, 2M x 768 (int8) + 1M float32
    python -m bench.retrieval_scale --points 500000:int8  # one point

Each point is one `build_index` (automatic parameters, search settings calibrated for 0.95,
as `index build` does; the re-scoring store in the dtype named) over clustered unit vectors
of Contriever's 768 dimensions, in its own process so that its peak RSS is its own. Measured:
build and calibration time, peak RSS, the serialized index's bytes per passage by file,
recall@10 and QPS of the calibrated settings on held-out points. The 21M row fits bytes per
passage and build time against n (least squares on log-log for time) and adds the passage
text at the DPR Wikipedia split's size (100-word passages, --text-bytes). Not a timing goal:
`run_all` does not run it. Writes bench/results/retrieval_scale.json.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import machine_info, median_time, versions, write_result

TARGET_N = 21_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=["500000:int8", "1000000:int8", "2000000:int8", "1000000:float32"],
                        help="N:REORDER_DTYPE builds to measure")  # fmt: skip
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--text-bytes", type=float, default=650.0,
                        help="passage text per passage in the store (a 100-word Wikipedia passage with its title, as JSON)")  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one point in this process
    args = parser.parse_args()
    if args.one:
        n, dtype = args.one.split(":")
        print(json.dumps(measure(int(n), args.dim, dtype, args.queries)))
        return

    points = []
    for spec in args.points:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "bench.retrieval_scale", "--one", spec, "--dim", str(args.dim),
                              "--queries", str(args.queries)], capture_output=True, text=True, check=False)  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"point {spec} failed:\n{out.stderr[-2000:]}")
        point = json.loads(out.stdout.strip().splitlines()[-1])
        points.append(point)
        print(f"{spec}: {json.dumps({k: v for k, v in point.items() if k != 'index_files'})} ({time.perf_counter() - t0:.0f}s)", flush=True)
    result = {"machine": machine_info(), "versions": versions("scann"),
              "config": {"dim": args.dim, "queries": args.queries, "text_bytes": args.text_bytes, "target_n": TARGET_N},
              "points": points, "plan": plan(points, args.dim, args.text_bytes)}  # fmt: skip
    result["summary"] = [{
        "what": f"retrieval_scale: {TARGET_N / 1e6:.0f}M x {args.dim}, {dtype} re-scoring, from builds at "
                + ", ".join(f"{p['n'] / 1e6:g}M" for p in points if p["reorder_dtype"] == dtype),
        "ours": f"{row['bytes_per_passage_index']:,.0f} B/passage index + {args.text_bytes:.0f} text; "
                f"{row['index_gb']:.0f} GB index, {row['peak_rss_gb']:.0f} GB build RAM, {row['build_h']:.1f} h build on this machine",
        "peer": "-", "ratio": None, "goal": None, "met": None,
    } for dtype, row in result["plan"].items()]  # fmt: skip
    print(json.dumps(result["plan"], indent=1))
    print(f"-> {write_result('retrieval_scale', result)}")


def measure(n: int, dim: int, reorder_dtype: str, n_queries: int) -> dict:
    from selfrag_jax.retrieval.index import ExactIndex, build_index
    from selfrag_jax.retrieval.synthetic import clustered_vectors, recall_at_k

    t0 = time.perf_counter()
    vectors = clustered_vectors(n + n_queries, dim, max(10, n // 100), seed=0)
    db, queries = vectors[:n], vectors[n:].copy()  # rows are i.i.d.; a view, so the peak RSS is the build's
    data_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index, calibration = build_index(db, "scann", normalized=True, overrides={"reorder_dtype": reorder_dtype}, target_recall=0.95)
    build_s = time.perf_counter() - t0
    _, truth = ExactIndex(db, keep_on_device=False).search(queries, 10)
    search = lambda: index.search(queries, 10)  # noqa: E731
    recall = recall_at_k(search()[1], truth)
    seconds, _ = median_time(search, 3)
    with tempfile.TemporaryDirectory() as tmp:
        index.save(Path(tmp))
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file()}
    return {
        "n": n, "dim": dim, "reorder_dtype": reorder_dtype, "params": dict(index.params.__dict__),
        "data_s": data_s, "build_s": build_s, "calibration_recall": calibration.get("recall"),
        "recall": recall, "qps": n_queries / seconds,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,  # Linux: KiB
        "vectors_gb": db.nbytes / 1e9, "index_bytes": sum(files.values()),
        "bytes_per_passage_index": sum(files.values()) / n, "index_files": files,
    }  # fmt: skip


def plan(points: list[dict], dim: int, text_bytes: float) -> dict:
    """Per re-scoring dtype: the 21M row from the measured points (bytes per passage of the
    largest build, build RAM a line in n, build time a power law in n)."""
    out = {}
    for dtype in sorted({p["reorder_dtype"] for p in points}):
        pts = sorted((p for p in points if p["reorder_dtype"] == dtype), key=lambda p: p["n"])
        ns = np.array([p["n"] for p in pts], float)
        per = pts[-1]["bytes_per_passage_index"]  # the largest build: fixed costs amortised most
        rss = np.array([p["peak_rss_gb"] for p in pts])
        rss_fit = np.polyfit(ns, rss, 1) if len(pts) > 1 else np.array([rss[0] / ns[0], 0.0])  # GB = a n + b
        if len(pts) > 1:
            slope, intercept = np.polyfit(np.log(ns), np.log([p["build_s"] for p in pts]), 1)
        else:
            slope, intercept = 1.0, math.log(pts[0]["build_s"] / ns[0])
        build_s = math.exp(intercept) * TARGET_N**slope
        out[dtype] = {
            "measured_n": [int(n) for n in ns], "bytes_per_passage_index": per,
            "bytes_per_passage_total": per + text_bytes + 8,  # + text + its int64 offset
            "index_gb": per * TARGET_N / 1e9, "text_gb": (text_bytes + 8) * TARGET_N / 1e9,
            "vectors_gb_float32": TARGET_N * dim * 4 / 1e9,
            "peak_rss_gb": float(np.polyval(rss_fit, TARGET_N)),
            "build_time_exponent": float(slope), "build_h": build_s / 3600,
            "recall_at_measured": [p["recall"] for p in pts], "qps_at_measured": [p["qps"] for p in pts],
        }  # fmt: skip
    return out


if __name__ == "__main__":
    main()
