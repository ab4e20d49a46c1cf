"""Reading the released Self-RAG JSON-lines layouts, with errors that name file and line.

Generator records: `{"instruction", "input", "output", "id", "dataset_name"}` (docs/method.md
section 2). Critic records: `{"instruction", "input", "output", "task"}`. Text records (base-model
pretraining): `{"text"}`, trained on every token; the bundled world
writes the type in `dataset_name` (`critic_isrel`, ...), both are accepted. Every reader in
this package (the numpy path and the TFDS builder) goes through `parse_record`, so a bad
line fails the same way, as `RecordError("FILE:LINE: reason")`, whichever path reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Literal

Kind = Literal["generator", "critic", "text"]
CRITIC_TYPES = ("retrieve", "isrel", "issup", "isuse")
# Type names as they appear in the released critic data (`task`) and in the bundled world
# (`dataset_name`, after dropping a `critic_` prefix). "groudness" is the release's spelling.
_CRITIC_ALIASES = {
    "retrieval": "retrieve", "multi_retrieval": "retrieve", "retrieve_input": "retrieve",
    "retrieve_sentence": "retrieve", "relevance": "isrel", "groudness": "issup", "groundness": "issup",
    "utility": "isuse",
}


class RecordError(ValueError):
    """A malformed input line; the message starts with `FILE:LINE:`."""


def critic_type(name: str) -> str | None:
    """The reflection-token type of a critic record's task name, or None if unknown."""
    key = name.strip().lower()
    key = key[len("critic_"):] if key.startswith("critic_") else key
    key = _CRITIC_ALIASES.get(key, key)
    return key if key in CRITIC_TYPES else None


def parse_record(line: str | bytes, kind: Kind, where: str) -> dict:
    """One JSON line -> a normalised record with string fields instruction, input, output,
    id, and `type` (critic: the token type; generator: dataset_name). `where` is FILE:LINE."""
    try:
        raw = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RecordError(f"{where}: not valid JSON ({err.msg if hasattr(err, 'msg') else err})") from None
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if kind == "text":  # plain documents for base-model pretraining: {"text"}
        if not isinstance(raw.get("text"), str) or not raw["text"]:
            raise RecordError(f"{where}: record has no non-empty string 'text' field")
        return {"instruction": "", "input": "", "output": raw["text"], "id": str(raw.get("id", "")), "type": "text"}
    for field in ("instruction", "output"):
        if field not in raw:
            raise RecordError(f"{where}: record has no {field!r} field")
    rec = {}
    for field in ("instruction", "input", "output", "id"):
        value = raw.get(field, "")
        if value is None:
            value = ""
        if not isinstance(value, (str, int)):
            raise RecordError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
        rec[field] = str(value)
    if not rec["output"]:
        raise RecordError(f"{where}: empty 'output'")
    if kind == "critic":
        name = raw.get("task") or raw.get("dataset_name") or ""
        rec["type"] = critic_type(str(name))
        if rec["type"] is None:
            raise RecordError(f"{where}: unknown critic task {name!r} (expected one of {', '.join(CRITIC_TYPES)} "
                              "or the released names retrieval, multi_retrieval, relevance, groudness, utility)")
    else:
        rec["type"] = str(raw.get("dataset_name") or "")
    return rec


def iter_records(path: str | os.PathLike, kind: Kind) -> Iterator[tuple[int, dict]]:
    """(line number, record) for every non-blank line, in file order."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, parse_record(line, kind, f"{path}:{n}")


@dataclass
class JsonlIndex:
    """Random access to the records of one file (optionally one critic type): validated once,
    then only byte offsets are kept, so a 146k-record file costs a few MB of memory."""

    path: str
    kind: Kind
    offsets: list[int]
    lines: list[int]
    _file: object = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, path: str | os.PathLike, kind: Kind, critic_type: str | None = None) -> "JsonlIndex":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file")
        offsets, lines = [], []
        with open(path, "rb") as f:
            pos = 0
            for n, line in enumerate(f, 1):
                if line.strip():
                    rec = parse_record(line, kind, f"{path}:{n}")
                    if critic_type is None or rec["type"] == critic_type:
                        offsets.append(pos)
                        lines.append(n)
                pos += len(line)
        return cls(path, kind, offsets, lines)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(self.offsets[i])
        return parse_record(self._file.readline(), self.kind, f"{self.path}:{self.lines[i]}")
