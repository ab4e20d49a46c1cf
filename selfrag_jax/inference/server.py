"""`selfrag-jax serve`: Self-RAG answers over HTTP, decoded in batches across requests.

- `POST /generate` takes what a `generate` input line takes (`question` or `instruction` +
  `input`, optional `ctxs`, `id`, `choices`) plus `options` (per-request overrides of the
  server's defaults, within its bounds) and `timeout_s`; it answers what an output line holds,
  plus `tokens` and `timings`.
- `POST /v1/chat/completions`: OpenAI's chat form; the last user message is the question,
  the answer is the message content, and the output line rides along as `selfrag`.
- `GET /health`, `GET /metrics`.

Batching: requests wait in one queue; the scheduler takes the oldest, gathers the waiting
requests with the same options (up to `--batch-size` questions, while they keep arriving:
until none came for `--batch-wait-ms`, at most `--batch-max-wait-ms`) and runs them as one `ShortForm` batch, so the K candidates of many questions share
one compiled segment step. The engine pads to fixed `Shapes` and compiles every program at
start (`Engine.warm_up`), so no request waits on a compile. One worker thread owns the engine.

Failure stays with its request: bodies are checked before they are queued (400/413 with a
one-line reason); a batch that raises is run again one request at a time; a request whose
client went away or whose deadline passed is dropped before decoding. When the retriever
fails, the requests that needed it get 503 and the others in the batch still get answers.
SIGTERM stops new work (503), finishes what was accepted, then exits.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

try:
    from aiohttp import web
except ImportError:  # the one optional dependency of `serve`
    raise ImportError("serve needs aiohttp: pip install 'selfrag-jax[serve]'") from None

from selfrag_jax import http
from selfrag_jax.http import BadRequest
from selfrag_jax.inference.items import Item, item_from_record
from selfrag_jax.inference.scoring import MODES, PIPELINES, THRESHOLD_RULES
from selfrag_jax.inference.selfrag import PASSAGE_MARKERS, GenerateOptions, ShortForm, output_record


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (bodies over `max_body_bytes`: 413; the rest: 400)."""

    max_body_bytes: int = 1 << 18
    max_question_chars: int = 2000
    max_ctxs: int = 20
    max_passage_chars: int = 4000
    max_ndocs: int = 10
    max_rounds: int = 3
    timeout_s: float = 60.0  # a request's deadline unless it asks for a shorter one
    max_queue: int = 1024  # waiting requests; more get 503


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# options a request may override -> the check of its value
OVERRIDES: dict[str, Callable[[Any], bool]] = {
    "mode": lambda v: v in MODES, "threshold": _number, "threshold_rule": lambda v: v in THRESHOLD_RULES,
    "ndocs": lambda v: isinstance(v, int) and not isinstance(v, bool), "pipeline": lambda v: v in PIPELINES,
    "w_rel": _number, "w_sup": _number, "w_use": _number, "w_ret": _number,
    "refuse": lambda v: isinstance(v, bool), "refuse_rel_threshold": _number, "refuse_sup_threshold": _number,
    "refuse_issup": lambda v: isinstance(v, bool), "refuse_ret_threshold": _number, "refuse_use_threshold": _number,
    "max_rounds": lambda v: isinstance(v, int) and not isinstance(v, bool),
}


def request_options(base: GenerateOptions, overrides: Any, limits: Limits) -> GenerateOptions:
    """The server's options with a request's overrides, or BadRequest naming the field."""
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise BadRequest("field 'options' must be an object")
    for key, value in overrides.items():
        if key not in OVERRIDES:
            raise BadRequest(f"options.{key} is not an option this server takes (one of {', '.join(OVERRIDES)})")
        if not OVERRIDES[key](value):
            raise BadRequest(f"options.{key}={value!r} is not a valid value")
    o = overrides
    if not 1 <= o.get("ndocs", base.ndocs) <= limits.max_ndocs:
        raise BadRequest(f"options.ndocs={o['ndocs']} must be between 1 and {limits.max_ndocs}")
    if not 1 <= o.get("max_rounds", base.corrective.max_rounds) <= limits.max_rounds:
        raise BadRequest(f"options.max_rounds={o['max_rounds']} must be between 1 and {limits.max_rounds}")
    pick = lambda key, default: o.get(key, default)  # noqa: E731
    pipeline = pick("pipeline", base.pipeline)
    refuse = pick("refuse", base.refuse.enabled if pipeline == base.pipeline else False)
    rounds = pick("max_rounds", base.corrective.max_rounds if pipeline == "selfrag" else 1)
    try:
        return replace(
            base, ndocs=pick("ndocs", base.ndocs), pipeline=pipeline,
            retrieve=replace(base.retrieve, mode=pick("mode", base.retrieve.mode),
                             threshold=float(pick("threshold", base.retrieve.threshold)),
                             rule=pick("threshold_rule", base.retrieve.rule)),
            score=replace(base.score, **{k: float(o[k]) for k in ("w_rel", "w_sup", "w_use", "w_ret") if k in o}),
            refuse=replace(base.refuse, enabled=refuse).with_thresholds(**refuse_overrides(o)),
            corrective=replace(base.corrective, max_rounds=rounds))
    except ValueError as err:
        raise BadRequest(f"options: {err}") from None


