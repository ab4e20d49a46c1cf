"""Building an index folder from a passages file, safely and resumably.

Everything is written into `OUT.partial/` (passages, embedding shards, index files), then
`manifest.json` last, then the folder is renamed to OUT. A build killed at any point leaves
no OUT (or the previous one) and a `.partial` folder that never loads as an index; running
the same command again reuses what is complete there (the passage store, finished shards).

Folder layout:
    manifest.json            encoder, pooling, normalisation, dimension, count, backend, params
    passages.jsonl           one {"id","title","text"} per row, in row order
    passages.offsets.npy     int64 byte offsets (count + 1) into passages.jsonl
    scann/ | embeddings.npy  the backend's files
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrag_jax.retrieval.embed import EmbedConfig, embed_store, load_embeddings, wait_for_shards
from selfrag_jax.retrieval.encoder import DEFAULT_ENCODER, EncoderConfig, EncoderSpec, TextEncoder, read_encoder_spec
from selfrag_jax.retrieval.index import BACKENDS, build_index
from selfrag_jax.retrieval.passages import OFFSETS_FILE, PASSAGES_FILE, PassageStore, iter_passages, write_store

MANIFEST = "manifest.json"
FORMAT = "selfrag-jax-index"
VERSION = 1


@dataclass(frozen=True)
class BuildConfig:
    passages: str
    out: str
    encoder: str = DEFAULT_ENCODER
    backend: str = "scann"
    pooling: str | None = None  # None: from the encoder folder
    normalize: bool | None = None
    max_length: int | None = None
    scann: dict[str, Any] = field(default_factory=dict)  # overrides of ScannParams.auto
    target_recall: float | None = 0.95  # recall@10 the search knobs are calibrated to (None: off)
    embed: EmbedConfig = EmbedConfig()
    encoder_run: EncoderConfig = EncoderConfig()
    overwrite: bool = False
    keep_embeddings: bool = False
    wait_timeout_s: float = 24 * 3600.0  # process 0 waiting for other hosts' shards


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def build_index_folder(config: BuildConfig, encoder: TextEncoder | None = None, log=print) -> Path | None:
    """Builds config.out; returns it, or None on a process other than 0 (it only embeds)."""
    if config.backend not in BACKENDS:
        raise ValueError(f"backend {config.backend!r}: must be one of {BACKENDS}")
    out = Path(config.out)
    if (out / MANIFEST).exists() and not config.overwrite:
        raise ValueError(f"{out}: an index is already there (pass --overwrite to replace it)")
    if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not an index folder; refusing to replace it")
    process = config.embed.process_index if config.embed.process_index is not None else _jax_process_index()
    if config.backend == "scann" and process == 0:
        from selfrag_jax.retrieval.index import import_scann

        import_scann()  # fail now, not after hours of embedding
    spec = read_encoder_spec(config.encoder, config.pooling, config.normalize, config.max_length)
    if not Path(config.passages).is_file():
        raise FileNotFoundError(f"{config.passages}: no such passages file")
    work = partial_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    _check_resume(work, spec, config)

    if not (work / MANIFEST).exists():
        if not (work / OFFSETS_FILE).exists():
            if process == 0:
                t0 = time.perf_counter()
                try:
                    count = write_store(iter_passages(config.passages), work)
                except (ValueError, OSError):
                    shutil.rmtree(work)  # nothing worth resuming yet; a fixed file starts afresh
                    raise
                log(f"passages: {count} rows stored in {time.perf_counter() - t0:.1f}s")
            else:
                _wait_for(work / OFFSETS_FILE, config.wait_timeout_s)
        store = PassageStore(work)
        encoder = encoder or TextEncoder(spec, config.encoder_run)
        shards = work / "embeddings"
        written = embed_store(store, encoder, shards, config.embed)
        total_shards = -(-len(store) // config.embed.shard_size)
        log(f"embedding: {len(written)} shards written by process {process}, {total_shards} in all")
        if process != 0:
            log(f"process {process}: embedding shards done; process 0 builds the index")
            return None
        dim = encoder.dimension
        wait_for_shards(shards, len(store), config.embed.shard_size, dim, config.wait_timeout_s)
        vectors = load_embeddings(shards, len(store), config.embed.shard_size, dim)
        t0 = time.perf_counter()
        # Calibration queries: passages' texts without their titles, embedded as questions are.
        query_maker = lambda rows: encoder.encode([store.get(int(r)).text for r in rows])  # noqa: E731
        index, calibration = build_index(vectors, config.backend, spec.normalize, config.scann, config.target_recall, query_maker)
        if calibration and "queries" in calibration:
            calibration["queries_from"] = "passage texts without their titles"
        for stale in ("scann", "embeddings.npy"):
            _remove(work / stale)
        params = index.save(work)
        log(f"index: {config.backend} over {len(vectors)} x {dim} built in {time.perf_counter() - t0:.1f}s")
        if calibration and "recall" in calibration:
            met = "" if calibration["reached"] else f", below the target {calibration['target_recall']}"
            log(f"search settings: {calibration['leaves_to_search']} leaves, re-scoring {calibration['reorder']}: "
                f"recall@{calibration['k']} {calibration['recall']:.3f} on {calibration['queries']} passages as queries{met}")  # fmt: skip
        size = index_bytes(work, len(store))
        log(f"size: {size['total'] / 1e6:,.1f} MB, {size['per_passage']['total']:.0f} bytes per passage "
            f"({', '.join(f'{k} {v:.0f}' for k, v in size['per_passage'].items() if k != 'total')})")  # fmt: skip
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "encoder": spec.to_json(),
            "pooling": spec.pooling,
            "normalize": spec.normalize,
            "dimension": dim,
            "count": len(store),
            "backend": config.backend,
            "params": params,
            "calibration": calibration,
            "bytes": size,
            "passages": PASSAGES_FILE,
            "source": str(Path(config.passages).resolve()),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        store.close()
        _write_json_atomic(work / MANIFEST, manifest)  # from here on the folder is a valid index
    if not config.keep_embeddings:
        _remove(work / "embeddings")
    _remove(work / "build.json")
    _swap_into_place(work, out)
    return out


def index_bytes(folder: Path, count: int) -> dict[str, Any]:
    """Bytes on disk by part and per passage: the index (held in RAM to serve), the passage
    text (read from disk per hit) and its offsets (memory-mapped)."""
    parts = {
        "index": sum(f.stat().st_size for name in ("scann", "embeddings.npy") for f in _files(folder / name)),
        "passages": (folder / PASSAGES_FILE).stat().st_size,
        "offsets": (folder / OFFSETS_FILE).stat().st_size,
    }
    files = {str(f.relative_to(folder)): f.stat().st_size for f in _files(folder / "scann")}
    per = {name: size / max(count, 1) for name, size in parts.items()}
    return {**parts, "total": sum(parts.values()), "per_passage": {**per, "total": sum(per.values())}, "index_files": files}


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(f for f in path.rglob("*") if f.is_file())
    return [path] if path.is_file() else []


def _check_resume(work: Path, spec: EncoderSpec, config: BuildConfig) -> None:
    """A resumed build must use the same passages, encoder and shard size as the first try."""
    source = Path(config.passages).resolve()
    stat = source.stat()
    settings = {
        "passages": str(source),
        "passages_size": stat.st_size,
        "passages_mtime_ns": stat.st_mtime_ns,
        "encoder": spec.to_json(),
        "shard_size": config.embed.shard_size,
    }
    path = work / "build.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous == settings:
            return
        if any((work / "embeddings").glob("emb-*.npy")):
            changed = sorted(k for k in settings if previous.get(k) != settings[k])
            raise ValueError(f"{work}: an interrupted build with other settings ({', '.join(changed)}) is there; remove it or rerun it as before")
        shutil.rmtree(work)  # no finished shard to protect: start afresh
        work.mkdir()
    if not (work / MANIFEST).exists():
        _write_json_atomic(path, settings)


def _swap_into_place(work: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old)
    else:
        os.replace(work, out)


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: not written by process 0 within {timeout_s:.0f}s")
        time.sleep(5.0)


def _jax_process_index() -> int:
    import jax

    return jax.process_index()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a complete index; a one-line error naming the folder or field otherwise."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such index folder")
    if not path.is_file():
        hint = " (an interrupted build? run it again)" if partial_dir(folder).exists() or folder.name.endswith(".partial") else ""
        raise ValueError(f"{folder}: not a complete index, no {MANIFEST}{hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: field 'format' must be {FORMAT!r}")
    for key in ("encoder", "dimension", "count", "backend", "params"):
        if key not in manifest:
            raise ValueError(f"{path}: missing field {key!r}")
    if manifest.get("version", 0) > VERSION:
        raise ValueError(f"{path}: field 'version' {manifest['version']} is newer than this code reads ({VERSION})")
    return manifest
