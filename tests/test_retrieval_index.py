"""Indexes: exact search, ScaNN recall with automatic parameters, serialisation, sharding,
passage files, crash-safe builds, and an import that stays free of ScaNN/TensorFlow."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from selfrag_jax.retrieval.build import BuildConfig, build_index_folder, partial_dir, read_manifest
from selfrag_jax.retrieval.embed import EmbedConfig
from selfrag_jax.retrieval.index import ExactIndex, ScannIndex, ScannParams, ShardedIndex, build_index, calibrate
from selfrag_jax.retrieval.passages import PassageStore, iter_passages, write_store
from selfrag_jax.retrieval.synthetic import clustered_vectors, recall_at_k, split_queries
from test_retrieval_support import make_tiny_bert, single_device_env, write_corpus

REPO = Path(__file__).resolve().parents[1]


def test_import_does_not_load_scann_or_tensorflow():
    code = (
        "import sys, selfrag_jax.retrieval as r\n"
        "from selfrag_jax.retrieval import Retriever, RetrieverClient, ExactIndex, ScannIndex, TextEncoder, ServerConfig\n"
        "import selfrag_jax.retrieval.cli, selfrag_jax.retrieval.server, selfrag_jax.retrieval.build\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('scann', 'tensorflow')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=single_device_env())


def test_exact_index_matches_brute_force_across_blocks():
    rng = np.random.default_rng(0)
    db = rng.standard_normal((1000, 16), dtype=np.float32)
    queries = rng.standard_normal((300, 16), dtype=np.float32)  # more than one query chunk
    scores, rows = ExactIndex(db, block_rows=128).search(queries, 7)
    truth = np.argsort(-(queries @ db.T), axis=1)[:, :7]
    np.testing.assert_array_equal(rows, truth)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ db.T, truth, 1), rtol=1e-5, atol=1e-5)
    assert ExactIndex(db[:3]).search(queries[:2], 10)[1].shape == (2, 3)  # k > size


def test_auto_parameters_follow_corpus_size():
    assert ScannParams.auto(5_000).brute_force
    mid = ScannParams.auto(50_000)
    assert (mid.brute_force, mid.num_leaves, mid.reorder) == (False, 0, 100)
    big = ScannParams.auto(1_000_000)
    assert (big.num_leaves, big.training_sample_size, big.dims_per_block, big.soar_lambda) == (4000, 400_000, 4, 1.5)
    assert 10 <= big.leaves_to_search <= 400 and big.reorder > 0 and big.reorder_dtype == "float32"
    assert ScannParams.auto(21_000_000).reorder_dtype == "int8"
    assert ScannParams.auto(1_000_000, normalized=False, mean_sq_norm=4.0).anisotropic_threshold == pytest.approx(0.8)
    with pytest.raises(ValueError, match="unknown ScaNN parameter"):
        big.replace(leaves=3)


@pytest.mark.slow
def test_scann_recall_and_moved_serialisation(tmp_path, capsys):
    pytest.importorskip("scann")
    vectors = clustered_vectors(201_000, 64, clusters=1000, seed=0)
    db, queries = split_queries(vectors, 1000)
    _, truth = ExactIndex(db).search(queries, 10)
    t0 = time.perf_counter()
    index, calibration = build_index(db, "scann", normalized=True, target_recall=0.95)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores, rows = index.search(queries, 10)
    search_s = time.perf_counter() - t0
    recall = recall_at_k(rows, truth)
    with capsys.disabled():
        print(f"\nScaNN auto {index.params}: recall@10 {recall:.4f} on 200k x 64, build {build_s:.1f}s, {len(queries) / search_s:.0f} QPS")
    assert index.params.num_leaves == 1789 and calibration["reached"]
    assert (index.params.leaves_to_search, index.params.reorder) == (calibration["leaves_to_search"], calibration["reorder"])
    assert recall >= 0.95  # held-out queries, the calibrated settings as they are

    (tmp_path / "a").mkdir()
    params = index.save(tmp_path / "a")
    shutil.move(tmp_path / "a", tmp_path / "b")
    moved = ScannIndex.load(tmp_path / "b", params, len(db))
    moved_scores, moved_rows = moved.search(queries, 10)
    np.testing.assert_array_equal(moved_rows, rows)
    np.testing.assert_array_equal(moved_scores, scores)


def test_calibration_picks_the_fewest_leaves_that_reach_the_target():
    pytest.importorskip("scann")
    vectors = clustered_vectors(31_000, 32, clusters=300, seed=2)
    db, queries = split_queries(vectors, 1000)
    index, report = build_index(db, "scann", normalized=True, overrides={"num_leaves": 150}, target_recall=0.9)
    assert report["reached"] and report["recall_lower_bound"] >= 0.9 and report["queries"] == 1000
    chosen = (index.params.leaves_to_search, index.params.reorder)
    assert chosen == (report["leaves_to_search"], report["reorder"])
    for depth in {p["reorder"] for p in report["sweep"]}:  # per depth: the widest, then leaves upwards to the first hit
        widest, *points = [p for p in report["sweep"] if p["reorder"] == depth]
        assert widest["leaves_to_search"] == 75  # half the leaves
        assert all(p["recall_lower_bound"] < 0.9 for p in points[:-1])
        assert [p["leaves_to_search"] for p in points] == sorted(p["leaves_to_search"] for p in points)
        assert not points or ("qps" in points[-1]) == (points[-1]["recall_lower_bound"] >= 0.9)
    _, truth = ExactIndex(db).search(queries, 10)
    assert recall_at_k(index.search(queries, 10)[1], truth) >= 0.88  # held-out points, settings as calibrated

    fixed, fixed_report = calibrate(index, db, 0.9, fixed=["reorder"])  # a knob the user gave is kept
    assert fixed.params.reorder == index.params.reorder and {p["reorder"] for p in fixed_report["sweep"]} == {index.params.reorder}
    noisy = lambda rows: db[rows] + 0.05 * np.random.default_rng(0).standard_normal((len(rows), 32), np.float32)  # noqa: E731
    wide, shifted = calibrate(index, db, 0.9, query_maker=noisy)  # queries off the corpus: a wider search
    assert shifted["reached"] and shifted["leaves_to_search"] * shifted["reorder"] >= report["leaves_to_search"] * report["reorder"]
    fresh = queries + 0.05 * np.random.default_rng(1).standard_normal(queries.shape, np.float32)  # held out, same shift
    assert recall_at_k(wide.search(fresh, 10)[1], ExactIndex(db).search(fresh, 10)[1]) >= 0.88
    exact, note = build_index(db[:5000], "scann", normalized=True, target_recall=0.9)
    assert exact.params.brute_force and note["reached"]


def test_sharded_index_equals_one_index():
    vectors = clustered_vectors(3000, 32, clusters=20, seed=1)
    queries = vectors[:50] + 0.01
    whole = ExactIndex(vectors).search(queries, 10)
    parts = ShardedIndex([ExactIndex(vectors[:1000]), ExactIndex(vectors[1000:1700]), ExactIndex(vectors[1700:])])
    sharded = parts.search(queries, 10)
    np.testing.assert_array_equal(sharded[1], whole[1])
    np.testing.assert_allclose(sharded[0], whole[0], rtol=1e-6)


def test_passage_files_and_store(tmp_path):
    tsv = tmp_path / "psgs.tsv"
    tsv.write_text('id\ttext\ttitle\n1\t"He said ""hi"" there"\tGreeting\n2\tplain\ttext\t\n'.replace("\t\n", "\n"), encoding="utf-8")
    passages = list(iter_passages(tsv))
    assert [(p.id, p.title, p.text) for p in passages] == [("1", "Greeting", 'He said "hi" there'), ("2", "text", "plain")]
    assert passages[0].embed_text == 'Greeting He said "hi" there'
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"id": 7, "title": "T", "text": "ünï"}\n\n{"id": "x", "text": "no title"}\n', encoding="utf-8")
    assert write_store(iter_passages(jsonl), tmp_path / "store") == 2
    store = PassageStore(tmp_path / "store")
    assert len(store) == 2 and store.get(0).text == "ünï" and store.get(1).title == "" and store.get(1).id == "x"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\n{"id": 2, "title": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'text'"):
        list(iter_passages(bad))


def test_build_folder_exact_and_scann_agree_and_reload(tmp_path):
    pytest.importorskip("scann")
    from selfrag_jax.retrieval.retriever import Retriever

    corpus = write_corpus(tmp_path / "c.jsonl", 300)
    encoder_dir = make_tiny_bert(tmp_path / "tiny")
    common = dict(passages=str(corpus), encoder=str(encoder_dir), embed=EmbedConfig(shard_size=64, progress=False))
    exact_dir = build_index_folder(BuildConfig(out=str(tmp_path / "exact"), backend="exact", **common), log=lambda _: None)
    scann_dir = build_index_folder(BuildConfig(out=str(tmp_path / "scann"), backend="scann", **common), log=lambda _: None)
    manifest = read_manifest(scann_dir)
    assert (manifest["count"], manifest["dimension"], manifest["pooling"], manifest["normalize"]) == (300, 32, "mean", False)
    assert manifest["params"]["brute_force"] is True
    size = manifest["bytes"]
    assert size["passages"] == (scann_dir / "passages.jsonl").stat().st_size and size["offsets"] == 8 * 301 + 128  # .npy header
    assert size["index"] == sum(size["index_files"].values()) > 300 * 32  # ScaNN keeps the float32 vectors
    assert size["per_passage"]["total"] == pytest.approx(size["total"] / 300)
    assert not partial_dir(scann_dir).exists() and not (scann_dir / "embeddings").exists()
    tree_dir = build_index_folder(BuildConfig(out=str(tmp_path / "tree"), backend="scann", **common, target_recall=0.9,
                                              scann={"brute_force": False, "num_leaves": 12, "reorder": 50}), log=lambda _: None)  # fmt: skip
    calibration = read_manifest(tree_dir)["calibration"]  # a tree on a small corpus: the build path calibrates
    assert calibration["queries"] == 300 and calibration["queries_from"] == "passage texts without their titles"
    tree_params = read_manifest(tree_dir)["params"]
    assert (tree_params["leaves_to_search"], tree_params["num_leaves"]) == (calibration["leaves_to_search"], 12)
    queries = ["astronomy facts", "cooking notes", "history of painting"]
    a = Retriever.from_dir(exact_dir).retrieve(queries, 5)
    b = Retriever.from_dir(scann_dir).retrieve(queries, 5)
    assert [[h["id"] for h in q] for q in a] == [[h["id"] for h in q] for q in b]
    shutil.move(scann_dir, tmp_path / "moved")
    assert Retriever.from_dir(tmp_path / "moved").retrieve(queries, 5) == b
    shutil.move(encoder_dir, tmp_path / "tiny-elsewhere")  # as on another machine
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model folder"):
        Retriever.from_dir(tmp_path / "moved")
    assert Retriever.from_dir(tmp_path / "moved", encoder_path=tmp_path / "tiny-elsewhere").retrieve(queries, 5) == b
    encoder_dir = tmp_path / "tiny-elsewhere"
    common["encoder"] = str(encoder_dir)
    with pytest.raises(ValueError, match="already there"):
        build_index_folder(BuildConfig(out=str(exact_dir), backend="exact", **common))


def test_hosts_of_a_pod_embed_disjoint_shards(tmp_path):
    from selfrag_jax.retrieval.embed import embed_store, load_embeddings
    from selfrag_jax.retrieval.encoder import TextEncoder

    write_store(iter_passages(write_corpus(tmp_path / "c.jsonl", 250)), tmp_path / "store")
    store = PassageStore(tmp_path / "store")
    encoder = TextEncoder.load(make_tiny_bert(tmp_path / "tiny"))
    written = [embed_store(store, encoder, tmp_path / "emb", EmbedConfig(shard_size=40, process_index=p, process_count=2, progress=False))
               for p in (0, 1)]  # fmt: skip
    assert written == [[0, 2, 4, 6], [1, 3, 5]]
    assert embed_store(store, encoder, tmp_path / "emb", EmbedConfig(shard_size=40, process_index=0, process_count=1, progress=False)) == []
    vectors = load_embeddings(tmp_path / "emb", 250, 40, encoder.dimension)
    np.testing.assert_allclose(vectors[200:210], encoder.encode(store.texts(200, 210)), rtol=1e-5, atol=1e-5)


def test_build_killed_half_way_leaves_no_index_and_resumes(tmp_path):
    from selfrag_jax.retrieval.retriever import Retriever

    corpus = write_corpus(tmp_path / "c.jsonl", 4000, max_words=40)
    encoder_dir = make_tiny_bert(tmp_path / "tiny")
    out = tmp_path / "idx"
    command = [sys.executable, "-m", "selfrag_jax", "index", "build", "--passages", str(corpus), "--out", str(out),
               "--encoder", str(encoder_dir), "--backend", "exact", "--shard-size", "100", "--batch-size", "32",
               "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=single_device_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    shards = partial_dir(out) / "embeddings"
    deadline = time.monotonic() + 120
    while not (shards.exists() and len(list(shards.glob("emb-*.npy"))) >= 2):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "no embedding shard within 120 s"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done_before = len(list(shards.glob("emb-*.npy")))
    assert 2 <= done_before < 40
    assert not out.exists()
    for folder in (out, partial_dir(out)):
        with pytest.raises((ValueError, FileNotFoundError)):
            Retriever.from_dir(folder)

    rerun = subprocess.run(command, cwd=REPO, env=single_device_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"embedding: {40 - done_before} shards written" in rerun.stderr  # finished shards were reused
    assert read_manifest(out)["count"] == 4000 and not partial_dir(out).exists()
    hits = Retriever.from_dir(out).retrieve(["chemistry"], 3)[0]
    assert len(hits) == 3 and all(set(h) == {"id", "title", "text", "score"} for h in hits)
