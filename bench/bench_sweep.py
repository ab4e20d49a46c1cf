"""Sweep speed: re-ranking a cache under a grid vs decoding once per configuration.

    python -m bench.bench_sweep           # 10,000 configurations x 10,000 questions
    python -m bench.bench_sweep --small   # 1,250 configurations x 1,000 questions

Workload: a synthetic `--cache` in the real schema (random critique distributions, K = 5
candidates, some questions with fewer; `evaluation.synthetic`), grid over w_rel, w_sup,
w_use, the threshold and both threshold rules. Timed: `sweep.run_sweep` on all local
devices (median of --repeats runs after one untimed run that compiles), excluding the
host-side preparation (timed apart; it runs once per cache).
Peers: (1) decoding once per configuration -- configurations x questions x the measured
decode time per question, read from bench/results/decode.json (else decode_small.json,
the tiny-model run: a lower bound of a real model's time); (2) `candidates.choose` (numpy,
one configuration at a time), timed on a few configurations and extrapolated.
Goal: the sweep is at least 100x faster than decoding per configuration.
Writes bench/results/sweep[_small].json.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import RESULTS, machine_info, median_time, now, versions, write_result


def decode_seconds_per_question() -> tuple[float, str]:
    for name in ("decode.json", "decode_small.json"):
        path = RESULTS / name
        if path.exists():
            d = json.loads(path.read_text())
            return d["ours"]["seconds"] / d["workload"]["questions"], f"bench/results/{name} (ours.seconds / questions)"
    raise SystemExit("no bench/results/decode*.json: run `python -m bench.bench_decode --small` first")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="1,250 configurations x 1,000 questions")
    parser.add_argument("--questions", type=int)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import jax

    from selfrag_jax.evaluation import sweep as S
    from selfrag_jax.evaluation.synthetic import synthetic_cache
    from selfrag_jax.inference.cache import predictions
    from selfrag_jax.inference.candidates import choose

    questions = args.questions or (1_000 if args.small else 10_000)
    spec = ("w_rel=0:2:5,w_sup=0:2:5,w_use=0:1:5,threshold=0:1:5,rule=paper|released" if args.small else
            "w_rel=0:2:5,w_sup=0:2:10,w_use=0:1:5,threshold=0:1:20,rule=paper|released")
    configs = S.expand(S.parse_grid(spec))
    cache = synthetic_cache(questions, args.k, "open", seed=0)
    start = time.perf_counter()
    prep = S.prepare(cache)
    prepare_s = time.perf_counter() - start

    start = time.perf_counter()
    first = S.run_sweep(prep, configs)
    first_s = time.perf_counter() - start
    sweep_s, runs = median_time(lambda: S.run_sweep(prep, configs), args.repeats)

    sample = configs[:: max(1, len(configs) // 5)][:5]
    table = cache.table()
    choose_s, _ = median_time(lambda: [predictions(cache, choose(table, c.options())) for c in sample], 1)
    choose_all_s = choose_s / len(sample) * len(configs)

    per_question, source = decode_seconds_per_question()
    decode_all_s = per_question * questions * len(configs)
    ratio = decode_all_s / sweep_s
    result = {
        "benchmark": "sweep" + ("_small" if args.small else ""), "date": now(), "machine": machine_info(),
        "versions": versions(), "note": "2-core machine shared with other jobs while this ran; numbers are noisy",
        "workload": {"configurations": len(configs), "questions": questions, "k": args.k, "grid": spec,
                     "devices": first.devices, "chunk": first.chunk},
        "ours": {"median_s": sweep_s, "runs_s": runs, "first_run_with_compile_s": first_s, "prepare_s": prepare_s,
                 "configurations_per_s": len(configs) / sweep_s,
                 "best_metric": float(first.metric.max())},
        "peers": {"decode_per_configuration_s": decode_all_s, "decode_seconds_per_question": per_question,
                  "decode_source": source, "choose_numpy_extrapolated_s": choose_all_s,
                  "choose_configurations_timed": len(sample)},
        "ratios": {"vs_decoding": ratio, "vs_choose": choose_all_s / sweep_s},
        "goals": {"vs_decoding >= 100": bool(ratio >= 100)},
    }
    result["summary"] = [
        {"what": f"sweep {len(configs):,} configs x {questions:,} questions vs decoding per config",
         "ours": f"{sweep_s:.3g} s", "peer": f"{decode_all_s:.3g} s", "ratio": ratio, "goal": "ratio >= 100",
         "met": bool(ratio >= 100)},
        {"what": "sweep vs numpy choose, one configuration at a time", "ours": f"{sweep_s:.3g} s",
         "peer": f"{choose_all_s:.3g} s", "ratio": choose_all_s / sweep_s, "goal": None, "met": None},
    ]
    path = write_result(result["benchmark"], result)
    print(json.dumps({"sweep_s": sweep_s, "decode_per_config_s": decode_all_s, "ratio": ratio,
                      "vs_choose": choose_all_s / sweep_s, "devices": len(jax.local_devices())}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
