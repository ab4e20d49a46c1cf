"""`make bench` = `python -m bench.run_all [--small] [--timeout S] [--only NAME ...]`.

Runs every benchmark of the project on the machine at hand, one after another (never in
parallel: they time the same cores), each as `python -m bench.<name>` in its own process
with a time limit: every `bench/bench_*.py` that has a `main`, plus `bench/gpu_check.py`
when a GPU is visible. `--small` is passed to the scripts that accept it (the others run
at their defaults). Each script writes its own `bench/results/*.json`; results of earlier
runs are kept. Then the table in `bench/README.md` is regenerated from every results file
present (between the BEGIN/END markers; the rest of the README is left as written).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, machine_label, summary_rows

BENCH = Path(__file__).resolve().parent
README = BENCH / "README.md"
BEGIN, END = "<!-- BEGIN RESULTS (bench/run_all.py) -->", "<!-- END RESULTS -->"


def discover() -> list[str]:
    """Module names of the benchmarks: bench_*.py files that define main()."""
    names = []
    for path in sorted(BENCH.glob("bench_*.py")):
        if re.search(r"^def main\(", path.read_text(), re.M):
            names.append(path.stem)
    return names


def file_date(path: Path) -> str:
    """When a results file without a `date` was last committed (a fresh clone's modification
    times are the clone's), else its modification time."""
    try:
        committed = subprocess.run(["git", "log", "-1", "--format=%cI", "--", path.name], cwd=path.parent,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        committed = ""
    return committed or datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc).isoformat()


def gpu_visible() -> bool:
    if shutil.which("nvidia-smi"):
        try:
            return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    return Path("/dev/nvidia0").exists()


def run_one(module: str, small: bool, timeout: float) -> dict:
    """Run one benchmark in a subprocess; its status, seconds and the tail of its output."""
    path = BENCH / f"{module.split('.')[-1]}.py"
    args = [sys.executable, "-m", f"bench.{module}"]
    if small and '"--small"' in path.read_text():
        args.append("--small")
    print(f"== {' '.join(args[1:])} (limit {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(args, cwd=BENCH.parent, timeout=timeout, capture_output=True, text=True)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as err:
        status, tail = f"timeout after {timeout:.0f} s", str(err.stdout or "")[-2000:]
    seconds = time.perf_counter() - start
    print(f"   {status} in {seconds:.0f} s", flush=True)
    if status != "ok":
        print("   " + tail.strip().replace("\n", "\n   ")[-1500:], flush=True)
    return {"benchmark": module, "status": status, "seconds": seconds}


def table() -> str:
    """Markdown rows from every results file present."""
    lines = ["| benchmark | what | ours | peer | ratio | goal | machine | date |", "|---|---|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        if path.name.startswith("run_all"):
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        date = str(result.get("date") or file_date(path))[:10]
        for row in summary_rows(path.stem, result):
            ratio = row.get("ratio")
            goal = row.get("goal") or ""
            if goal and row.get("met") is not None:
                goal += " (met)" if row["met"] else " (not met)"
            lines.append("| " + " | ".join([path.stem, str(row.get("what", "")), str(row.get("ours", "")),
                                            str(row.get("peer", "")), f"{ratio:.3g}x" if isinstance(ratio, (int, float)) else "",
                                            goal, machine_label(result), date]) + " |")
    return "\n".join(lines)


def write_readme() -> None:
    text = README.read_text() if README.exists() else ""
    block = f"{BEGIN}\n{table()}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = README.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, README)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="pass --small to the benchmarks that take it")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    parser.add_argument("--only", nargs="*", help="run only these (e.g. bench_sweep)")
    parser.add_argument("--table-only", action="store_true", help="just regenerate the README table")
    args = parser.parse_args(argv)
    runs = []
    if not args.table_only:
        names = discover()
        if args.only:
            names = [n for n in names if n in args.only or n.removeprefix("bench_") in args.only]
        if gpu_visible() and (BENCH / "gpu_check.py").exists() and (not args.only or "gpu_check" in args.only):
            names.append("gpu_check")
        for name in names:
            runs.append(run_one(name, args.small, args.timeout))
    write_readme()
    print(f"table: {README}")
    failed = [r for r in runs if r["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
