"""The package's layers hold: no import cycle (module-level or function-local), and nothing
on the data's path (data, models, training, retrieval, inference) imports the bundled
world or the demo, which sit on top. Read from the source (ast), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "selfrag_jax"
BELOW_THE_WORLD = ("data", "models", "training", "retrieval", "inference")
ON_TOP = ("world", "demo")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (a module, or the package
    an imported name comes from)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    # a package importing its own submodules (re-exports in __init__) is not a cycle
    real = [c for c in cycles if not all(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert not real, "import cycles: " + "; ".join(" -> ".join(c) for c in real)


def test_the_data_path_does_not_import_the_world_or_the_demo():
    bad = []
    for name, targets in graph().items():
        layer = name.split(".")[1] if name.count(".") else ""
        if layer in BELOW_THE_WORLD:
            bad += [f"{name} -> {t}" for t in sorted(targets) if t.split(".")[1:2] and t.split(".")[1] in ON_TOP]
    assert not bad, bad


def test_the_walk_sees_imports():
    """The two tests above would pass on an empty graph: check that the walk finds known edges."""
    edges = graph()
    assert "selfrag_jax.inference.candidates" in edges["selfrag_jax.inference.selfrag"]
    assert "selfrag_jax.data.config" in edges["selfrag_jax.data.seqio_tasks"]
    assert "selfrag_jax.world.judges" in edges["selfrag_jax.evaluation.compare"]  # function-local, still seen
