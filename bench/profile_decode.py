"""Where a `bench_decode` run's time goes: by program part and by kind of op.

`python -m bench.profile_decode [--small] [--model PATH]` -> bench/results/profile_decode[_small].json

Runs `bench_decode`'s workload on the engine (mode always: one prefill of the prompts, one
segment step over every candidate row) once to compile, then once under `jax.profiler.trace`.
The trace's XLA:CPU op events (`jax.profiler.ProfileData`) are summed by self time (a `while`
op's time minus the ops it ran) and attributed with the compiled programs' HLO: each event is
an HLO instruction, whose `op_name` metadata says where in the code it came from and, for a
fusion, whose fused computation says what it computes. Parts: the prompts' prefill, the
candidates' suffix prefill (the context cache copied per row and widened, then the passages),
and the segment loop (one token per step for every row). Kinds: matmuls of the layers,
the vocabulary projection, attention (scores, their softmax, the weighted sum), the softmax
over the vocabulary, cache writes / copies / pads / gathers, and the rest (norms, RoPE,
elementwise). Not a timing: `run_all` does not run it, and the traced run is slower than a
plain one by the profiler's overhead.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time
from typing import Any

from bench.common import machine_info, now, versions, write_result

KINDS = ("matmul (layers)", "matmul (vocabulary)", "attention", "softmax (vocabulary)",
         "cache writes, copies, pads, gathers", "other (norms, RoPE, elementwise)")
_MOVES = {"dynamic-update-slice", "dynamic-slice", "scatter", "gather", "pad", "copy", "concatenate", "transpose",
          "slice", "broadcast", "select-and-scatter", "copy-start", "copy-done"}
_ATTENTION = {"exp", "reduce_max", "reduce_sum", "div", "select_n", "sub", "stop_gradient"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%([^\s(]+) .*\{\s*$")


def _opcode(rhs: str) -> str:
    """The opcode of an HLO instruction's right-hand side (after its result type)."""
    if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rhs = rhs[i + 1:].lstrip()
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else rhs
    return rhs.split("(", 1)[0].strip()


def parse_hlo(text: str) -> dict[str, dict[str, Any]]:
    """instruction name -> {opcode, op_name, calls (fused computation), computation}."""
    out, comp, comps = {}, None, collections.defaultdict(list)
    for line in text.splitlines():
        head = _COMP.match(line)
        if head and " = " not in line:
            comp = head.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rhs)
        calls = re.search(r"calls=%([^\s,}]+)", rhs)
        out[name] = {"opcode": _opcode(rhs), "op_name": op_name.group(1) if op_name else "",
                     "calls": calls.group(1) if calls else None, "computation": comp}
        comps[comp].append(name)
    for info in out.values():
        info["inner"] = [out[n] for n in comps.get(info["calls"], [])]
    return out


def kind_of(info: dict[str, Any]) -> str:
    """The kind of an instruction (a fusion by what it fuses; one with a dot by its dot)."""
    ops = [info, *info["inner"]]
    opcodes = {o["opcode"] for o in ops}
    dots = [o["op_name"] for o in ops if o["opcode"] in ("dot", "convolution")]
    attn = [o["op_name"].split("/attn/", 1)[1] for o in ops if "/attn/" in o["op_name"]]
    if dots:
        if any("/attn/" in d and "->" in d.split("/attn/", 1)[1] for d in dots):  # the scores and weighted-sum einsums
            return "attention"
        return "matmul (layers)" if any("/layers" in d for d in dots) else "matmul (vocabulary)"
    if any("->" in a or a.split("/")[-1] in _ATTENTION for a in attn):  # the mask and the softmax
        return "attention"
    if any("softmax" in o["op_name"] for o in ops):
        return "softmax (vocabulary)"
    if opcodes & _MOVES and not opcodes & {"exponential", "multiply", "add", "rsqrt"}:
        return "cache writes, copies, pads, gathers"
    return "other (norms, RoPE, elementwise)"


def part_of(program: str, op_name: str) -> str:
    """Which part of the run an op belongs to (decode's ops inside its `while` are the loop)."""
    if "_prefill_impl" in program:
        return "prefill (prompts)"
    return "segment loop" if re.search(r"jit\(_decode_impl\)/while/", op_name) else "suffix prefill (candidates)"


def self_times(events) -> list[tuple[str, float]]:
    """(name, self time in ns) of one trace line's events: nested events are subtracted."""
    evs = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in events), key=lambda t: (t[0], -t[1]))
    out, stack = [], []  # stack entries: [end, name, self]
    for start, end, name in evs:
        while stack and stack[-1][0] <= start:
            done = stack.pop()
            out.append((done[1], done[2]))
        if stack:
            stack[-1][2] -= end - start
        stack.append([end, name, end - start])
    out += [(s[1], s[2]) for s in stack]
    return out


