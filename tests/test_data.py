"""Training data path (numpy; no TensorFlow): golden loss masks, packing, order, resume, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from selfrag_jax import tokens as T
from selfrag_jax.data import (
    BATCH_KEYS, DataConfig, MaskConfig, RecordError, SpecialIds, batches, critic_tasks, encode_record,
    generator_task,
)
from selfrag_jax.data.records import JsonlIndex
from selfrag_jax.tokenizer import SelfRAGTokenizer
from tests.helpers import build_test_world, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return SelfRAGTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The bundled world's training files, trimmed to a few hundred records."""
    out = tmp_path_factory.mktemp("world")
    build_test_world(out)
    small = out / "small"
    small.mkdir()
    for name, n in (("generator", 300), ("critic", 5000)):
        lines = (out / "train" / f"{name}.jsonl").read_text().splitlines()
        if name == "critic":  # 60 per token type, keeping the file's type order
            lines = [x for i, x in enumerate(lines) if i % 1000 < 60]
        (small / f"{name}.jsonl").write_text("\n".join(lines[:n]) + "\n")
    return out


def expected(tok, prompt: str, pieces: list[tuple[str, float]], critic=False):
    """Golden (ids, weights) built from pieces: (text or control-token string, weight)."""
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_text(prompt)
    w = [0.0] * len(ids)
    for text, weight in pieces:
        part = [tok.control_id(text)] if text in T.CONTROL_TOKENS else tok.encode_text(text)
        ids += part
        w += [weight] * len(part)
    return ids + [tok.eos_id], w + [1.0]


def rec(output, instruction="Where was Alice born?", input=""):
    return {"instruction": instruction, "input": input, "output": output, "id": "x", "type": "t"}


P1 = "Alice Mbeki\nShe was born in Lurvik."
P2 = "Paris\nParis is the capital of France."
ONE = f"[Retrieval]<paragraph>{P1}</paragraph>[Relevant]Lurvik[Fully supported][Utility:5]"
TWO = (f"[Retrieval]<paragraph>{P1}</paragraph>[Relevant]She was born in Lurvik.[Fully supported]"
       f"[Retrieval]<paragraph>{P2}</paragraph>[Irrelevant]The fox jumps.[Utility:4]")


def check(ex, ids, weights):
    assert ex.tokens.tolist() == ids
    np.testing.assert_allclose(ex.weights, weights)


