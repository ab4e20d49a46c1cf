"""Decoding settings chosen for a set of models on dev data and kept beside them.

`decoding.json` sits in the models folder (beside `generator/` and `critic/`, as the bundled
models and `make train-default` keep it) or in the generator's own folder. It holds what was
chosen on held-out dev questions, never on the sets it is reported on: the retrieval depth
(`ndocs`, the demo's) and the refusal bar (`refuse`: `rel_threshold`, `sup_threshold`, `issup`,
`ret_threshold`, `use_threshold`, and `combination` when a learned bar was chosen instead of
the thresholds), which `generate`, `compare` and `serve` use whenever refusal is on and no bar
is given.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from selfrag_jax.inference.scoring import Combination

SETTINGS_FILE = "decoding.json"


def settings_text(info: dict[str, Any]) -> str:
    """`info` as a settings file: indented, each list of numbers on one line (a dev grid has
    thousands of entries per column)."""
    flat: list[str] = []

    def mark(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: mark(v) for k, v in o.items()}
        if isinstance(o, list) and not any(isinstance(x, (list, dict)) for x in o):
            flat.append(json.dumps(o))
            return f"\0{len(flat) - 1}"
        return [mark(x) for x in o] if isinstance(o, list) else o

    text = json.dumps(mark(info), indent=1)
    return re.sub(r'"\\u0000(\d+)"', lambda m: flat[int(m.group(1))], text) + "\n"


def settings_file(model: str | Path) -> Path | None:
    """The generator folder's own `decoding.json`, else its models folder's, else None."""
    folder = Path(model)
    for candidate in (folder / SETTINGS_FILE, folder.parent / SETTINGS_FILE):
        if folder.is_dir() and candidate.is_file():
            return candidate
    return None


def refusal_bar(model: str | Path) -> dict[str, Any] | None:
    """The refusal bar chosen for this generator on dev data, if any, as `RefuseOptions`
    fields: rel_threshold, sup_threshold, issup (absent: on, the bar consults IsSup),
    ret_threshold and use_threshold (absent or null: the retriever's scores, the utility
    score, are not consulted: -inf) and combination (absent or null: none; else it is the bar)."""
    path = settings_file(model)
    if path is None:
        return None
    refuse: Any = json.loads(path.read_text()).get("refuse")
    if refuse is None:
        return None
    try:
        bar = float(refuse["rel_threshold"]), float(refuse["sup_threshold"])
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"{path}: 'refuse' needs numbers rel_threshold and sup_threshold, got {refuse!r}") from None
    if not all(0.0 <= t < 1.0 for t in bar):
        raise ValueError(f"{path}: refusal thresholds must be in [0, 1), got {bar}")
    issup = refuse.get("issup", True)
    if not isinstance(issup, bool):
        raise ValueError(f"{path}: 'refuse.issup' must be true or false, got {issup!r}")
    floors = {}
    for key in ("ret_threshold", "use_threshold"):
        v = refuse.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"{path}: 'refuse.{key}' must be a number or null, got {v!r}")
        floors[key] = float("-inf") if v is None else float(v)
    combination = None
    if refuse.get("combination") is not None:
        try:
            combination = Combination.from_json(refuse["combination"])
        except ValueError as err:
            raise ValueError(f"{path}: 'refuse.combination': {err}") from None
    return {"rel_threshold": bar[0], "sup_threshold": bar[1], "issup": issup, **floors, "combination": combination}
