"""Embedding a large corpus: fixed-size shards on disk, resumable, split across hosts.

Shard s holds the embeddings of rows [s * shard_size, (s + 1) * shard_size) as
`emb-SSSSS.npy`. Each is written to a temporary name then renamed, so a file that exists is
complete; a rerun skips it. On a pod, host p of P embeds the shards s with s % P == p
(a shared filesystem collects them), so hosts never contend for a shard.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfrag_jax.retrieval.passages import PassageStore


@dataclass(frozen=True)
class EmbedConfig:
    shard_size: int = 50_000
    batch_size: int = 64
    process_index: int | None = None  # default: jax.process_index()
    process_count: int | None = None  # default: jax.process_count()
    progress: bool = True


def shard_path(folder: Path, shard: int) -> Path:
    return folder / f"emb-{shard:05d}.npy"


def num_shards(count: int, shard_size: int) -> int:
    return -(-count // shard_size)


def embed_store(store: PassageStore, encoder, folder: Path, config: EmbedConfig = EmbedConfig()) -> list[int]:
    """Embeds this process's missing shards; returns the shard numbers it wrote."""
    import jax

    index = jax.process_index() if config.process_index is None else config.process_index
    count = jax.process_count() if config.process_count is None else config.process_count
    if not 0 <= index < count:
        raise ValueError(f"process_index {index} out of range for process_count {count}")
    folder.mkdir(parents=True, exist_ok=True)
    total = len(store)
    mine = [s for s in range(num_shards(total, config.shard_size)) if s % count == index]
    todo = [s for s in mine if not _shard_ok(shard_path(folder, s), _rows(s, config.shard_size, total), encoder.dimension)]
    rows_todo = sum(_rows(s, config.shard_size, total) for s in todo)
    bar = _progress(rows_todo, f"embedding (process {index}/{count}, {len(mine) - len(todo)} shards done)", config.progress)
    written = []
    for shard in todo:
        start = shard * config.shard_size
        stop = min(start + config.shard_size, total)
        vectors = np.empty((stop - start, encoder.dimension), np.float32)
        for lo in range(start, stop, config.batch_size * 16):  # a few batches at a time: the bar moves
            hi = min(lo + config.batch_size * 16, stop)
            vectors[lo - start : hi - start] = encoder.encode(store.texts(lo, hi), batch_size=config.batch_size)
            bar.update(hi - lo)
        _save_atomic(shard_path(folder, shard), vectors)
        written.append(shard)
    bar.close()
    return written


def _rows(shard: int, shard_size: int, total: int) -> int:
    return min(shard_size, total - shard * shard_size)


def _shard_ok(path: Path, rows: int, dim: int) -> bool:
    if not path.is_file():
        return False
    try:
        return np.load(path, mmap_mode="r").shape == (rows, dim)
    except (ValueError, OSError):
        return False


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def wait_for_shards(folder: Path, total: int, shard_size: int, dim: int, timeout_s: float, poll_s: float = 10.0) -> None:
    """Blocks until every shard exists (other hosts may still be writing theirs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [
            s for s in range(num_shards(total, shard_size)) if not _shard_ok(shard_path(folder, s), _rows(s, shard_size, total), dim)
        ]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{folder}: {len(missing)} embedding shards still missing (first: {shard_path(folder, missing[0]).name})")
        time.sleep(poll_s)


def load_embeddings(folder: Path, total: int, shard_size: int, dim: int) -> np.ndarray:
    """All shards concatenated into one float32 array (what index builders need in RAM)."""
    out = np.empty((total, dim), np.float32)
    for s in range(num_shards(total, shard_size)):
        out[s * shard_size : s * shard_size + _rows(s, shard_size, total)] = np.load(shard_path(folder, s))
    return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="passage", unit_scale=True, smoothing=0.05)