def refuse_overrides(o: dict) -> dict:
    """The refusal bar's fields a request's options give (`RefuseOptions.with_thresholds`)."""
    given = {f"{k}_threshold": float(o[f"refuse_{k}_threshold"]) for k in ("rel", "sup", "ret", "use")
             if f"refuse_{k}_threshold" in o}
    return given | ({"issup": o["refuse_issup"]} if "refuse_issup" in o else {})


def parse_generate(body: bytes, base: GenerateOptions, limits: Limits) -> tuple[Item, GenerateOptions, float]:
    """(item, options, timeout) of a /generate body, or BadRequest."""
    return generate_request(http.json_object(body, '{"question": ..., "ctxs"?: [...], "options"?: {...}}'), base, limits)


def generate_request(payload: dict, base: GenerateOptions, limits: Limits) -> tuple[Item, GenerateOptions, float]:
    """(item, options, timeout) of a /generate request object (its `options` and `timeout_s`
    taken out), or BadRequest naming the field."""
    opts = request_options(base, payload.pop("options", None), limits)
    timeout = payload.pop("timeout_s", limits.timeout_s)
    if not _number(timeout) or not 0 < timeout <= limits.timeout_s:
        raise BadRequest(f"field 'timeout_s' must be a number of seconds in (0, {limits.timeout_s}]")
    text = payload.get("question", payload.get("instruction"))
    chars = len(text) + len(str(payload.get("input", ""))) if isinstance(text, str) else 0
    if chars > limits.max_question_chars:
        raise BadRequest(f"question has {chars} characters, at most {limits.max_question_chars} allowed")
    ctxs = payload.get("ctxs")
    if isinstance(ctxs, list):
        if len(ctxs) > limits.max_ctxs:
            raise BadRequest(f"field 'ctxs' has {len(ctxs)} passages, at most {limits.max_ctxs} allowed")
        for i, c in enumerate(ctxs):
            if isinstance(c, dict) and len(str(c.get("title", ""))) + len(str(c.get("text", ""))) > limits.max_passage_chars:
                raise BadRequest(f"ctxs[{i}] is over {limits.max_passage_chars} characters")
    try:
        item = item_from_record(payload, "request", opts.task)
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return item, opts, float(timeout)


# sampling settings that still mean greedy decoding
GREEDY = {"temperature": (0,), "top_p": (0, 1)}


def parse_chat(body: bytes, base: GenerateOptions, limits: Limits) -> tuple[Item, GenerateOptions, float, str]:
    """An OpenAI chat-completions body as /generate's (item, options, timeout, model name).
    The last user message is the question (the prompt template stays the paper's, so a system
    message is not applied); decoding is greedy, so sampling and streaming are refused."""
    payload = http.json_object(body, "with 'messages'")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 for m in messages):
        raise BadRequest("field 'messages' must be a list of {'role', 'content': string}")
    users = [m["content"] for m in messages if m.get("role") == "user"]
    if not users:
        raise BadRequest("field 'messages' has no user message")
    if payload.get("stream"):
        raise BadRequest("stream=true: this server answers whole responses only")
    if payload.get("n", 1) != 1:
        raise BadRequest(f"n={payload['n']}: this server returns one choice")
    for key, greedy in GREEDY.items():
        if key in payload and payload[key] not in greedy:
            raise BadRequest(f"{key}={payload[key]}: Self-RAG decodes greedily (temperature 0)")
    request = {"question": users[-1], "options": payload.get("selfrag"), "timeout_s": payload.get("timeout_s", limits.timeout_s)}
    return (*generate_request(request, base, limits), str(payload.get("model", "")))


@dataclass
class Pending:
    item: Item
    opts: GenerateOptions
    deadline: float  # monotonic
    arrived: float
    gone: Callable[[], bool]  # the client went away
    future: asyncio.Future = field(repr=False)


@dataclass
class Answer:
    status: int
    body: dict[str, Any]


