"""The retrieval HTTP service (aiohttp): `GET /health`, `POST /retrieve`.

Concurrent requests are batched server-side: the first waiting request opens a batch,
requests arriving within `batch_wait_ms` join it (up to `max_batch` queries), and the batch
is encoded and searched in one call on a single worker thread, so the encoder runs on full
batches instead of many single queries. Requests are checked before they are queued:
a body over `max_body_bytes` gets 413, malformed JSON, wrong types, an empty or too long
query list, an over-long query or k out of range get 400, all as `{"error": "..."}`.

Over a `ShardedRetriever` of other services' clients (`serve-retrieval --shard URL ...`) the
service is a fan-out: a shard that does not answer gets 503 naming it, or, when partial
results are allowed, 200 with `"partial": true, "missing": [urls]` beside the results;
`/health` lists each shard's state.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from selfrag_jax import http
from selfrag_jax.http import BadRequest
from selfrag_jax.retrieval.retriever import ShardedResults, ShardedRetriever, ShardUnavailable, SupportsRetrieve


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8321
    max_body_bytes: int = 1 << 20
    max_queries: int = 256  # per request
    max_query_chars: int = 4096
    max_k: int = 100
    batch_wait_ms: float = 2.0
    max_batch: int = 128  # queries per batched encode + search


def parse_request(body: bytes, config: ServerConfig) -> tuple[list[str], int]:
    """The queries and k of a /retrieve body, or BadRequest naming the field."""
    payload = http.json_object(body, '{"queries": [...], "k": int}')
    queries = payload.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest("field 'queries' must be a list of strings")
    if not queries:
        raise BadRequest("field 'queries' is empty")
    if len(queries) > config.max_queries:
        raise BadRequest(f"field 'queries' has {len(queries)} entries, at most {config.max_queries} allowed")
    for i, query in enumerate(queries):
        if len(query) > config.max_query_chars:
            raise BadRequest(f"queries[{i}] has {len(query)} characters, at most {config.max_query_chars} allowed")
    k = payload.get("k", 5)
    if not isinstance(k, int) or isinstance(k, bool):
        raise BadRequest("field 'k' must be an integer")
    if not 1 <= k <= config.max_k:
        raise BadRequest(f"field 'k' is {k}, must be between 1 and {config.max_k}")
    return queries, k


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: asyncio.Future = field(repr=False)


class QueryBatcher:
    """Groups concurrent requests into one `retrieve` call on one worker thread."""

    def __init__(self, retriever: SupportsRetrieve, config: ServerConfig):
        self.retriever = retriever
        self.config = config
        # A fan-out also says which shards were missing from a batch; other retrievers miss none.
        if isinstance(retriever, ShardedRetriever):
            self._search = retriever.retrieve_detailed
        else:
            self._search = lambda queries, k: ShardedResults(retriever.retrieve(queries, k), [])
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieve")
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.queries = 0

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self._worker.shutdown(wait=False)

    async def submit(self, queries: list[str], k: int) -> ShardedResults:
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(queries, k, future))
        return await future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            size = len(batch[0].queries)
            deadline = loop.time() + self.config.batch_wait_ms / 1000.0
            while size < self.config.max_batch:
                try:
                    item = self._queue.get_nowait() if loop.time() >= deadline else await asyncio.wait_for(self._queue.get(), deadline - loop.time())
                except (asyncio.TimeoutError, asyncio.QueueEmpty):
                    break
                batch.append(item)
                size += len(item.queries)
            await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        queries = [q for item in batch for q in item.queries]
        k = max(item.k for item in batch)
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._worker, self._search, queries, k)
        except Exception as err:  # noqa: BLE001 - every waiting request must hear about it
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(err)
            return
        self.batches += 1
        self.queries += len(queries)
        start = 0
        for item in batch:
            if not item.future.done():
                hits = [row[: item.k] for row in out.results[start : start + len(item.queries)]]
                item.future.set_result(ShardedResults(hits, out.missing))
            start += len(item.queries)


BATCHER = web.AppKey("batcher", QueryBatcher)


def make_app(retriever: SupportsRetrieve, config: ServerConfig = ServerConfig(), passages: int | None = None) -> web.Application:
    batcher = QueryBatcher(retriever, config)
    count = passages if passages is not None else int(getattr(retriever, "size", 0))
    fan_out = isinstance(retriever, ShardedRetriever)

    async def health(request: web.Request) -> web.Response:
        if not fan_out:
            return web.json_response({"status": "ok", "passages": count})
        shards = await asyncio.get_running_loop().run_in_executor(None, retriever.health)
        down = sum(s["status"] != "ok" for s in shards)
        serving = retriever.serving(down)  # as /retrieve would answer
        body = {"status": "ok" if down == 0 else "partial" if serving else "unavailable",
                "passages": sum(s.get("passages", 0) for s in shards), "shards": shards}  # fmt: skip
        return web.json_response(body, status=200 if serving else 503)

    async def retrieve(request: web.Request) -> web.Response:
        body = await http.read_body(request, config.max_body_bytes)
        if isinstance(body, web.Response):
            return body
        try:
            queries, k = parse_request(body, config)
        except BadRequest as err:
            return http.error(400, str(err))
        try:
            out = await batcher.submit(queries, k)
        except ShardUnavailable as err:
            return http.error(503, str(err))
        except Exception as err:  # noqa: BLE001
            return http.error(500, f"retrieval failed: {type(err).__name__}: {err}")
        if not fan_out:
            return web.json_response({"results": out.results})
        return web.json_response({"results": out.results, "partial": out.partial, "missing": out.missing})

    app = http.application(config.max_body_bytes, [("GET", "/health", health), ("POST", "/retrieve", retrieve)], batcher)
    app[BATCHER] = batcher
    return app


def serve(retriever: SupportsRetrieve, config: ServerConfig = ServerConfig(), log=print, passages: int | None = None) -> None:
    """Serves until SIGINT/SIGTERM (the CLI's `serve-retrieval`); `passages` is the banner's
    count where the retriever has no `size` (a fan-out asks its shards)."""
    count = passages if passages is not None else getattr(retriever, "size", "?")
    source = f" from {len(retriever.parts)} shards" if isinstance(retriever, ShardedRetriever) else ""
    http.serve_until_signal(make_app(retriever, config, passages), config.host, config.port, log=log, banner=lambda port: (
        f"serving {count} passages{source} on http://{config.host}:{port} (POST /retrieve, GET /health)"))


class BackgroundServer(http.BackgroundServer):
    """The service on a thread of this process (tests, demos): `with BackgroundServer(r) as s: s.url`."""

    def __init__(self, retriever: SupportsRetrieve, config: ServerConfig = ServerConfig(port=0)):
        super().__init__(lambda: make_app(retriever, config), config.host, config.port)
