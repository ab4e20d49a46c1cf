"""What the two HTTP services (`serve-retrieval`, `serve`) share, on aiohttp: errors as
`{"error": "..."}` with their status, bodies read within a byte limit (413), start-up on a
port (0: any free one), serving until SIGINT/SIGTERM, and a server on a thread of this
process for tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from typing import Any, Awaitable, Callable

from aiohttp import web


class BadRequest(ValueError):
    """A request that is answered 400 with this message."""


def json_object(body: bytes, expected: str) -> dict:
    """A request body that must be a JSON object (`expected` describes it in the error)."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"malformed JSON: {err}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"body must be a JSON object {expected}")
    return payload


def application(max_body_bytes: int, routes: list[tuple[str, str, Callable]], worker: Any) -> web.Application:
    """An app of `routes` ((method, path, handler)) whose `worker` (a batcher with async `start`
    and `stop`) starts and stops with it."""

    async def on_startup(app: web.Application) -> None:
        await worker.start()

    async def on_cleanup(app: web.Application) -> None:
        await worker.stop()

    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors])
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler):
    """aiohttp's own errors (404, 405, 413 ...) in the same JSON form as ours."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return error(err.status, err.reason)


async def read_body(request: web.Request, limit: int) -> bytes | web.Response:
    """The body, or the 413 response when it is over `limit` bytes."""
    if request.content_length is not None and request.content_length > limit:
        return error(413, f"body of {request.content_length} bytes is over the limit of {limit}")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"body is over the limit of {limit} bytes")


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


def serve_until_signal(app: web.Application, host: str, port: int, banner: Callable[[int], str], log=print,
                       drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then `drain()` (finish what was accepted) before closing."""

    async def main() -> None:
        runner, bound = await start(app, host, port)
        log(banner(bound))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if drain is not None:
            await drain()
        await runner.cleanup()

    asyncio.run(main())


class BackgroundServer:
    """An app served on a thread of this process: `with BackgroundServer(make_app) as s: s.url`."""

    def __init__(self, make_app: Callable[[], web.Application], host: str = "127.0.0.1", port: int = 0):
        self.make_app, self.host, self.port = make_app, host, port
        self.url = ""
        self.app: web.Application | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-server", daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()

        async def up():
            self.app = self.make_app()
            return await start(self.app, self.host, self.port)

        self._runner, port = asyncio.run_coroutine_threadsafe(up(), self._loop).result(timeout=600)
        self.url = f"http://{self.host}:{port}"
        return self

    def call(self, coro: Awaitable[Any], timeout: float = 600) -> Any:
        """Run a coroutine on the server's loop (e.g. a drain) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    def __exit__(self, *exc: Any) -> None:
        self.call(self._runner.cleanup(), timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