class GuardedRetriever:
    """The retriever of one batch: a failure answers no passages and is remembered, so the
    requests that needed it can be told (503) while the rest of the batch is answered."""

    def __init__(self, retrieve_fn):
        self.retrieve_fn = retrieve_fn
        self.error: str | None = None

    def __call__(self, queries: list[str], k: int):
        if self.retrieve_fn is None:
            self.error = "no 'ctxs' and the server has no retriever (--index or --retriever-url)"
            return [[] for _ in queries]
        try:
            return self.retrieve_fn(queries, k)
        except Exception as err:  # noqa: BLE001 - told to the requests that needed it
            self.error = f"retriever unavailable: {type(err).__name__}: {err}"
            return [[] for _ in queries]


class Metrics:
    """Counters for `GET /metrics`; latencies over the last `window` answered requests."""

    def __init__(self, window: int = 10000):
        self.status: Counter = Counter()
        self.batch_sizes: Counter = Counter()
        self.latencies: deque = deque(maxlen=window)
        self.retrieved = self.refused = self.dropped = 0

    def answer(self, answer: Answer, latency: float) -> None:
        self.status[answer.status] += 1
        if answer.status == 200:
            self.latencies.append(latency)
            self.retrieved += bool(answer.body.get("retrieved"))
            self.refused += bool(answer.body.get("refused"))

    def snapshot(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies, float)
        pct = {f"p{q}": float(np.percentile(lat, q)) if lat.size else None for q in (50, 95, 99)}
        batches, answered = sum(self.batch_sizes.values()), self.status[200]
        return {"requests": dict(sorted((str(k), v) for k, v in self.status.items())), "dropped": self.dropped,
                "batches": batches, "batch_size_mean": (sum(k * v for k, v in self.batch_sizes.items()) / batches
                                                        if batches else None),
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())}, "latency_s": pct,
                "retrieval_rate": self.retrieved / answered if answered else None,
                "refusal_rate": self.refused / answered if answered else None}