def profile_program(fn, hlo: dict[str, dict[str, Any]], program: str):
    """Run `fn` under the profiler: (seconds of XLA op self time by (part, kind), seconds by
    the name of each event no HLO instruction accounts for, wall seconds of the call)."""
    import jax
    from jax.profiler import ProfileData

    folder = tempfile.mkdtemp(prefix="profile_decode_")
    with jax.profiler.trace(folder):
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    unattributed: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for name, ns in self_times(line.events):
                if name.startswith(("end: ", "ThreadpoolListener", "ThunkExecutor")):  # markers, waits
                    continue
                info = hlo.get(name)
                if info is None:  # runtime work that is no HLO instruction of this program
                    totals[("unattributed", "unattributed")] += ns / 1e9
                    unattributed[name] += ns / 1e9
                    continue
                totals[(part_of(program, info["op_name"]), kind_of(info))] += ns / 1e9
    return totals, unattributed, wall


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The table rows: op time by part and by kind (shares, no goal: a profile, not a timing)."""
    row = lambda what, shares: {"what": what, "ours": ", ".join(f"{k} {v:.0%}" for k, v in shares.items()),  # noqa: E731
                                "peer": "", "ratio": None, "goal": "", "met": None}
    return [row(f"decode op time by part, {result['model']}", result["by_part"]),
            row(f"decode op time by kind, {result['model']}", result["by_kind"])]


def main(argv=None) -> int:
    import numpy as np

    from bench.bench_decode import FULL, SMALL, make_inputs
    from selfrag_jax.inference.engine import ControlIds, Engine
    from selfrag_jax.models.config import preset
    from selfrag_jax.models.llama import init_params

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: checks that the profile runs")
    parser.add_argument("--model", help="a real model (checkpoint, HF folder or GGUF file) instead of random weights")
    args = parser.parse_args(argv)
    w = SMALL if args.small else FULL
    if args.model:
        from selfrag_jax.models.checkpoint import load_model

        config, params, _, _ = load_model(args.model)
    else:
        config = preset(w.preset)
        params = init_params(config, 0)
    engine = Engine(params, config, ControlIds.appended(config.vocab_size), w.new_tokens)
    prompts, passages = make_inputs(w, config.vocab_size, w.k)
    src = [q for q, ps in enumerate(passages) for _ in ps]
    suffixes = [p for ps in passages for p in ps]
    state = engine.prefill(prompts)
    engine.decode(state, src, suffixes)  # compile both programs

    calls = []
    call = engine._call
    engine._call = lambda program, *a: calls.append((program, a)) or call(program, *a)
    state = engine.prefill(prompts)
    seg = engine.decode(state, src, suffixes)
    engine._call = call
    hlo = {}
    for program, a in calls:
        hlo[program.__name__] = parse_hlo(program.lower(*a).compile().as_text())

    parts: dict[tuple[str, str], float] = collections.defaultdict(float)
    unattributed: dict[str, float] = collections.defaultdict(float)
    wall = {}
    state = engine.prefill(prompts)
    for name, fn in (("_prefill_impl", lambda: engine.prefill(prompts)),
                     ("_decode_impl", lambda: engine.decode(state, src, suffixes))):
        totals, missed, wall[name] = profile_program(fn, hlo[name], name)
        for key, sec in totals.items():
            parts[key] += sec
        for event, sec in missed.items():
            unattributed[event] += sec
    total = sum(parts.values())
    by_part, by_kind = collections.defaultdict(float), collections.defaultdict(float)
    for (part, kind), sec in parts.items():
        by_part[part] += sec
        by_kind[kind] += sec
    table = [{"part": p, "kind": k, "seconds": round(s, 4), "share": round(s / total, 4)}
             for (p, k), s in sorted(parts.items(), key=lambda kv: -kv[1])]
    result = {"date": now(), "machine": machine_info(), "versions": versions(), "workload": w.__dict__,
              "model": args.model or w.preset, "rows": len(src), "generated_tokens": int(np.sum(seg.counts)),
              "op_seconds": round(total, 3), "traced_wall_seconds": {k: round(v, 3) for k, v in wall.items()},
              "unattributed_events": {k: round(v, 4) for k, v in sorted(unattributed.items(), key=lambda kv: -kv[1])[:5]},
              "by_part": {k: round(v / total, 4) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
              "by_kind": {k: round(v / total, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
              "table": table}
    result["summary"] = summary(result)
    path = write_result("profile_decode_small" if args.small else "profile_decode", result)
    for row in table[:12]:
        print(f"{row['share']:6.1%} {row['seconds']:8.3f} s  {row['part']:<28} {row['kind']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