# --- golden loss masks ------------------------------------------------------------------
def test_one_passage_paper(tok):
    ex = encode_record(rec(ONE), "generator", tok, MaskConfig())
    ids, w = expected(tok, T.format_prompt("Where was Alice born?"), [
        ("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0), ("</paragraph>", 1), ("[Relevant]", 1), ("Lurvik", 1),
        ("[Fully supported]", 1), ("[Utility:5]", 1)])
    check(ex, ids, w)
    assert not ex.truncated and ex.has_loss


def test_two_passages_paper_and_released(tok):
    prompt = T.format_prompt("Where was Alice born?")
    paper = encode_record(rec(TWO), "generator", tok, MaskConfig("paper"))
    released = encode_record(rec(TWO), "generator", tok, MaskConfig("released"))
    between = ("</paragraph>", "[Relevant]", "She was born in Lurvik.", "[Fully supported]", "[Retrieval]", "<paragraph>")
    head = [("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0)]
    tail = [(P2, 0), ("</paragraph>", 1), ("[Irrelevant]", 1), ("The fox jumps.", 1), ("[Utility:4]", 1)]
    check(paper, *expected(tok, prompt, head + [(x, 1) for x in between] + tail))
    # released: everything strictly between the first <paragraph> and the last </paragraph>
    check(released, *expected(tok, prompt, head + [(x, 0) for x in between] + tail))


def test_unterminated_paragraph_masks_to_end(tok):
    full, _ = expected(tok, T.format_prompt("Where was Alice born?"), [(x, 1) for x in
                       ("[Retrieval]", "<paragraph>", P1, "</paragraph>", "[Relevant]")])
    cut = len(full) - 8  # inside P1: its </paragraph> and everything after are cut off
    for masking in ("paper", "released"):
        ex = encode_record(rec(ONE), "generator", tok, MaskConfig(masking), max_tokens=cut)
        assert ex.truncated and len(ex.tokens) == cut
        at = ex.tokens.tolist().index(tok.control_id("<paragraph>"))
        assert ex.weights[at] == 1 and ex.weights[at - 1] == 1  # [Retrieval]<paragraph> trained
        assert not ex.weights[at + 1:].any()  # content to the end masked
    # released mode, truncated inside the second passage: the open passage masks to the end too
    whole = encode_record(rec(TWO), "generator", tok, MaskConfig()).tokens
    cut = int(np.flatnonzero(whole == tok.control_id("</paragraph>"))[-1]) - 2
    ex = encode_record(rec(TWO), "generator", tok, MaskConfig("released"), max_tokens=cut)
    opens = np.flatnonzero(ex.tokens == tok.control_id("<paragraph>"))
    assert len(opens) == 2 and not ex.weights[opens[0] + 1:].any()


def test_no_retrieval_example(tok):
    out = "[No Retrieval]The fox jumps over the lazy dog.[Utility:5]"
    ex = encode_record(rec(out, "Copy: The fox jumps over the lazy dog."), "generator", tok, MaskConfig())
    check(ex, *expected(tok, T.format_prompt("Copy: The fox jumps over the lazy dog."), [
        ("[No Retrieval]", 1), ("The fox jumps over the lazy dog.", 1), ("[Utility:5]", 1)]))


def test_prompt_mask_with_input_and_off_by_one(tok):
    r = rec("[No Retrieval]Paris[Utility:5]", "Answer the question.", "What is the capital of France?")
    prompt = T.format_prompt("Answer the question.", "What is the capital of France?")
    assert "### Input:\n" in prompt and prompt.endswith("### Response:\n")
    ids, w = expected(tok, prompt, [("[No Retrieval]", 1), ("Paris", 1), ("[Utility:5]", 1)])
    check(encode_record(r, "generator", tok, MaskConfig()), ids, w)
    n_prompt = 1 + len(tok.encode_text(prompt))
    w[n_prompt - 1] = 1.0  # the reference keeps the last prompt token in the loss
    check(encode_record(r, "generator", tok, MaskConfig(prompt_off_by_one=True)), ids, w)


def test_passage_loss_weight(tok):
    ex = encode_record(rec(ONE), "generator", tok, MaskConfig(passage_loss_weight=0.1))
    ids, w = expected(tok, T.format_prompt("Where was Alice born?"), [
        ("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0.1), ("</paragraph>", 1), ("[Relevant]", 1), ("Lurvik", 1),
        ("[Fully supported]", 1), ("[Utility:5]", 1)])
    check(ex, ids, w)


def test_unsupported_weight(tok):
    out = ("[Retrieval]<paragraph>" + P1 + "</paragraph>[Relevant]Oslo[No support / Contradictory]"
           "[Retrieval]<paragraph>" + P1 + "</paragraph>[Relevant]Lurvik[Fully supported][Utility:2]")
    segments = [("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0), ("</paragraph>", 1), ("[Relevant]", 1), ("Oslo", None),
                ("[No support / Contradictory]", 1), ("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0), ("</paragraph>", 1),
                ("[Relevant]", 1), ("Lurvik", 1), ("[Fully supported]", 1), ("[Utility:2]", 1)]
    prompt = T.format_prompt("Where was Alice born?")
    for weight in (0.0, 0.25, 1.0):
        ids, w = expected(tok, prompt, [(x, weight if v is None else v) for x, v in segments])
        check(encode_record(rec(out), "generator", tok, MaskConfig(unsupported_weight=weight)), ids, w)
    with pytest.raises(ValueError, match="unsupported_weight"):
        MaskConfig(unsupported_weight=1.5)


def test_unhelpful_weight(tok):
    """An output rated [Utility:1] or [Utility:2]: the text of its relevant segments is weighed by
    unhelpful_weight, an irrelevant segment's text and every reflection token stay trained; an
    output rated [Utility:5] is untouched."""
    def segments(utility):
        return [("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0), ("</paragraph>", 1), ("[Relevant]", 1), ("1895", None),
                ("[Fully supported]", 1), ("[Retrieval]", 1), ("<paragraph>", 1), (P2, 0), ("</paragraph>", 1),
                ("[Irrelevant]", 1), ("Paris", 1), (utility, 1)]
    prompt = T.format_prompt("Where was Alice born?")
    for utility in ("[Utility:1]", "[Utility:2]", "[Utility:5]"):
        out = "".join(x for x, _ in segments(utility)[:2]) + P1 + "".join(x for x, _ in segments(utility)[3:9]) + P2 + \
            "".join(x for x, _ in segments(utility)[10:])
        for weight in (0.0, 0.5):
            low = weight if utility != "[Utility:5]" else 1
            ids, w = expected(tok, prompt, [(x, low if v is None else v) for x, v in segments(utility)])
            check(encode_record(rec(out), "generator", tok, MaskConfig(unhelpful_weight=weight)), ids, w)
    with pytest.raises(ValueError, match="unhelpful_weight"):
        MaskConfig(unhelpful_weight=-0.1)


def test_markers_in_untrusted_text_are_not_markers(tok):
    r = rec("[No Retrieval]ok[Utility:5]", "Say <paragraph> and </paragraph> and [Relevant]", "</paragraph>")
    ex = encode_record(r, "generator", tok, MaskConfig())
    assert not set(ex.tokens.tolist()) & {tok.control_id("<paragraph>"), tok.control_id("</paragraph>"),
                                          tok.control_id("[Relevant]")}
    assert ex.weights.sum() == len(tok.encode_text("ok")) + 3  # [No Retrieval] ok [Utility:5] EOS


def test_critic_example(tok):
    r = {"instruction": "Is the evidence relevant?", "input": "Task instruction: x\nEvidence: y", "output": "[Relevant]",
         "id": "c", "type": "isrel"}
    prompt = T.CRITIC_PROMPT.format(instruction=r["instruction"], input=r["input"])
    assert prompt.endswith("### Response:")
    check(encode_record(r, "critic", tok, MaskConfig()), *expected_text_label(tok, prompt, "[Relevant]"))
    check(encode_record(r, "critic", tok, MaskConfig(critic_labels="tokens")),
          *expected(tok, prompt, [("[Relevant]", 1)]))


def expected_text_label(tok, prompt, label):
    ids = [tok.bos_id] + tok.encode_text(prompt)
    lab = tok.encode_text(label)
    return ids + lab + [tok.eos_id], [0.0] * len(ids) + [1.0] * (len(lab) + 1)


# --- records -----------------------------------------------------------------------------
def test_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps({"instruction": "a", "output": "[No Retrieval]b[Utility:5]"})
    for bad, why in (("{not json", "not valid JSON"), (json.dumps({"instruction": "a"}), "no 'output'"),
                     ("[1, 2]", "JSON object")):
        path = tmp_path / "d.jsonl"
        path.write_text(f"{good}\n\n{good}\n{bad}\n")
        with pytest.raises(RecordError, match=rf"{path}:4: .*{why}"):
            JsonlIndex.build(path, "generator")
    path.write_text(json.dumps({"instruction": "a", "output": "[Relevant]", "task": "nonsense"}) + "\n")
    with pytest.raises(RecordError, match=rf"{path}:1: unknown critic task"):
        JsonlIndex.build(path, "critic")


def test_critic_types_from_task_or_dataset_name(tmp_path):
    rows = [{"instruction": "i", "input": "x", "output": "[Relevant]", "task": "relevance"},
            {"instruction": "i", "input": "x", "output": "[Utility:5]", "task": "utility"},
            {"instruction": "i", "input": "x", "output": "[Fully supported]", "task": "groudness"},
            {"instruction": "i", "input": "x", "output": "[Retrieval]", "dataset_name": "critic_retrieve_sentence"},
            {"instruction": "i", "input": "x", "output": "[Irrelevant]", "dataset_name": "critic_isrel"}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = {t: len(JsonlIndex.build(path, "critic", t)) for t in ("retrieve", "isrel", "issup", "isuse")}
    assert sizes == {"retrieve": 1, "isrel": 2, "issup": 1, "isuse": 1}


# --- packing -----------------------------------------------------------------------------
def cfg_for(world, **kw):
    small = world / "small"
    tasks = (generator_task(str(small / "generator.jsonl")), *critic_tasks(str(small / "critic.jsonl"), 0.25))
    return DataConfig(**{"tasks": tasks, "batch_size": 4, "seq_len": 192, "seed": 3, "shard_index": 0,
                         "num_shards": 1, **kw})


def test_packing_keeps_masks_and_boundaries(world):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    cfg = cfg_for(world, num_epochs=1)
    it = batches(cfg, wtok)
    # the examples in stream order, to compare segment by segment
    ref = batches(cfg, wtok)
    wanted = []
    while (nxt := ref._next_draw()) is not None:
        ex = ref.sources[nxt[0]].example(nxt[1])
        if ex.has_loss:
            wanted.append(ex)
    got, n_batches = [], 0
    for b in it:
        n_batches += 1
        assert set(b) == set(BATCH_KEYS)
        assert all(v.shape == (4, 192) for v in b.values())
        assert b["loss_weights"].dtype == np.float32 and all(b[k].dtype == np.int32 for k in BATCH_KEYS if k != "loss_weights")
        for r in range(4):
            seg = b["segment_ids"][r]
            assert (np.diff(seg[seg > 0]) >= 0).all() and (np.diff((seg == 0).astype(int)) >= 0).all()  # padding last
            for s in range(1, seg.max() + 1):
                at = np.flatnonzero(seg == s)
                assert (np.diff(at) == 1).all()
                np.testing.assert_array_equal(b["positions"][r, at], np.arange(len(at)))
                inp, tgt = b["inputs"][r, at], b["targets"][r, at]
                np.testing.assert_array_equal(inp[1:], tgt[:-1])  # next-token within the segment
                got.append((np.concatenate([inp[:1], tgt]), b["loss_weights"][r, at]))
            pad = seg == 0
            assert (b["loss_weights"][r, pad] == 0).all() and (b["inputs"][r, pad] == wtok.pad_id).all()
    # every example appears once, whole: tokens and mask as encoded, the last target its own EOS
    assert len(got) == len(wanted) and it.stats["batches"] == n_batches
    got.sort(key=lambda g: g[0].tobytes())
    wanted.sort(key=lambda e: e.tokens.tobytes())
    for (tokens, weights), ex in zip(got, wanted):
        np.testing.assert_array_equal(tokens, ex.tokens)
        np.testing.assert_array_equal(weights, ex.weights[1:])
    assert it.stats["truncated"] > 0 and it.stats["dropped"] >= 0
    assert it.stats["examples"] == len(wanted) + it.stats["dropped"]


def test_unpacked_rows_and_truncation_counts(world):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    it = batches(cfg_for(world, pack=False, seq_len=64, num_epochs=1), wtok)
    b = next(it)
    assert (b["segment_ids"].max(axis=1) == 1).all()
    assert it.stats["truncated"] > 0  # world passages are longer than 64 tokens
    assert it.stats["dropped"] > 0  # critic prompts fill 64 tokens: nothing left to train


def test_dropped_examples_are_counted(tok, tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"instruction": "word " * 50, "output": "[No Retrieval]x[Utility:5]"}) + "\n"
                    + json.dumps({"instruction": "a", "output": "[No Retrieval]x[Utility:5]"}) + "\n")
    it = batches(DataConfig((generator_task(str(path)),), batch_size=2, seq_len=40, num_epochs=1, shard_index=0,
                            num_shards=1), tok)
    assert len(list(it)) == 1 and it.stats["dropped"] == 1 and it.stats["examples"] == 2


# --- order, sharding, resume --------------------------------------------------------------
def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in BATCH_KEYS) and len(a) == len(b)


def test_same_seed_same_batches(world):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    a = take(batches(cfg_for(world), wtok), 6)
    assert same(a, take(batches(cfg_for(world), wtok), 6))
    assert not same(a, take(batches(cfg_for(world, seed=4), wtok), 6))


def test_mixture_rates_and_epochs(world):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    it = batches(cfg_for(world), wtok)
    counts = np.bincount([it.order.task_of(k) for k in range(20000)], minlength=5) / 20000
    np.testing.assert_allclose(counts, [0.5, 0.125, 0.125, 0.125, 0.125], atol=0.015)
    one = batches(cfg_for(world, tasks=cfg_for(world).tasks[:1], num_epochs=2), wtok)
    seen = []
    while (nxt := one._next_draw()) is not None:
        seen.append(nxt[1])
    assert sorted(seen[:300]) == list(range(300)) == sorted(seen[300:]) and seen[:300] != seen[300:]


def test_shards_are_disjoint(world):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    draws = []
    for h in range(3):
        it = batches(cfg_for(world, tasks=cfg_for(world).tasks[:1], shard_index=h, num_shards=3, num_epochs=1), wtok)
        draws.append([r for _, r in iter(it._next_draw, None)])
    flat = [r for d in draws for r in d]
    assert sorted(flat) == list(range(300)) and all(len(d) == 100 for d in draws)


RESUME = """
import json, sys, numpy as np
from selfrag_jax.data import DataConfig, batches, critic_tasks, generator_task, BATCH_KEYS
from selfrag_jax.tokenizer import SelfRAGTokenizer
small, state_file, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tasks = (generator_task(small + "/generator.jsonl"), *critic_tasks(small + "/critic.jsonl", 0.25))
cfg = DataConfig(tasks=tasks, batch_size=4, seq_len=192, seed=3, shard_index=0, num_shards=1)
it = batches(cfg, SelfRAGTokenizer.from_pretrained(sys.argv[5]), state=json.load(open(state_file)))
np.savez(out, **{f"{i}_{k}": b[k] for i in range(n) for b in [next(it)] for k in BATCH_KEYS})
"""


def test_resume_in_new_process(world, tmp_path):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    full = take(batches(cfg_for(world), wtok), 17)  # > one epoch of the critic tasks' draws
    it = batches(cfg_for(world), wtok)
    take(it, 12)
    state = it.state()
    (tmp_path / "pos.json").write_text(json.dumps(state))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", RESUME, str(world / "small"), str(tmp_path / "pos.json"),
                    str(tmp_path / "rest.npz"), "5", str(world / "tokenizer")], check=True, env=env, cwd=ROOT)
    rest = np.load(tmp_path / "rest.npz")
    resumed = [{k: rest[f"{i}_{k}"] for k in BATCH_KEYS} for i in range(5)]
    assert same(full[12:], resumed)
    with pytest.raises(ValueError, match="seed"):
        batches(cfg_for(world, seed=9), wtok, state=state)


def test_state_with_carry_roundtrips(world):
    wtok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    it = batches(cfg_for(world), wtok)
    for i in range(1, 30):
        next(it)
        if it.carry is not None:
            break
    assert it.carry is not None
    state = json.loads(json.dumps(it.state()))
    assert same(take(it, 3), take(batches(cfg_for(world), wtok, state=state), 3))


def test_import_does_not_load_tensorflow():
    code = "import sys, selfrag_jax.data, selfrag_jax.data.preview; print(sorted(m for m in ('tensorflow', 'seqio', 'tensorflow_datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# --- data preview ------------------------------------------------------------------------
def cli(*args, env=None):
    """`selfrag-jax data preview ARGS` in this process (a subprocess costs seconds of imports)."""
    import contextlib
    import io
    import types

    from selfrag_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["data", "preview", *args])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_preview_json_goldens(tok, tmp_path):
    folder = tmp_path / "tok"
    tok.save(folder)
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(rec(o)) + "\n" for o in (ONE, TWO)))
    for masking in ("paper", "released"):
        res = cli("--input", str(path), "--tokenizer", str(folder), "--json", "--masking", masking)
        assert res.returncode == 0, res.stderr
        rows = [json.loads(x) for x in res.stdout.splitlines()]
        assert len(rows) == 2
        for row, out in zip(rows, (ONE, TWO)):
            ex = encode_record(rec(out), "generator", tok, MaskConfig(masking))
            assert row["ids"] == ex.tokens.tolist() and row["loss_weights"] == ex.weights.astype(int).tolist()
            assert row["tokens"] == [tok.id_to_token(i) for i in ex.tokens.tolist()]
            assert set(row["loss_weights"]) == {0, 1}
    # golden: paper mode trains both markers, released mode hides the span between the passages
    rows = {m: json.loads(cli("--input", str(path), "--tokenizer", str(folder), "--json", "--masking", m,
                              "-n", "1").stdout.splitlines()[0]) for m in ("paper",)}
    ids, w = expected(tok, T.format_prompt("Where was Alice born?"), [
        ("[Retrieval]", 1), ("<paragraph>", 1), (P1, 0), ("</paragraph>", 1), ("[Relevant]", 1), ("Lurvik", 1),
        ("[Fully supported]", 1), ("[Utility:5]", 1)])
    assert rows["paper"]["ids"] == ids and rows["paper"]["loss_weights"] == [int(x) for x in w]


