"""bench/probe_copy.py: its rows ask exactly what it says (w follows v in the passage, the
loss on w alone), and both of its models start at the uniform loss it plots as ln V.
bench/induction_curve.py: the induction probe at every checkpoint of a run."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from bench.probe_copy import BOS, FIRST, SEP, copy_batch, llama_model, reference_model
from selfrag_jax.training.trainer import cross_entropy


def test_copy_rows_ask_for_the_token_after_v():
    tokens, weights = copy_batch(np.random.default_rng(0), vocab=50, passage=6, rows=4, length=40)
    for row, w in zip(tokens, weights):
        passage = list(row[1:7])
        assert row[0] == BOS and len(set(passage)) == 6 and min(passage) >= FIRST
        targets = np.flatnonzero(w)
        assert len(targets) == (40 - 7) // 3 and set(w[w > 0]) == {1.0}
        for t in targets:
            assert row[t - 2] == SEP and passage.index(row[t]) == passage.index(row[t - 1]) + 1
        assert not row[7 + 3 * len(targets):].any()  # the rest is padding, never a target


def test_both_models_start_uniform():
    tokens, weights = copy_batch(np.random.default_rng(1), vocab=100, passage=5, rows=16, length=32)
    for params, apply in (llama_model(100)[:2], reference_model(100, 32, layers=1)):
        logits = apply(params, jnp.asarray(tokens[:, :-1]))
        assert logits.shape == (16, 31, 100)
        nll = float(jnp.sum(cross_entropy(logits, tokens[:, 1:]) * weights[:, 1:]) / weights[:, 1:].sum())
        assert abs(nll - math.log(100)) < 0.1


def test_first_steps_ask_with_the_curriculum_passage():
    import argparse

    import optax

    from bench.probe_copy import train

    args = argparse.Namespace(vocab=30, rows=2, length=24, steps=4, every=1, seed=0, first=(3, 2))
    lines = []
    params, apply = reference_model(30, 24, width=16, layers=1, heads=2)
    curve = train("reference", params, apply, optax.adamw(1e-3), args, passage=8, log=lines.append)
    assert [c[0] for c in curve] == [0, 1, 2, 3, 4]
    assert [line.split()[1] for line in lines] == ["P=3]", "P=3]", "P=8]", "P=8]"]


def test_induction_curve_walks_a_runs_checkpoints(tmp_path):
    """bench/induction_curve.py: one point per kept checkpoint, in step order, both probe forms,
    a results file with its summary row, and a plot; a folder without checkpoints is named."""
    import json

    import pytest

    from bench.induction_curve import main
    from selfrag_jax.bundled import ASSETS

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (200, 100):  # the exported critic stands in for two checkpoints
        (run / "checkpoints" / str(step)).symlink_to(ASSETS / "critic", target_is_directory=True)
    result = main([f"{run}=shipped critic", "--rows", "3", "--length", "8", "--results", str(tmp_path)])
    points = result["curves"]["shipped critic"]
    assert [p["step"] for p in points] == [100, 200] and points[0] == {**points[1], "step": 100}
    assert all(0 <= p["words"] <= 1 and 0 <= p["glued"] <= 1 for p in points)
    saved = json.loads((tmp_path / "induction_curve.json").read_text())
    assert saved["summary"][0]["what"].startswith("induction probe, shipped critic")
    assert (tmp_path / "induction_curve.png").stat().st_size > 1000
    with pytest.raises(FileNotFoundError, match="no checkpoints/ folder"):
        main([str(tmp_path / "nothing")])
