"""`selfrag-jax serve` on loopback with the bundled generator: answers equal `generate`'s,
alone or batched with strangers; bad requests, a failing retriever, a client that leaves and
SIGTERM each touch only their own request; nothing compiles after warm-up."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from selfrag_jax.bundled import ASSETS
from selfrag_jax.http import BackgroundServer
from selfrag_jax.inference.engine import Engine, Shapes
from selfrag_jax.inference.items import parse_item
from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm, output_record
from selfrag_jax.inference.server import Limits, Scheduler, make_app
from selfrag_jax.retrieval.retriever import RetrievalError

REPO = Path(__file__).resolve().parents[1]
MODEL = str(ASSETS / "generator")
MAX_NEW = 24
LIMITS = Limits(max_ndocs=2, max_rounds=2, max_body_bytes=20_000, max_question_chars=300)
SHAPES = Shapes(questions=4, ndocs=2, prompt_tokens=64, passage_tokens=67, suffix_tokens=2 * 66 + 1)
OPTS = GenerateOptions(ndocs=2)

PEOPLE = [("Ada Quill", "Druvale", "a fisher"), ("Bran Holt", "Carrow", "a weaver"), ("Cora Fenn", "Lisk", "a baker"),
          ("Dov Amsel", "Pell", "a smith"), ("Esk Lund", "Harrow", "a potter"), ("Fay Orme", "Tull", "a miller")]


def record(i: int, with_ctxs: bool = True) -> dict:
    name, town, job = PEOPLE[i % len(PEOPLE)]
    question = ["Where was {} born?", "What is the occupation of {}?", "Copy the following words exactly: {}"][i % 3]
    rec = {"id": f"q{i}", "question": question.format(name)}
    if with_ctxs:
        rec["ctxs"] = [{"id": f"p{i}a", "title": name, "text": f"{name} was born in {town}. {name} worked as {job}."},
                       {"id": f"p{i}b", "title": "Other", "text": f"Someone else was born in {town} and was {job}."}]
    return rec


class FlakyRetriever:
    """In-process retriever whose failure the test switches on and off."""

    def __init__(self):
        self.down = False

    def __call__(self, queries, k):
        if self.down:
            raise RetrievalError("http://127.0.0.1:1: connection refused")
        return [[{"id": f"r{j}", "title": "Ada Quill", "text": "Ada Quill was born in Druvale.", "score": 0.5}
                 for j in range(k)] for _ in queries]


@pytest.fixture(scope="module")
def engine():
    engine, tok = Engine.load(MODEL, MAX_NEW, shapes=SHAPES)
    engine.warm_up()
    return engine, tok


@pytest.fixture(scope="module")
def reference():
    """`generate`'s engine: the bucketed shapes, no warm-up."""
    return Engine.load(MODEL, MAX_NEW)


def expected(reference, recs: list[dict], opts: GenerateOptions = OPTS, retrieve_fn=None) -> list[dict]:
    engine, tok = reference
    runner = ShortForm(engine, tok, opts, retrieve_fn)
    items = [parse_item(json.dumps(r), f"ref:{i}") for i, r in enumerate(recs)]
    return [output_record(r, opts) for r in runner.run(items)]


def serve(engine, retrieve_fn=None, batch_wait_ms: float = 50.0, opts: GenerateOptions = OPTS):
    eng, tok = engine
    return BackgroundServer(lambda: make_app(Scheduler(eng, tok, retrieve_fn, SHAPES.questions, batch_wait_ms, LIMITS),
                                             opts, LIMITS))