class Scheduler:
    """Gathers waiting requests with the same options into engine batches on one worker thread."""

    def __init__(self, engine, tokenizer, retrieve_fn, batch_size: int, batch_wait_ms: float, limits: Limits,
                 max_wait_ms: float | None = None):
        self.engine, self.tok, self.retrieve_fn = engine, tokenizer, retrieve_fn
        self.batch_size, self.batch_wait, self.limits = batch_size, batch_wait_ms / 1000.0, limits
        self.max_wait = (max_wait_ms if max_wait_ms is not None else 10 * batch_wait_ms) / 1000.0
        self.last_arrival = 0.0
        self.waiting: deque[Pending] = deque()
        self.metrics = Metrics()
        self.busy = 0  # requests in the batch being decoded
        self.closing = False
        self._arrived: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.programs_after_warm_up = sum(engine.compiled_programs().values())
        self.warm_up_s: float | None = None  # set by `build`

    async def start(self) -> None:
        self._arrived, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self._worker.shutdown(wait=False)

    async def drain(self) -> None:
        """Refuse new requests; return when every accepted one has its answer."""
        self.closing = True
        while self.waiting or self.busy:
            self._idle.clear()
            await self._idle.wait()

    def check_prompt(self, item: Item, opts: GenerateOptions) -> None:
        """A prompt longer than the warmed-up shapes: 400 now, not a compile in the batch."""
        ids = ShortForm(self.engine, self.tok, opts).prompt_ids(item)
        most = self.engine.shapes.prompt_tokens
        if len(ids) > most:
            raise BadRequest(f"prompt of {len(ids)} tokens, this server takes at most {most}")

    async def submit(self, item: Item, opts: GenerateOptions, timeout: float, gone: Callable[[], bool]) -> Answer:
        if self.closing:
            return Answer(503, {"error": "server is shutting down"})
        if len(self.waiting) >= self.limits.max_queue:
            return Answer(503, {"error": f"queue full ({self.limits.max_queue} waiting)"})
        loop = asyncio.get_running_loop()
        now = loop.time()
        pending = Pending(item, opts, now + timeout, now, gone, loop.create_future())
        self.waiting.append(pending)
        self.last_arrival = now
        self._arrived.set()
        answer = await pending.future
        self.metrics.answer(answer, loop.time() - now)
        return answer

    def _take(self) -> list[Pending]:
        """The oldest request and the waiting ones with its options, up to the batch size."""
        head = self.waiting[0].opts
        batch = [p for p in self.waiting if p.opts == head][: self.batch_size]
        chosen = set(map(id, batch))
        self.waiting = deque(p for p in self.waiting if id(p) not in chosen)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.waiting:
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
            head = self.waiting[0]
            # Gather while requests keep coming: until a gap of batch_wait with no arrival, at
            # most max_wait after the oldest. Clients answered together come back over a few
            # ms, and a fixed window from the oldest cut such a burst into uneven batches.
            while sum(p.opts == head.opts for p in self.waiting) < self.batch_size:
                until = min(head.arrived + self.max_wait, self.last_arrival + self.batch_wait)
                if loop.time() >= until:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), until - loop.time())
                except asyncio.TimeoutError:
                    break
            batch = []
            for p in self._take():
                if p.gone():
                    self.metrics.dropped += 1
                    p.future.set_result(Answer(499, {"error": "client went away"}))
                elif loop.time() > p.deadline:
                    p.future.set_result(Answer(504, {"error": "deadline passed before decoding"}))
                else:
                    batch.append(p)
            if not batch:
                continue
            self.busy = len(batch)
            try:
                answers = await loop.run_in_executor(self._worker, self._decode, batch)
            except Exception as err:  # noqa: BLE001 - the worker itself failed: every request hears it
                answers = [Answer(500, {"error": f"{type(err).__name__}: {err}"})] * len(batch)
            finally:
                self.busy = 0
            self.metrics.batch_sizes[len(batch)] += 1
            for p, answer in zip(batch, answers):
                if not p.future.done():
                    p.future.set_result(answer)

    # --- worker thread ------------------------------------------------------------------
    def _decode(self, batch: list[Pending]) -> list[Answer]:
        """One engine batch; if it raises, each request alone, so a bad one fails alone."""
        try:
            return self._run(batch)
        except Exception as err:  # noqa: BLE001
            if len(batch) == 1:
                return [Answer(500, {"error": f"{type(err).__name__}: {err}"})]
            return [a for p in batch for a in self._decode([p])]

    def _run(self, batch: list[Pending]) -> list[Answer]:
        opts = batch[0].opts
        guard = GuardedRetriever(self.retrieve_fn)
        runner = ShortForm(self.engine, self.tok, opts, guard)
        start = time.monotonic()  # the clock of asyncio's loop.time(), which `arrived` is on
        results = runner.run([p.item for p in batch])
        seconds = time.monotonic() - start
        answers = []
        for p, r in zip(batch, results):
            if r.found_nothing and r.item.ctxs is None and guard.error:
                answers.append(Answer(400 if self.retrieve_fn is None else 503, {"error": guard.error}))
                continue
            record = output_record(r, opts)
            rows = [row for row in r.rows() if not row.pruned]
            record["tokens"] = {"prompt": len(r.prompt) + sum(len(row.suffix) for row in rows),
                                "generated": sum(len(row.ids) for row in rows)}
            record["timings"] = {"queue_s": start - p.arrived, "decode_s": seconds, "batch_size": len(batch)}
            answers.append(Answer(200, record))
        return answers

    def snapshot(self) -> dict[str, Any]:
        return {**self.metrics.snapshot(), "queue_depth": len(self.waiting), "in_flight": self.busy,
                "programs_warmed_up": self.programs_after_warm_up, "warm_up_s": self.warm_up_s,
                "programs_compiled_after_warm_up": sum(self.engine.compiled_programs().values())
                - self.programs_after_warm_up}


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------
SCHEDULER = web.AppKey("scheduler", Scheduler)


