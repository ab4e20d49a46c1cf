"""Shared benchmark helpers: machine facts, versions, medians, result files, README rows.

Result convention (new benchmarks follow it; `summary_rows` adapts the older layouts):
every `bench/results/NAME.json` may carry a top-level `summary` list, one entry per README
row:

    {"what": str, "ours": str, "peer": str, "ratio": float | None,
     "goal": str | None, "met": bool | None}

`ours` / `peer` are short human-readable measurements ("0.41 s", "1,858 ex/s"), `ratio` is
ours relative to the peer in the direction where larger is better, `goal` the target
written like "ratio >= 100". Plus `machine` (from `machine_info`) and `date` (ISO 8601).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
                            "cores": os.cpu_count()}
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        info["load_average_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        import jax

        info["accelerators"] = sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()})
    except Exception:  # noqa: BLE001 - machine facts are best effort
        pass
    return info


def versions(*packages: str) -> dict[str, str]:
    out = {}
    for name in ("numpy", "jax", "jaxlib", *packages):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def median_time(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, list[float]]:
    """Median wall time of `repeats` calls of `fn` (warm it up first yourself)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def repo_path(path: str | Path) -> str:
    """A path as results files may record it: relative to the repository when inside it, else
    the file or folder name (never a development machine's absolute path)."""
    resolved = Path(path).resolve()
    root = RESULTS.parents[1]
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else resolved.name


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_result(name: str, result: dict[str, Any], path: str | Path | None = None) -> Path:
    """bench/results/NAME.json (or `path`), written under a temporary name and renamed."""
    result = {"benchmark": name, "date": now(), **result}
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=float) + "\n")
    os.replace(tmp, path)
    return path


# --- README rows from any results file ------------------------------------------------------
def summary_rows(name: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The README rows of one results file: its `summary`, or an adaptation of the layouts
    the older scripts write (data, decode, retrieval_*: ratios/goals, gpu_check)."""
    if isinstance(result.get("summary"), list):
        return result["summary"]
    if "ratios" in result:  # retrieval_encoder / retrieval_index
        goals = result.get("goals", {})
        return [{"what": f"{name}: {key.replace('_vs_', ' vs ')}", "ours": "", "peer": "", "ratio": value,
                 "goal": next((g for g in goals if g.startswith(key)), None),
                 "met": next((v for g, v in goals.items() if g.startswith(key)), None)}
                for key, value in result["ratios"].items()]
    if "speedup_vs_reference" in result:  # decode
        return [{"what": f"{name}: short-form decode vs transformers generate",
                 "ours": _secs(result.get("ours", {}).get("seconds")),
                 "peer": _secs(result.get("reference", {}).get("seconds")),
                 "ratio": result["speedup_vs_reference"], "goal": None, "met": None}]
    if "numpy" in result and "seqio" in result:  # data
        ours = result["numpy"].get("median_examples_per_s")
        peer = result["seqio"].get("median_examples_per_s")
        return [{"what": f"{name}: data pipeline numpy vs seqio/TFDS", "ours": _rate(ours, "ex/s"),
                 "peer": _rate(peer, "ex/s"), "ratio": ours / peer if ours and peer else None,
                 "goal": None, "met": None}]
    checks = {k: v for k, v in result.items() if isinstance(v, dict) and ("mfu" in v or "tokens_per_s" in v)}
    if checks:  # gpu_check-like: one row per check, no peer
        return [{"what": f"{name}: {k}", "ours": ", ".join(f"{m}={_short(v[m])}" for m in ("mfu", "tokens_per_s") if m in v),
                 "peer": "", "ratio": None, "goal": None, "met": None} for k, v in checks.items()]
    return [{"what": str(result.get("benchmark", name)), "ours": "", "peer": "", "ratio": None, "goal": None,
             "met": None}]


def _secs(x) -> str:
    return f"{x:.3g} s" if isinstance(x, (int, float)) else ""


def _rate(x, unit: str) -> str:
    return f"{x:,.0f} {unit}" if isinstance(x, (int, float)) else ""


def _short(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def machine_label(result: dict[str, Any]) -> str:
    m = result.get("machine", {})
    accel = [a for a in m.get("accelerators", []) if not a.startswith("cpu")]
    if accel:
        return ", ".join(accel)
    cores = m.get("cores", m.get("cpu_count"))
    return f"{m.get('cpu', 'CPU')}, {cores} cores" if cores else str(m.get("cpu", "?"))
