"""The retrieval service on loopback: concurrency, request checks, clients, sharding, CLI."""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from selfrag_jax.retrieval.build import BuildConfig, build_index_folder
from selfrag_jax.retrieval.embed import EmbedConfig
from selfrag_jax.retrieval.encoder import TextEncoder
from selfrag_jax.retrieval.retriever import RetrievalError, Retriever, RetrieverClient, ShardedRetriever, ShardUnavailable
from selfrag_jax.retrieval.server import BATCHER, BackgroundServer, ServerConfig
from test_retrieval_support import single_device_env, write_corpus

REPO = Path(__file__).resolve().parents[1]
BACKEND = "scann" if __import__("importlib").util.find_spec("scann") else "exact"


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return TextEncoder.load()


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory, encoder) -> Path:
    """60 short passages, the bundled MiniLM, the default backend."""
    root = tmp_path_factory.mktemp("svc")
    corpus = write_corpus(root / "c.jsonl", 60)
    config = BuildConfig(passages=str(corpus), out=str(root / "idx"), backend=BACKEND, embed=EmbedConfig(progress=False))
    return build_index_folder(config, encoder=encoder, log=lambda _: None)


@pytest.fixture(scope="module")
def retriever(tiny_index, encoder) -> Retriever:
    return Retriever.from_dir(tiny_index, encoder=encoder)


def raw_post(url: str, body: bytes, path: str = "/retrieve", method: str = "POST") -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_health_and_results_match_in_process(retriever):
    with BackgroundServer(retriever) as server:
        assert server.url.startswith("http://127.0.0.1:")
        client = RetrieverClient(server.url)
        assert client.health() == {"status": "ok", "passages": 60}
        queries = ["astronomy", "a passage on cooking", "football facts"]
        remote = client.retrieve(queries, k=4)
        local = retriever.retrieve(queries, k=4)
        assert [[h["id"] for h in q] for q in remote] == [[h["id"] for h in q] for q in local]
        for hits in remote:
            assert len(hits) == 4 and set(hits[0]) == {"id", "title", "text", "score"}
            assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        assert "astronomy" in remote[0][0]["text"]


