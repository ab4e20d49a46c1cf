"""`selfrag-jax serve` under load, on loopback: throughput and latency percentiles.

`python -m bench.bench_serve [--small] [--ndocs K]` -> bench/results/serve[_kK][_small].json

The shipped models and the bundled world (its index built here once, under --work) behind
one `serve` process with its defaults (adaptive retrieval, refusal on: the `open` task) at the
depth shipped with the models (--ndocs to change it); clients post the world's held-out world_qa questions (no ctxs: the
server retrieves) for a fixed time each:
1. one client, one request at a time (Self-RAG);
2. --clients concurrent clients (Self-RAG): throughput against 1. Goal: at least 4x;
3. the same clients asking for naive RAG (`options.pipeline`) in the same server: Self-RAG's
   P95 against naive RAG's. Goal: within 1.3x (practitioners expect 2-4x).
The three phases run alternated --repeats times (medians reported), so a slow spell of a shared
machine touches all of them. Clients and server share the machine's cores, so client time is
in every figure.

The load generator (`load`) is reusable: bounded concurrency and duration, loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine_info, now, versions, write_result

REPO = Path(__file__).resolve().parents[1]
GOAL_THROUGHPUT = 4.0
GOAL_P95 = 1.3


def load(port: int, payloads: list[dict], clients: int, seconds: float, path: str = "/generate") -> dict[str, Any]:
    """`clients` threads, each posting the next payload as soon as its last answer came, for
    `seconds`; answers per second and latency percentiles of the answered requests."""
    if not 1 <= clients <= 256 or not 0 < seconds <= 3600:
        raise ValueError("load: 1-256 clients for at most an hour")
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock, counter = threading.Lock(), iter(range(1 << 62))
    stop_at = time.perf_counter() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)  # loopback only
        while time.perf_counter() < stop_at:
            body = json.dumps(payloads[next(counter) % len(payloads)]).encode()
            start = time.perf_counter()
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            with lock:
                statuses[response.status] = statuses.get(response.status, 0) + 1
                if response.status == 200:
                    latencies.append(time.perf_counter() - start)
        conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start  # the last requests finish after stop_at: counted in
    lat = np.asarray(latencies)
    return {"clients": clients, "seconds": wall, "answered": len(latencies), "statuses": statuses,
            "throughput_rps": len(latencies) / wall,
            **{f"p{q}_s": float(np.percentile(lat, q)) if lat.size else None for q in (50, 95, 99)}}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median throughput, and every repeat's throughput and P95 beside it."""
    ordered = sorted(runs, key=lambda r: r["throughput_rps"])
    return {**ordered[len(ordered) // 2], "repeats": [{k: r[k] for k in ("throughput_rps", "p95_s")} for r in runs]}


def prepare(work: Path) -> tuple[Path, list[str]]:
    """The bundled world's index (built once) and its held-out world_qa questions."""
    from selfrag_jax.demo.pipeline import Stages

    stages = Stages(work, log=lambda *_: None)
    if not (work / "index" / "manifest.json").exists():
        stages.world(training=False)
        stages.index()
    lines = (work / "world" / "eval" / "world_qa.jsonl").read_text().splitlines()
    return work / "index", [json.loads(line)["question"] for line in lines if line.strip()]


def start_server(index: Path, port: int, args) -> subprocess.Popen:
    from selfrag_jax.bundled import ASSETS
    from selfrag_jax.demo.decoding import model_ndocs

    ndocs = args.ndocs or model_ndocs(ASSETS)[0]
    cmd = [sys.executable, "-m", "selfrag_jax", "serve", "--model", str(ASSETS / "generator"), "--index", str(index),
           "--port", str(port), "--batch-size", str(args.batch_size), "--ndocs", str(ndocs),
           "--max-new-tokens", str(args.max_new_tokens)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited: {proc.stdout.read()[-2000:]}")
            time.sleep(1)
    proc.kill()
    raise SystemExit("serve did not come up in 10 minutes")


def metrics(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    return json.loads(conn.getresponse().read())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few seconds per phase: checks that it runs")
    parser.add_argument("--seconds", type=float, help="per phase and repeat [20; 4 with --small]")
    parser.add_argument("--repeats", type=int, default=3, help="the three phases, alternated, this many times (medians)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16, help="the server's questions per engine step")
    parser.add_argument("--ndocs", type=int, help="passages per question [the depth shipped with the models]")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--work", default="runs/bench_serve", help="where the world and its index are built once")
    args = parser.parse_args(argv)
    seconds = args.seconds or (4.0 if args.small else 20.0)
    os.environ.setdefault("SELFRAG_NO_PROGRESS", "1")
    index, questions = prepare(Path(args.work))
    selfrag = [{"question": q} for q in questions]
    naive = [{"question": q, "options": {"pipeline": "naive"}} for q in questions]
    proc = start_server(index, args.port, args)
    try:
        load(args.port, selfrag[:args.clients], args.clients, min(seconds, 10.0))  # warm the paths, not timed
        plan = {"selfrag_1": (selfrag, 1), f"selfrag_{args.clients}": (selfrag, args.clients),
                f"naive_{args.clients}": (naive, args.clients)}
        runs: dict[str, list] = {name: [] for name in plan}
        for _ in range(args.repeats):  # alternated, so a slow spell of the machine touches every phase
            for name, (payloads, clients) in plan.items():
                runs[name].append(load(args.port, payloads, clients, seconds))
        phases = {name: median_run(rs) for name, rs in runs.items()}
        server = metrics(args.port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    one, many, base = phases["selfrag_1"], phases[f"selfrag_{args.clients}"], phases[f"naive_{args.clients}"]
    ratio = many["throughput_rps"] / one["throughput_rps"]
    p95 = base["p95_s"] / many["p95_s"]
    tag = (f", K={args.ndocs}" if args.ndocs else "") + (" (small)" if args.small else "")
    summary = [
        {"what": f"serve: throughput, {args.clients} clients vs one at a time, Self-RAG, bundled models{tag}",
         "ours": f"{many['throughput_rps']:.1f} req/s", "peer": f"{one['throughput_rps']:.1f} req/s", "ratio": ratio,
         "goal": f"ratio >= {GOAL_THROUGHPUT:g}", "met": ratio >= GOAL_THROUGHPUT},
        {"what": f"serve: P95 latency, Self-RAG vs naive RAG, {args.clients} clients, same server{tag}",
         "ours": f"{many['p95_s'] * 1000:.0f} ms", "peer": f"{base['p95_s'] * 1000:.0f} ms", "ratio": p95,
         "goal": f"ratio >= {1 / GOAL_P95:.3g} (Self-RAG <= {GOAL_P95:g}x naive)", "met": p95 >= 1 / GOAL_P95}]
    result = {"machine": machine_info(), "versions": versions("aiohttp"), "seconds_per_phase": seconds,
              "repeats": args.repeats,
              "batch_size": args.batch_size, "ndocs": args.ndocs or "shipped depth", "max_new_tokens": args.max_new_tokens, "phases": phases,
              "server_metrics": server, "summary": summary, "date": now()}
    path = write_result("serve" + (f"_k{args.ndocs}" if args.ndocs else "") + ("_small" if args.small else ""), result)
    for name, phase in phases.items():
        print(f"{name}: {phase['throughput_rps']:.1f} req/s, p50 {phase['p50_s'] * 1000:.0f} ms, "
              f"p95 {phase['p95_s'] * 1000:.0f} ms, p99 {phase['p99_s'] * 1000:.0f} ms, statuses {phase['statuses']}")
    for row in summary:
        print(f"{row['what']}: {row['ours']} vs {row['peer']}, ratio {row['ratio']:.3g} "
              f"[{row['goal']}: {'met' if row['met'] else 'not met'}]")
    print(f"warm-up: {server['programs_warmed_up']} programs in {server['warm_up_s']:.0f} s; compiled after it: "
          f"{server['programs_compiled_after_warm_up']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
