"""bench/run_all: benchmark discovery and the README rows it builds from the results
layouts the scripts write (the `summary` convention and the older ones)."""

from __future__ import annotations

from bench.common import summary_rows
from bench.run_all import discover


def test_discovery_finds_benchmarks_not_helpers():
    names = discover()
    assert "bench_sweep" in names and "bench_train" in names
    assert all(n.startswith("bench_") for n in names)  # common.py, run_all.py are not benchmarks


def test_summary_rows_adapt_every_layout():
    own = {"summary": [{"what": "x", "ours": "1 s", "peer": "9 s", "ratio": 9.0, "goal": "ratio >= 2", "met": True}]}
    assert summary_rows("sweep", own) == own["summary"]
    retrieval = {"ratios": {"scann_vs_exact": 5.0}, "goals": {"scann_vs_exact >= 10": False}}
    assert summary_rows("retrieval_index", retrieval)[0]["met"] is False
    decode = {"ours": {"seconds": 1.0}, "reference": {"seconds": 3.0}, "speedup_vs_reference": 3.0}
    assert summary_rows("decode", decode)[0]["ratio"] == 3.0
    data = {"numpy": {"median_examples_per_s": 20.0}, "seqio": {"median_examples_per_s": 10.0}}
    assert summary_rows("data", data)[0]["ratio"] == 2.0
    assert summary_rows("other", {"benchmark": "b"})[0]["what"] == "b"
