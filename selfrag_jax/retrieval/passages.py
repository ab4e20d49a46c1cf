"""Passages: reading corpora (JSON lines or DPR TSV) and a store that serves them by row.

A Wikipedia-sized corpus (21M passages) does not fit in memory as Python objects, so the
index keeps one normalised JSON-lines file plus a numpy array of line offsets; a lookup
seeks into a memory map and parses one line.
"""

from __future__ import annotations

import csv
import json
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

PASSAGES_FILE = "passages.jsonl"
OFFSETS_FILE = "passages.offsets.npy"


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def embed_text(self) -> str:
        """What gets embedded: title + " " + text, as DPR and Contriever do."""
        return f"{self.title} {self.text}".strip()

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "title": self.title, "text": self.text}


def iter_passages(path: str | Path) -> Iterator[Passage]:
    """Streams a corpus file: `.tsv` is DPR (`id<TAB>text<TAB>title`, header), else JSON lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such passages file")
    if path.suffix.lower() == ".tsv":
        yield from _iter_tsv(path)
    else:
        yield from _iter_jsonl(path)


def _iter_jsonl(path: Path) -> Iterator[Passage]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected an object with 'id', 'title', 'text'")
            if not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{lineno}: field 'text' missing or not a string")
            title = row.get("title", "")
            if not isinstance(title, str):
                raise ValueError(f"{path}:{lineno}: field 'title' is not a string")
            pid = row.get("id", lineno - 1)
            if not isinstance(pid, (str, int)) or isinstance(pid, bool):
                raise ValueError(f"{path}:{lineno}: field 'id' must be a string or an integer")
            yield Passage(str(pid), title, row["text"])


def _iter_tsv(path: Path) -> Iterator[Passage]:
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quotechar='"')
        header = next(reader, None)
        if header is None:
            return
        names = [h.strip().lower() for h in header]
        if "text" not in names or "id" not in names:
            raise ValueError(f"{path}:1: TSV header must name 'id' and 'text' columns (DPR: id, text, title)")
        col_id, col_text = names.index("id"), names.index("text")
        col_title = names.index("title") if "title" in names else None
        for row in reader:
            lineno = reader.line_num
            if len(row) < len(names):
                raise ValueError(f"{path}:{lineno}: expected {len(names)} tab-separated fields, found {len(row)}")
            title = row[col_title] if col_title is not None else ""
            yield Passage(row[col_id], title, row[col_text])


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def write_store(passages: Iterator[Passage], folder: Path) -> int:
    """Writes passages.jsonl then its offsets; the offsets file (written last, atomically)
    marks a complete store, so a killed write is redone rather than trusted."""
    folder.mkdir(parents=True, exist_ok=True)
    text_tmp = folder / (PASSAGES_FILE + ".tmp")
    offsets: list[int] = [0]
    with open(text_tmp, "wb") as f:
        for passage in passages:
            f.write(json.dumps(passage.to_json(), ensure_ascii=False).encode("utf-8") + b"\n")
            offsets.append(f.tell())
    if len(offsets) == 1:
        text_tmp.unlink()
        raise ValueError("passages file holds no passages")
    _fsync_replace(text_tmp, folder / PASSAGES_FILE)
    offsets_tmp = folder / (OFFSETS_FILE + ".tmp")
    with open(offsets_tmp, "wb") as f:
        np.save(f, np.asarray(offsets, np.int64))
    _fsync_replace(offsets_tmp, folder / OFFSETS_FILE)
    return len(offsets) - 1


class PassageStore:
    """Row number -> passage, from a memory-mapped passages.jsonl and its offsets."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.offsets = np.load(folder / OFFSETS_FILE, mmap_mode="r")
        self._file = open(folder / PASSAGES_FILE, "rb")
        size = os.fstat(self._file.fileno()).st_size
        if size != int(self.offsets[-1]):
            raise ValueError(f"{folder / PASSAGES_FILE}: {size} bytes, offsets say {int(self.offsets[-1])}")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, row: int) -> Passage:
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        raw = json.loads(self._map[start:end])
        return Passage(raw["id"], raw["title"], raw["text"])

    def texts(self, start: int, stop: int) -> list[str]:
        """The embedding texts of rows [start, stop)."""
        return [self.get(i).embed_text for i in range(start, stop)]

    def close(self) -> None:
        self._map.close()
        self._file.close()