def test_eight_concurrent_clients(retriever, capsys):
    clients, requests = 8, 200
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    retriever.warmup(max_batch=8)  # as `serve-retrieval` does before listening
    with BackgroundServer(retriever) as server:
        client = RetrieverClient(server.url)  # one kept-alive connection per thread

        def work(worker: int) -> None:
            mine = []
            try:
                for i in range(requests):
                    query = f"{['music', 'chemistry', 'history', 'painting'][i % 4]} notes {worker} {i}"
                    t0 = time.perf_counter()
                    hits = client.retrieve([query], k=1 + i % 5)
                    mine.append(time.perf_counter() - t0)
                    assert len(hits) == 1 and len(hits[0]) == 1 + i % 5
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
            with lock:
                latencies.extend(mine)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=work, args=(w,)) for w in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        wall = time.perf_counter() - t0
        batches = server.app[BATCHER].batches
        assert client.health()["status"] == "ok"
    assert not errors, errors[:3]
    assert len(latencies) == clients * requests
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    with capsys.disabled():
        print(f"\nservice: {clients} clients x {requests} requests in {wall:.1f}s ({len(latencies) / wall:.0f} req/s), "
              f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, {batches} batches")  # fmt: skip
    assert batches < clients * requests  # concurrent requests were batched


def test_bad_requests_get_400_and_413_and_service_keeps_answering(retriever):
    config = ServerConfig(port=0, max_body_bytes=2048, max_queries=4, max_query_chars=100, max_k=20)
    with BackgroundServer(retriever, config) as server:
        cases = {
            b"{not json": "malformed JSON",
            b"[1, 2]": "JSON object",
            json.dumps({"queries": [], "k": 3}).encode(): "empty",
            json.dumps({"queries": "music", "k": 3}).encode(): "list of strings",
            json.dumps({"queries": ["music", 5], "k": 3}).encode(): "list of strings",
            json.dumps({"queries": ["music"], "k": 0}).encode(): "between 1 and 20",
            json.dumps({"queries": ["music"], "k": 21}).encode(): "between 1 and 20",
            json.dumps({"queries": ["music"], "k": "5"}).encode(): "integer",
            json.dumps({"queries": ["music"], "k": True}).encode(): "integer",
            json.dumps({"queries": ["q"] * 5, "k": 1}).encode(): "at most 4",
            json.dumps({"queries": ["x" * 101], "k": 1}).encode(): "101 characters, at most 100",
        }
        for body, message in cases.items():
            status, data = raw_post(server.url, body)
            assert status == 400 and message in data["error"], (body, status, data)
        status, data = raw_post(server.url, json.dumps({"queries": ["y" * 50] * 100, "k": 1}).encode())
        assert status == 413 and "limit" in data["error"]
        assert raw_post(server.url, b"", path="/nowhere", method="GET")[0] == 404
        with pytest.raises(RetrievalError, match="HTTP 400"):
            RetrieverClient(server.url).retrieve(["music"], k=50)
        status, data = raw_post(server.url, json.dumps({"queries": ["music"], "k": 2}).encode())
        assert status == 200 and len(data["results"][0]) == 2


def test_sharded_retriever_over_http_and_in_process_equals_one_index(tmp_path, retriever, encoder):
    rows = [json.loads(line) for line in (retriever.store._map[:].decode().splitlines())]
    halves = []
    for name, part in (("a", rows[:25]), ("b", rows[25:])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        out = build_index_folder(
            BuildConfig(passages=str(path), out=str(tmp_path / name), backend="exact", embed=EmbedConfig(progress=False)),
            encoder=encoder,
            log=lambda _: None,
        )
        halves.append(Retriever.from_dir(out, encoder=encoder))
    queries = ["painting", "computers and music", "history"]
    whole = retriever.retrieve(queries, 6)
    with BackgroundServer(halves[0]) as server:
        sharded = ShardedRetriever([RetrieverClient(server.url), halves[1]])
        merged = sharded.retrieve(queries, 6)
        sharded.close()
    assert [[h["id"] for h in q] for q in merged] == [[h["id"] for h in q] for q in whole]
    for got, want in zip(merged, whole):
        np.testing.assert_allclose([h["score"] for h in got], [h["score"] for h in want], rtol=1e-5, atol=1e-6)


def test_cli_search_and_serve(tiny_index, capsys):
    from selfrag_jax.cli import main

    assert main(["index", "search", str(tiny_index), "--query", "chemistry", "-k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 2 and "chemistry" in hits[0]["text"].lower()
    assert main(["index", "search", str(tiny_index.parent / "missing"), "--query", "x"]) == 2
    assert "no such index folder" in capsys.readouterr().err

    proc = subprocess.Popen([sys.executable, "-m", "selfrag_jax", "serve-retrieval", str(tiny_index), "--port", "0", "--max-batch", "2"],
                            cwd=REPO, env=single_device_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "serving 60 passages on http://127.0.0.1:" in line, proc.stderr.read() if not line else line
        url = line.split(" on ")[1].split()[0]
        assert RetrieverClient(url).retrieve(["music"], 3)[0][0]["id"].startswith("p")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def start_server(args: list[str]) -> subprocess.Popen:
    """`selfrag-jax serve-retrieval ARGS` on a free loopback port; its URL comes with `server_url`."""
    return subprocess.Popen([sys.executable, "-m", "selfrag_jax", "serve-retrieval", *args, "--port", "0"],
                            cwd=REPO, env=single_device_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def server_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()  # the banner, printed once the port is bound
    assert " on http://127.0.0.1:" in line, proc.stderr.read() if not line else line
    return line.split(" on ")[1].split()[0]


def assert_same_hits(got: list[list[dict]], want: list[list[dict]]) -> None:
    assert [[h["id"] for h in q] for q in got] == [[h["id"] for h in q] for q in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose([h["score"] for h in g], [h["score"] for h in w], rtol=0, atol=1e-6)


def test_four_shard_services_behind_a_fan_out_equal_one_index(tmp_path, retriever, encoder, capsys):
    """Four `serve-retrieval` processes, one per quarter of the corpus, fanned out in process,
    by a fan-out server and by `serve-retrieval --shard ... --allow-partial`: the same hits as
    one index; a shard that hangs or dies is named (ShardUnavailable, 503) or flagged partial."""
    from selfrag_jax.cli import main
    from selfrag_jax.inference.cli import make_retriever

    rows = [json.loads(line) for line in retriever.store._map[:].decode().splitlines()]
    folders = []
    for i in range(4):  # contiguous quarters, so ties break as in the whole index (by row)
        path = tmp_path / f"s{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[15 * i : 15 * (i + 1)]))
        config = BuildConfig(passages=str(path), out=str(tmp_path / f"s{i}"), backend=BACKEND, embed=EmbedConfig(progress=False))
        folders.append(build_index_folder(config, encoder=encoder, log=lambda _: None))
    t0 = time.perf_counter()
    procs = [start_server([str(folder), "--max-batch", "2"]) for folder in folders]  # started together
    try:
        urls = [server_url(proc) for proc in procs]
        startup = time.perf_counter() - t0
        procs.append(start_server([f"--shard={url}" for url in urls] + ["--allow-partial", "--shard-timeout", "5"]))
        clients = [RetrieverClient(url, timeout=10) for url in urls]
        fan = ShardedRetriever(clients)
        queries = ["astronomy", "a passage on cooking", "football facts", "computers and music", "history notes"]
        for k in (1, 5, 12):
            assert_same_hits(fan.retrieve(queries, k), retriever.retrieve(queries, k))
        whole = retriever.retrieve(queries, 5)
        engine_retrieve = make_retriever(argparse.Namespace(index=None, retriever_url=",".join(urls)))  # generate's
        assert_same_hits(engine_retrieve(queries, 5), whole)
        with pytest.raises(ValueError, match="empty URL"):
            make_retriever(argparse.Namespace(index=None, retriever_url=f"{urls[0]},,{urls[1]}"))
        body = json.dumps({"queries": queries, "k": 5}).encode()
        with BackgroundServer(ShardedRetriever([RetrieverClient(url, timeout=10) for url in urls])) as front:
            status, data = raw_post(front.url, body)
            assert status == 200 and data["partial"] is False and data["missing"] == []
            assert_same_hits(data["results"], whole)
            status, data = raw_post(front.url, b"", path="/health", method="GET")
            assert status == 200 and data["status"] == "ok" and data["passages"] == 60
            assert [(s["shard"], s["passages"]) for s in data["shards"]] == [(url, 15) for url in urls]

            cli_url = server_url(procs[4])  # the CLI fan-out, --allow-partial
            status, data = raw_post(cli_url, body)
            assert status == 200 and data["partial"] is False
            assert_same_hits(data["results"], whole)

            # A shard that stops answering (its process stopped): the clients' timeout names it.
            procs[1].send_signal(signal.SIGSTOP)
            hung = ShardedRetriever([RetrieverClient(url, timeout=1) for url in urls])
            with pytest.raises(ShardUnavailable, match="timed out") as info:
                hung.retrieve(queries, 5)
            assert info.value.shards == [urls[1]]
            procs[1].send_signal(signal.SIGCONT)

            # A shard that is gone.
            procs[2].kill()
            procs[2].wait(timeout=30)
            with pytest.raises(ShardUnavailable) as info:
                fan.retrieve(queries, 5)
            assert info.value.shards == [urls[2]] and str(info.value).startswith(f"shard {urls[2]}")
            status, data = raw_post(front.url, body)
            assert status == 503 and data["error"].startswith(f"shard {urls[2]}"), data
            status, data = raw_post(front.url, b"", path="/health", method="GET")
            assert status == 503 and data["status"] == "unavailable" and data["passages"] == 45
            assert [s["status"] for s in data["shards"]] == ["ok", "ok", "unavailable", "ok"]

            rest = ShardedRetriever([c for i, c in enumerate(clients) if i != 2]).retrieve(queries, 5)
            status, data = raw_post(cli_url, body)
            assert status == 200 and data["partial"] is True and data["missing"] == [urls[2]]
            assert data["results"] == rest  # exactly the merge of the three that answered
            status, data = raw_post(cli_url, b"", path="/health", method="GET")
            assert status == 200 and data["status"] == "partial" and data["passages"] == 45
            partial = ShardedRetriever(clients, allow_partial=True).retrieve_detailed(queries, 5)
            assert partial.missing == [urls[2]] and partial.results == rest

        # The CLI's one-line refusals: DIR and --shard, neither, a shard down at start.
        assert main(["serve-retrieval", str(folders[0]), "--shard", urls[0]]) == 2
        assert main(["serve-retrieval"]) == 2
        assert main(["serve-retrieval", "--shard", urls[0], "--shard", urls[2]]) == 2
        err = capsys.readouterr().err
        assert "not both" in err and "at least one --shard" in err and f"shard {urls[2]}" in err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)
    with capsys.disabled():
        print(f"\nfour shard services up in {startup:.1f}s, test {time.perf_counter() - t0:.1f}s")
