"""`selfrag-jax sweep --cache DIR --grid SPEC --out DIR [--task TASK]`.

Writes, in one atomic folder swap: `sweep.csv` (one row per configuration: its settings,
the released `match` metric and the retrieval frequency), `summary.json` (best
configuration, sizes, timing, devices) and two plots after the paper's Figure 3:
`w_sup.png` (the metric against w_sup, one line per hard constraint, the other settings
at the best configuration's) and `threshold.png` (the metric against retrieval frequency
as the threshold moves, one line per threshold rule); with several `ndocs`, `ndocs.png`
(the metric against the retrieval depth, one line per hard constraint).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from selfrag_jax.evaluation import sweep as S
from selfrag_jax.utils import pyplot


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", required=True, help="folder written by generate --cache")
    p.add_argument("--grid", required=True, help="e.g. w_sup=0:2:11,threshold=0:1:21,rule=paper|released "
                                                 "(keys: " + ", ".join(S.PARAMS) + "), or a YAML/JSON file")
    p.add_argument("--out", required=True, help="output folder (replaced atomically)")
    p.add_argument("--task", help="eval task whose gold rules the metric uses (default: the cache's task)")
    p.add_argument("--chunk", type=int, help="configurations per compiled step (default: sized to memory)")


def run(args: argparse.Namespace) -> int:
    from selfrag_jax import distributed
    from selfrag_jax.cli import CLIError
    from selfrag_jax.inference.cache import load_cache

    distributed.initialize()
    try:
        grid = S.parse_grid(args.grid)
    except ValueError as err:
        raise CLIError(str(err)) from None
    configs = S.expand(grid)
    cache = load_cache(args.cache)
    if not cache.questions:
        raise CLIError(f"{args.cache}: the cache holds no questions")
    started = time.perf_counter()
    prep = S.prepare(cache, args.task)
    prepared = time.perf_counter()
    result = S.sweep_all_hosts(prep, configs, chunk=args.chunk, progress=True)
    if result is None:  # not process 0: process 0 writes
        return 0
    swept = time.perf_counter()
    rows = S.result_rows(result)
    best = max(rows, key=lambda r: (r["metric"], -r["config"]))
    summary = {"cache": str(args.cache), "task": args.task or cache.meta["task"], "configurations": len(rows),
               "questions": len(cache.questions), "candidates_per_question": prep.shape[1],
               "grid": grid, "best": best, "devices": result.devices, "chunk": result.chunk,
               "seconds": {"prepare": prepared - started, "sweep": swept - prepared}}
    write_outputs(Path(args.out), rows, summary, grid)
    print(f"{len(rows)} configurations x {len(cache.questions)} questions in {swept - prepared:.2f} s "
          f"on {result.devices} device(s); best match {100 * best['metric']:.1f} "
          f"(retrieval {100 * best['retrieval_frequency']:.1f}%): "
          + " ".join(f"{k}={best[k]}" for k in S.PARAMS) + f" -> {args.out}")
    return 0


def write_outputs(out: Path, rows: list[dict], summary: dict, grid: dict) -> None:
    from selfrag_jax.utils import atomic_dir

    with atomic_dir(out) as tmp:
        with open(tmp / "sweep.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (tmp / "summary.json").write_text(S.to_json(summary) + "\n")
        plot_w_sup(rows, summary["best"], tmp / "w_sup.png")
        plot_threshold(rows, summary["best"], tmp / "threshold.png")
        if len(grid.get("ndocs", ())) > 1:
            plot_ndocs(rows, summary["best"], tmp / "ndocs.png")


def _slice(rows: list[dict], best: dict, free: tuple[str, ...]) -> list[dict]:
    """Rows equal to the best configuration except in the `free` parameters."""
    fixed = [k for k in S.PARAMS if k not in free]
    return [r for r in rows if all(r[k] == best[k] for k in fixed)]


def plot_w_sup(rows: list[dict], best: dict, path: Path) -> None:
    """Fig. 3 (b)-style: how the IsSup weight moves the metric."""
    _plot_per_hard(rows, best, "w_sup", "w_sup (IsSup weight)", path,
                   f"w_rel={best['w_rel']:g} w_use={best['w_use']:g} threshold={best['threshold']:g} ({best['rule']})")


def plot_ndocs(rows: list[dict], best: dict, path: Path) -> None:
    """The metric against the retrieval depth K: how many of the retriever's passages the
    critique scores choose among (0 on the axis: every cached candidate)."""
    _plot_per_hard(rows, best, "ndocs", "ndocs (retrieval depth)", path,
                   f"w_rel={best['w_rel']:g} w_sup={best['w_sup']:g} w_use={best['w_use']:g} w_ret={best['w_ret']:g}")


def _plot_per_hard(rows: list[dict], best: dict, key: str, xlabel: str, path: Path, title: str) -> None:
    """The metric against `key`, one line per hard constraint, the rest at the best's."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for hard in dict.fromkeys(r["hard"] for r in rows):
        pts = sorted((r[key], r["metric"]) for r in _slice(rows, {**best, "hard": hard}, (key,)))
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=f"hard={hard}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("match (%)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_threshold(rows: list[dict], best: dict, path: Path) -> None:
    """Fig. 3 (c)-style: accuracy against retrieval frequency as the threshold moves."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for rule in dict.fromkeys(r["rule"] for r in rows):
        pts = sorted((r["threshold"], r["retrieval_frequency"], r["metric"])
                     for r in _slice(rows, {**best, "rule": rule}, ("threshold",)))
        ax.plot([100 * p[1] for p in pts], [100 * p[2] for p in pts], marker="o", label=f"rule={rule}")
        for t, f, m in pts[:: max(1, len(pts) // 6)]:
            ax.annotate(f"{t:g}", (100 * f, 100 * m), fontsize=6)
    ax.set_xlabel("retrieval frequency (%)")
    ax.set_ylabel("match (%)")
    ax.set_title("threshold sweep (labels: delta)", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
