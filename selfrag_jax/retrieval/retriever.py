"""Retrievers: one method, `retrieve(queries, k) -> [[{"id","title","text","score"}, ...], ...]`.

`Retriever` runs in process (encoder + index + passage store from an index folder),
`RetrieverClient` calls the HTTP service, and `ShardedRetriever` fans a query batch out to
any mix of them and merges the top-k by score, which is how an index split over hosts (or
processes) is searched. The inference engine only sees the method, so a managed vector
database can stand behind the same interface.
"""

from __future__ import annotations

import dataclasses
import heapq
import http.client
import json
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from selfrag_jax.retrieval.build import read_manifest
from selfrag_jax.retrieval.encoder import EncoderConfig, EncoderSpec, TextEncoder
from selfrag_jax.retrieval.index import VectorIndex, load_vector_index
from selfrag_jax.retrieval.passages import PassageStore

Hit = dict[str, Any]  # {"id", "title", "text", "score"}


class RetrievalError(RuntimeError):
    """The service refused a request or could not be reached."""


class SupportsRetrieve(Protocol):
    def retrieve(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]: ...


class Retriever:
    """Encoder + vector index + passage store, in this process."""

    def __init__(self, encoder: TextEncoder, index: VectorIndex, store: PassageStore, manifest: dict[str, Any] | None = None):
        if index.size != len(store):
            raise ValueError(f"index has {index.size} vectors but the passage store {len(store)} rows")
        self.encoder = encoder
        self.index = index
        self.store = store
        self.manifest = manifest or {}

    @classmethod
    def from_dir(
        cls,
        folder: str | Path,
        encoder_config: EncoderConfig | None = None,
        encoder: TextEncoder | None = None,
        encoder_path: str | Path | None = None,
    ) -> "Retriever":
        """Opens an index folder; encoder_path replaces the manifest's encoder folder (the same
        model stored elsewhere, e.g. after the index moved to another machine)."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        spec = EncoderSpec.from_json(manifest["encoder"])
        if encoder_path is not None:
            spec = dataclasses.replace(spec, path=str(encoder_path))
        index = load_vector_index(folder, manifest["backend"], manifest["params"], int(manifest["count"]))
        store = PassageStore(folder)
        if len(store) != int(manifest["count"]):
            raise ValueError(f"{folder}/manifest.json: field 'count' is {manifest['count']} but the store has {len(store)} passages")
        encoder = encoder or TextEncoder(spec, encoder_config or EncoderConfig())
        same = ("pooling", "normalize", "max_length", "dimension")
        if any(getattr(encoder.spec, f) != getattr(spec, f) for f in same):
            raise ValueError(f"{folder}/manifest.json: index was built with encoder {spec}, given {encoder.spec}")
        return cls(encoder, index, store, manifest)

    @property
    def size(self) -> int:
        return len(self.store)

    def retrieve(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        if not queries:
            return []
        return self.search_vectors(self.encoder.encode(list(queries)), k)

    def warmup(self, max_batch: int = 16, max_tokens: int = 24) -> None:
        """Compiles the encoder for query batches of 1, 2, 4 .. max_batch rows at each length
        bucket up to `max_tokens`, so the first requests of a service do not pay for compilation."""
        lengths = [b for b in self.encoder.buckets if b <= max_tokens] or [min(self.encoder.buckets)]
        rows = 1
        while rows <= max_batch:
            for length in lengths:
                self.retrieve([" ".join(["a"] * (length - 2))] * rows, 1)  # [CLS] a a ... [SEP]
            rows *= 2

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        scores, rows = self.index.search(vectors, k)
        out = []
        for row_scores, row_ids in zip(scores, rows):
            hits = []
            for score, row in zip(row_scores.tolist(), row_ids.tolist()):
                if row < 0:  # an index with fewer than k vectors may pad
                    continue
                hits.append({**self.store.get(row).to_json(), "score": float(score)})
            out.append(hits)
        return out


class ShardedRetriever:
    """Searches several retrievers (in-process or remote) in parallel; merges by score."""

    def __init__(self, parts: Sequence[SupportsRetrieve], max_workers: int | None = None):
        if not parts:
            raise ValueError("ShardedRetriever needs at least one part")
        self.parts = list(parts)
        self._pool = ThreadPoolExecutor(max_workers=max_workers or len(self.parts))

    def retrieve(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        futures = [self._pool.submit(part.retrieve, list(queries), k) for part in self.parts]
        per_part = [f.result() for f in futures]
        return [heapq.nlargest(k, (hit for part in per_part for hit in part[q]), key=lambda h: h["score"]) for q in range(len(queries))]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class RetrieverClient:
    """The HTTP service's client: same `retrieve` as `Retriever`, one kept-alive connection
    per thread (http.client, so the inference engine needs no extra dependency)."""

    def __init__(self, url: str, timeout: float = 60.0):
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"retriever url {url!r}: expected http://HOST:PORT")
        self.url = url
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port
        self._base = parsed.path.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", None)

    def retrieve(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        if not queries:
            return []
        return self._request("POST", "/retrieve", {"queries": list(queries), "k": int(k)})["results"]

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _request(self, method: str, path: str, payload: Any) -> dict[str, Any]:
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in (0, 1):  # one retry: a kept-alive connection the server closed
            conn = self._connection()
            try:
                conn.request(method, self._base + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as err:
                conn.close()
                self._local.conn = None
                if attempt:
                    raise RetrievalError(f"{self.url}: {err}") from None
            except OSError as err:
                conn.close()
                self._local.conn = None
                raise RetrievalError(f"{self.url}: {err}") from None
        try:
            decoded = json.loads(data)
        except json.JSONDecodeError:
            decoded = {"error": data[:200].decode("utf-8", "replace")}
        if response.status != 200:
            raise RetrievalError(f"{self.url}{path}: HTTP {response.status}: {decoded.get('error', decoded)}")
        return decoded