def make_app(scheduler: Scheduler, base: GenerateOptions, limits: Limits, model_name: str = "selfrag") -> web.Application:
    counter = iter(range(1 << 62))

    def gone(request: web.Request) -> Callable[[], bool]:
        return lambda: request.transport is None or request.transport.is_closing()

    async def answer(request: web.Request, parse) -> tuple[Answer, Any] | web.Response:
        body = await http.read_body(request, limits.max_body_bytes)
        if isinstance(body, web.Response):
            scheduler.metrics.status[413] += 1
            return body
        try:
            item, opts, timeout, *extra = parse(body, base, limits)
            scheduler.check_prompt(item, opts)
        except BadRequest as err:
            scheduler.metrics.status[400] += 1
            return http.error(400, str(err))
        return await scheduler.submit(item, opts, timeout, gone(request)), extra

    async def generate(request: web.Request) -> web.Response:
        out = await answer(request, parse_generate)
        if isinstance(out, web.Response):
            return out
        result, _ = out
        return web.json_response(result.body, status=result.status)

    async def chat(request: web.Request) -> web.Response:
        out = await answer(request, parse_chat)
        if isinstance(out, web.Response):
            return out
        result, (model,) = out
        if result.status != 200:
            return web.json_response(result.body, status=result.status)
        record = result.body
        usage = {"prompt_tokens": record["tokens"]["prompt"], "completion_tokens": record["tokens"]["generated"]}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response({
            "id": f"chatcmpl-{next(counter)}", "object": "chat.completion", "created": int(time.time()),
            "model": model or model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": record["prediction"]},
                         "finish_reason": "stop"}],
            "usage": usage, "selfrag": record})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "shutting down" if scheduler.closing else "ok", "model": model_name})

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(scheduler.snapshot())

    app = http.application(limits.max_body_bytes, [("POST", "/generate", generate), ("POST", "/v1/chat/completions", chat),
                                                    ("GET", "/health", health), ("GET", "/metrics", metrics)], scheduler)
    app[SCHEDULER] = scheduler
    return app


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
LIMITS = Limits()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from selfrag_jax.inference.cli import add_answer_arguments, add_engine_arguments

    p.add_argument("--model", required=True, help="checkpoint of this project, Hugging Face Llama folder or GGUF file")
    add_engine_arguments(p)
    add_answer_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address [127.0.0.1: this machine only]")
    p.add_argument("--port", type=int, default=8322)
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="a batch gathers requests until none arrived for this long (or it is full)")
    p.add_argument("--batch-max-wait-ms", type=float, default=50.0,
                   help="... and no longer than this after its oldest request arrived")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="longest question prompt (longer: 400)")
    p.add_argument("--max-passage-tokens", type=int, default=192,
                   help="passage length the shapes are warmed up for (longer ones compile when met)")
    p.add_argument("--max-ndocs", type=int, default=LIMITS.max_ndocs, help="most passages a request may ask for")
    p.add_argument("--max-rounds-limit", type=int, default=LIMITS.max_rounds, help="most rounds a request may ask for")
    p.add_argument("--max-body-bytes", type=int, default=LIMITS.max_body_bytes)
    p.add_argument("--timeout", type=float, default=LIMITS.timeout_s, help="a request's deadline in seconds")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="keep compiled programs in DIR (JAX's persistent cache): a restart warms up from it")


def build(args: argparse.Namespace) -> tuple[Scheduler, GenerateOptions, Limits]:
    """The warmed-up scheduler, default options and limits of the flags."""
    from selfrag_jax.cli import CLIError
    from selfrag_jax.inference.cli import Session, check_arguments, options_from_args
    from selfrag_jax.inference.engine import Shapes

    args.cache = None
    check_arguments(args, CLIError)
    if args.long_form or args.keep_top:
        raise CLIError("serve answers short form without --keep-top")
    limits = Limits(max_body_bytes=args.max_body_bytes, max_ndocs=args.max_ndocs, max_rounds=args.max_rounds_limit,
                    timeout_s=args.timeout)
    if not 1 <= args.ndocs <= limits.max_ndocs or not 1 <= args.max_rounds <= limits.max_rounds:
        raise CLIError("--ndocs and --max-rounds must be within --max-ndocs and --max-rounds-limit")
    opts = options_from_args(args)
    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    shapes = Shapes(questions=args.batch_size, ndocs=limits.max_ndocs, prompt_tokens=args.max_prompt_tokens,
                    passage_tokens=args.max_passage_tokens + PASSAGE_MARKERS,
                    suffix_tokens=limits.max_ndocs * (args.max_passage_tokens + 2) + 1)  # the naive baseline's row
    session = Session.load(args, shapes)
    import jax

    if jax.process_count() > 1:  # the other hosts would have to join every batch in lock-step
        raise CLIError("serve runs on one host (its devices may form a --mesh); a multi-host slice answers files with generate")
    start = time.perf_counter()
    session.engine.warm_up()
    retriever = getattr(session.retrieve_fn, "__self__", None)
    if hasattr(retriever, "warmup"):  # an index in this process: its query encoder's shapes
        retriever.warmup(args.batch_size, max_tokens=32)
    seconds = time.perf_counter() - start
    scheduler = Scheduler(session.engine, session.tokenizer, session.retrieve_fn, args.batch_size, args.batch_wait_ms,
                          limits, args.batch_max_wait_ms)
    scheduler.warm_up_s = seconds
    return scheduler, opts, limits


def run(args: argparse.Namespace) -> int:
    scheduler, opts, limits = build(args)
    print(f"warmed up in {scheduler.warm_up_s:.1f} s: {scheduler.programs_after_warm_up} programs compiled")
    http.serve_until_signal(
        make_app(scheduler, opts, limits, model_name=args.model), args.host, args.port, drain=scheduler.drain,
        banner=lambda port: f"serving Self-RAG on http://{args.host}:{port} (POST /generate, POST /v1/chat/completions, "
                            "GET /health, GET /metrics)")
    return 0
