"""The seqio + TFDS data path: local TFDS builder (no network), line-numbered errors, the
seqio Vocabulary, and batches identical to the numpy path. Skipped without the data extra."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("seqio")
pytest.importorskip("tensorflow_datasets")

from selfrag_jax.data import (  # noqa: E402
    BATCH_KEYS, DataConfig, MaskConfig, RecordError, batches, critic_tasks, generator_task, iter_records,
)
from selfrag_jax.tokenizer import SelfRAGTokenizer  # noqa: E402
from tests.helpers import build_test_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    build_test_world(out)
    small = out / "small"
    small.mkdir()
    gen = (out / "train" / "generator.jsonl").read_text().splitlines()[:80]
    crit = [x for i, x in enumerate((out / "train" / "critic.jsonl").read_text().splitlines()) if i % 1000 < 16]
    (small / "generator.jsonl").write_text("\n".join(gen) + "\n")
    (small / "critic.jsonl").write_text("\n".join(crit) + "\n")
    return out


@pytest.fixture(scope="module")
def tok(world):
    return SelfRAGTokenizer.from_pretrained(world / "tokenizer")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_tfds_builder_reads_local_file_without_network(world, tmp_path, no_network):
    import tensorflow_datasets as tfds

    from selfrag_jax.data.seqio_tasks import prepare_jsonl

    path = world / "small" / "critic.jsonl"
    builder = prepare_jsonl(str(path), "critic", str(tmp_path / "tfds"))
    got = [{k: (v.decode() if isinstance(v, bytes) else int(v)) for k, v in ex.items()}
           for ex in tfds.as_numpy(builder.as_dataset(split="train"))]
    want = [{**{k: r[k] for k in ("instruction", "input", "output", "id", "type")}, "line": n}
            for n, r in iter_records(path, "critic")]
    assert got == want  # every record, in file order, type normalised
    assert {r["type"] for r in got} == {"retrieve", "isrel", "issup", "isuse"}
    again = prepare_jsonl(str(path), "critic", str(tmp_path / "tfds"))  # prepared once, reused
    assert again.data_dir == builder.data_dir


def test_tfds_builder_reports_bad_line(tmp_path, no_network):
    from selfrag_jax.data.seqio_tasks import prepare_jsonl

    path = tmp_path / "gen.jsonl"
    good = json.dumps({"instruction": "a", "input": "", "output": "[No Retrieval]b[Utility:5]", "id": "1"})
    path.write_text(f"{good}\n{good}\n" + json.dumps({"instruction": "no output"}) + "\n")
    with pytest.raises(RecordError, match=rf"{path}:3: record has no 'output'"):
        prepare_jsonl(str(path), "generator", str(tmp_path / "tfds"))
    path.write_text(f"{good}\n{{broken\n")
    with pytest.raises(RecordError, match=rf"{path}:2: not valid JSON"):
        prepare_jsonl(str(path), "generator", str(tmp_path / "tfds"))


def test_vocabulary_handles_reflection_tokens_by_id(tok):
    import tensorflow as tf

    from selfrag_jax.data.seqio_tasks import SelfRAGVocabulary

    text, structured = SelfRAGVocabulary(tok), SelfRAGVocabulary(tok, structured=True)
    s = "[Retrieval]<paragraph>Ada\nborn in Lurvik</paragraph>[Relevant]Lurvik[Utility:5]"
    ids = structured.encode(s)
    assert ids == tok.encode_structured(s) and tok.control_id("<paragraph>") in ids
    assert not set(text.encode(s)) & tok.control_ids  # untrusted text never makes a control id
    assert structured.encode_tf(tf.constant(s)).numpy().tolist() == ids
    assert text.encode_tf(tf.constant(s)).numpy().tolist() == tok.encode_text(s)
    assert structured.decode(ids) == s
    assert structured.vocab_size == len(tok) and structured.pad_id == tok.pad_id and structured.eos_id == tok.eos_id


def config(world, **kw):
    small = world / "small"
    tasks = (generator_task(str(small / "generator.jsonl")), *critic_tasks(str(small / "critic.jsonl"), 0.25))
    return DataConfig(**{"tasks": tasks, "batch_size": 4, "seq_len": 192, "seed": 5, "shard_index": 0,
                         "num_shards": 1, **kw})


@pytest.mark.parametrize("kw", [
    {},
    {"pack": False, "seq_len": 96, "mask": MaskConfig("released", prompt_off_by_one=True, passage_loss_weight=0.1)},
    {"shard_index": 1, "num_shards": 2, "mask": MaskConfig(critic_labels="tokens")},
], ids=["paper-packed", "released-unpacked", "shard1of2"])
def test_seqio_and_numpy_paths_give_identical_batches(world, tok, tmp_path, monkeypatch, kw):
    monkeypatch.setenv("SELFRAG_JAX_TFDS_DIR", str(tmp_path / "tfds"))
    cfg = config(world, **kw)
    a, b = batches(cfg, tok, backend="seqio"), batches(cfg, tok, backend="numpy")
    for _ in range(12):  # more than one epoch of each critic type
        x, y = next(a), next(b)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    assert a.stats == b.stats and b.stats["truncated"] > 0
    # a position saved on one path resumes on the other
    c = batches(cfg, tok, backend="numpy", state=a.state())
    x, y = next(a), next(c)
    assert all(np.array_equal(x[k], y[k]) for k in BATCH_KEYS)


def test_registered_mixture_serves_seqio_users(world, tok, tmp_path):
    import seqio
    import tensorflow_datasets as tfds

    from selfrag_jax.data.seqio_tasks import register_tasks

    name = register_tasks(config(world), tok, str(tmp_path / "tfds"))
    mix = seqio.get_mixture_or_task(name)
    assert sorted(t.name for t in mix.tasks) == sorted(
        f"selfrag_jax_{n}" for n in ("generator", "critic_retrieve", "critic_isrel", "critic_issup", "critic_isuse"))
    ds = mix.get_dataset({"targets": 129, "loss_weights": 129}, split="train", shuffle=True, seed=0, num_epochs=1)
    for ex in tfds.as_numpy(ds.take(8)):
        assert ex["targets"].dtype == np.int32 and len(ex["targets"]) == len(ex["loss_weights"]) <= 129
        assert ex["targets"][0] == tok.bos_id