def post(url: str, payload, path: str = "/generate") -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def get(url: str, path: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


def same_answer(got: dict, want: dict) -> None:
    for key in ("prediction", "retrieved", "chosen", "refused", "refusal_reason"):
        assert got[key] == want[key], (key, got, want)
    assert [c["text"] for c in got["candidates"]] == [c["text"] for c in want["candidates"]]


def test_answers_equal_generate_alone_and_batched_with_strangers(engine, reference):
    recs = [record(i) for i in range(6)]
    want = expected(reference, recs)
    with serve(engine) as server:
        alone = [post(server.url, r) for r in recs]  # one at a time: batches of one
        with ThreadPoolExecutor(6) as pool:  # together: batched with each other
            together = list(pool.map(lambda r: post(server.url, r), recs))
        metrics = get(server.url, "/metrics")
    for (s1, a), (s2, b), w in zip(alone, together, want):
        assert s1 == s2 == 200
        same_answer(a, w)
        same_answer(b, w)
        assert a["tokens"]["generated"] > 0 and a["timings"]["batch_size"] == 1
    assert max(int(k) for k in metrics["batch_sizes"]) > 1  # the concurrent ones did share a batch
    assert metrics["programs_compiled_after_warm_up"] == 0
    assert metrics["requests"]["200"] == 12 and metrics["latency_s"]["p95"] > 0


def test_per_request_options_and_chat(engine, reference):
    recs = [record(0), record(1)]
    naive = GenerateOptions(ndocs=2, pipeline="naive")
    want_naive = expected(reference, recs, naive)
    want = expected(reference, [record(3, with_ctxs=False)], OPTS, FlakyRetriever())
    with serve(engine, FlakyRetriever()) as server:
        for r, w in zip(recs, want_naive):
            status, got = post(server.url, {**r, "options": {"pipeline": "naive"}})
            assert status == 200 and got["pipeline"] == "naive"
            same_answer(got, w)
        status, chat = post(server.url, {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": record(3)["question"]}]},
                            "/v1/chat/completions")
        assert status == 200 and chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["content"] == want[0]["prediction"]
        assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] > 0
        assert chat["selfrag"]["retrieved"] == want[0]["retrieved"]
        status, err = post(server.url, {"messages": [{"role": "user", "content": "hi"}], "stream": True},
                           "/v1/chat/completions")
        assert status == 400 and "stream" in err["error"]
        assert get(server.url, "/metrics")["programs_compiled_after_warm_up"] == 0  # naive rows were warmed up too


def test_request_options_override_each_refusal_threshold_and_keep_the_rest():
    from dataclasses import replace

    from selfrag_jax.inference.scoring import Combination, RefuseOptions
    from selfrag_jax.inference.server import request_options

    base = replace(GenerateOptions(), refuse=RefuseOptions(enabled=True, rel_threshold=0.9, sup_threshold=0.6,
                                                           issup=False, ret_threshold=0.4, use_threshold=0.1))
    assert request_options(base, {}, Limits()).refuse == base.refuse
    got = request_options(base, {"refuse_rel_threshold": 0.5, "refuse_use_threshold": 0, "refuse_issup": True},
                          Limits()).refuse
    assert got == replace(base.refuse, rel_threshold=0.5, use_threshold=0.0, issup=True)
    got = request_options(base, {"refuse_sup_threshold": 0.7, "refuse_ret_threshold": 0.45}, Limits()).refuse
    assert got == replace(base.refuse, sup_threshold=0.7, ret_threshold=0.45)
    # a learned combination stays unless the request gives a bar of thresholds
    learned = replace(base, refuse=replace(base.refuse, combination=Combination((1.0,) * 8, (0.0,) * 8, 0.0)))
    assert request_options(learned, {"refuse": True}, Limits()).refuse == learned.refuse
    got = request_options(learned, {"refuse_issup": True}, Limits()).refuse
    assert got == replace(base.refuse, issup=True) and got.combination is None


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"ctxs": []}).encode(), 400, "no 'question'"),
    (json.dumps({"question": "x" * 400}).encode(), 400, "at most 300"),
    (json.dumps({"question": "Who?", "options": {"ndocs": 3}}).encode(), 400, "ndocs=3"),
    (json.dumps({"question": "Who?", "options": {"beam": 2}}).encode(), 400, "options.beam"),
    (json.dumps({"question": "Who?", "options": {"mode": "sometimes"}}).encode(), 400, "options.mode"),
    (json.dumps({"question": "Who?", "options": {"refuse_issup": "no"}}).encode(), 400, "options.refuse_issup"),
    (json.dumps({"question": "Who?", "options": {"pipeline": "naive", "refuse": True}}).encode(), 400, "pipeline selfrag"),
    (json.dumps({"question": "Who?", "timeout_s": 0}).encode(), 400, "timeout_s"),
    (json.dumps({"question": "word " * 55}).encode(), 400, "tokens, this server takes at most 64"),
    (json.dumps({"question": "Who?", "ctxs": [{"text": "y" * 30_000}]}).encode(), 413, "limit"),
])
def test_bad_requests_are_refused_and_the_server_keeps_answering(engine, body, status, words):
    with serve(engine) as server:
        got_status, got = post(server.url, body)
        assert got_status == status and words in got["error"], got
        ok, answer = post(server.url, record(0))
        assert ok == 200 and answer["prediction"]


def test_retriever_failure_is_503_for_those_who_need_it_and_recovers(engine, reference):
    flaky = FlakyRetriever()
    needs, has = record(0, with_ctxs=False), record(1)
    (want_has,) = expected(reference, [has])
    with serve(engine, flaky, batch_wait_ms=200) as server:
        flaky.down = True
        with ThreadPoolExecutor(2) as pool:  # the same batch
            (s1, a), (s2, b) = pool.map(lambda r: post(server.url, r), [needs, has])
        assert s1 == 503 and "retriever unavailable" in a["error"]
        assert s2 == 200
        same_answer(b, want_has)
        flaky.down = False
        s3, c = post(server.url, needs)
        assert s3 == 200 and c["retrieved"] and c["candidates"][0]["passage"]["id"] == "r0"


def test_a_client_that_went_away_is_dropped_before_decoding(engine):
    with serve(engine, batch_wait_ms=400) as server:
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps(record(0)).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.1)
        sock.close()  # gone while its batch is still gathering
        deadline = time.time() + 30
        while get(server.url, "/metrics")["dropped"] < 1 and time.time() < deadline:
            time.sleep(0.1)
        metrics = get(server.url, "/metrics")
        assert metrics["dropped"] == 1 and metrics["batches"] == 0  # nothing was decoded for it


@pytest.mark.slow
def test_sigterm_finishes_accepted_requests_then_exits(tmp_path):
    env = {**os.environ, "XLA_FLAGS": ""}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "selfrag_jax", "serve", "--model", MODEL, "--port", str(port),
                             "--batch-size", "4", "--ndocs", "2", "--max-ndocs", "2", "--max-new-tokens", str(MAX_NEW),
                             "--max-prompt-tokens", "64", "--max-passage-tokens", "64", "--batch-wait-ms", "300"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                get(url, "/health")
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
                time.sleep(0.5)
        results = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post(url, record(i)))) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while (m := get(url, "/metrics"))["queue_depth"] + m["in_flight"] + m["requests"].get("200", 0) < 3:
            assert time.time() < deadline, m  # all three accepted (their batch normally still gathering)
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # all three accepted, their batch still gathering
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        assert all(results[i][0] == 200 and results[i][1]["prediction"] for i in range(3)), results
    finally:
        if proc.poll() is None:
            proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_without_aiohttp_names_the_extra(monkeypatch, capsys):
    from selfrag_jax.cli import main

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if not installed
    for name in ("selfrag_jax.inference.server", "selfrag_jax.http"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["serve", "--model", MODEL]) == 2
    assert "pip install 'selfrag-jax[serve]'" in capsys.readouterr().err
