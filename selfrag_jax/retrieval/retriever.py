"""Retrievers: one method, `retrieve(queries, k) -> [[{"id","title","text","score"}, ...], ...]`.

`Retriever` runs in process (encoder + index + passage store from an index folder),
`RetrieverClient` calls the HTTP service, and `ShardedRetriever` fans a query batch out to
any mix of them and merges the top-k by score, which is how an index split over hosts (or
processes) is searched. A shard that fails makes the fan-out raise `ShardUnavailable`
naming it (or, when partial results are allowed, report it as missing), never return a
silently shorter list. The inference engine only sees the method, so a managed vector
database can stand behind the same interface.
"""

from __future__ import annotations

import dataclasses
import heapq
import http.client
import json
import logging
import threading
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
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


class ShardUnavailable(RetrievalError):
    """Parts of a `ShardedRetriever` did not answer; `shards` names them (URLs for clients)."""

    def __init__(self, failures: dict[str, str]):
        self.failures = dict(failures)  # shard name -> why
        self.shards = list(self.failures)
        super().__init__("; ".join(_shard_message(name, why) for name, why in self.failures.items()))


def _shard_message(name: str, why: str) -> str:
    # A client's errors already start with its URL; say it once.
    return f"shard {why}" if why.startswith(name) else f"shard {name}: {why}"


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


@dataclasses.dataclass(frozen=True)
class ShardedResults:
    """A fan-out's merged hits and the shards that did not answer (empty: all did)."""

    results: list[list[Hit]]
    missing: list[str]

    @property
    def partial(self) -> bool:
        return bool(self.missing)


class ShardedRetriever:
    """Searches several retrievers (in-process or remote) in parallel; merges by score.

    A part that fails (a `RetrievalError`, a refused connection, a client's timeout) makes
    `retrieve` raise `ShardUnavailable` naming it. With `allow_partial` the hits of the parts
    that answered are returned instead and `retrieve_detailed` says which are missing; a call
    no part answered raises either way. Remote parts are bounded by their clients' `timeout`.
    """

    def __init__(self, parts: Sequence[SupportsRetrieve], max_workers: int | None = None, allow_partial: bool = False):
        if not parts:
            raise ValueError("ShardedRetriever needs at least one part")
        self.parts = list(parts)
        self.names = [getattr(part, "url", None) or f"part {i}" for i, part in enumerate(self.parts)]
        repeated = sorted({name for name in self.names if self.names.count(name) > 1})
        if repeated:  # the same shard twice would return its passages twice
            raise ValueError(f"shard {repeated[0]} given more than once")
        self.allow_partial = allow_partial
        self._pool = ThreadPoolExecutor(max_workers=max_workers or len(self.parts), thread_name_prefix="shard")

    def retrieve(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        out = self.retrieve_detailed(queries, k)
        if out.partial:  # only with allow_partial: the caller asked for it, but the log should show it
            logging.getLogger(__name__).warning("partial results: %s did not answer", ", ".join(out.missing))
        return out.results

    def retrieve_detailed(self, queries: Sequence[str], k: int = 5) -> ShardedResults:
        queries = list(queries)
        futures = [self._pool.submit(part.retrieve, queries, k) for part in self.parts]
        answered: list[tuple[int, list[list[Hit]]]] = []
        failures: dict[str, str] = {}
        for i, future in enumerate(futures):
            try:
                hits = future.result()
                if len(hits) != len(queries):  # a short answer must not pass for a complete one
                    raise RetrievalError(f"answered {len(hits)} result lists for {len(queries)} queries")
                answered.append((i, hits))
            except (RetrievalError, OSError) as err:  # unreachable, timed out, refused; anything else is a bug: raised
                failures[self.names[i]] = str(err) or type(err).__name__
        if not self.serving(len(failures)):
            raise ShardUnavailable(failures)
        results = [_merge([(i, hits[q]) for i, hits in answered], k) for q in range(len(queries))]
        return ShardedResults(results, list(failures))

    def serving(self, down: int) -> bool:
        """Whether the fan-out answers with `down` parts not answering: all must answer, or,
        with `allow_partial`, at least one."""
        return down == 0 or (self.allow_partial and down < len(self.parts))

    def health(self) -> list[dict[str, Any]]:
        """Each part's state: {"shard", "status": "ok", "passages"} or {"shard", "status": "unavailable", "error"}."""

        def one(part: SupportsRetrieve) -> int:
            if hasattr(part, "health"):
                return int(part.health()["passages"])
            return int(getattr(part, "size"))

        futures: list[Future] = [self._pool.submit(one, part) for part in self.parts]
        out = []
        for name, future in zip(self.names, futures):
            try:
                out.append({"shard": name, "status": "ok", "passages": future.result()})
            except Exception as err:  # noqa: BLE001 - reported per shard
                out.append({"shard": name, "status": "unavailable", "error": _shard_message(name, str(err) or type(err).__name__)})
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _merge(parts: list[tuple[int, list[Hit]]], k: int) -> list[Hit]:
    """The top k of the parts' hit lists by score; ties go to the earlier part, then the
    better rank, which is the order one index over the parts' passages in turn gives."""
    ranked = ((-hit["score"], part, rank, hit) for part, hits in parts for rank, hit in enumerate(hits))
    return [hit for *_, hit in heapq.nsmallest(k, ranked, key=lambda t: t[:3])]


class RetrieverClient:
    """The HTTP service's client: same `retrieve` as `Retriever`, one kept-alive connection
    per thread (http.client, so the inference engine needs no extra dependency). `timeout`
    (seconds) bounds each connect and each read, so a shard that hangs fails its request
    with `RetrievalError` instead of holding a fan-out forever."""

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
        results = self._request("POST", "/retrieve", {"queries": list(queries), "k": int(k)}).get("results")
        if not isinstance(results, list):
            raise RetrievalError(f"{self.url}/retrieve: the answer has no 'results' list")
        return results

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