def test_preview_text_and_errors(tok, tmp_path):
    folder = tmp_path / "tok"
    tok.save(folder)
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(rec("[No Retrieval]Paris[Utility:5]")) + "\n")
    res = cli("--input", str(path), "--tokenizer", str(folder))
    assert res.returncode == 0 and "[[[No Retrieval]Paris[Utility:5]</s>]]" in res.stdout
    assert "\x1b[" not in res.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rec("x")) + "\n" + json.dumps({"instruction": "a"}) + "\n")
    res = cli("--input", str(bad), "--tokenizer", str(folder), "-n", "5")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and f"{bad}:2:" in res.stderr
    res = cli("--input", str(tmp_path / "missing.jsonl"), "--tokenizer", str(folder))
    assert res.returncode == 2 and "no such file" in res.stderr
    res = cli("--input", str(path), "--tokenizer", str(tmp_path / "nowhere"))
    assert res.returncode == 2 and "cannot load tokenizer" in res.stderr


def test_preview_default_tokenizer_is_the_worlds(world, tmp_path):
    res = cli("--input", str(world / "small" / "critic.jsonl"), "--task", "critic", "--json", "-n", "1",
              env={"SELFRAG_JAX_CACHE": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)
    from selfrag_jax.bundled import ASSETS

    wtok = SelfRAGTokenizer.from_pretrained(ASSETS / "generator")  # the shipped models' tokenizer
    first = json.loads((world / "small" / "critic.jsonl").read_text().splitlines()[0])
    first["type"] = "retrieve"
    assert row["ids"] == encode_record(first, "critic", wtok, MaskConfig()).tokens.tolist()
    assert not (tmp_path / "cache").exists()  # nothing built when the models are shipped
