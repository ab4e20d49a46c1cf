"""The trainer: sharded runs equal single-device runs, exact resume after kill -9, NaN stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from selfrag_jax import sharding
from selfrag_jax.models.config import preset
from selfrag_jax.training.config import load_config
from selfrag_jax.training.synthetic import SyntheticData
from selfrag_jax.training.trainer import NonFiniteLoss, Trainer

MODEL = preset("tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)
BASE = ["data.seq_len=32", "global_batch_size=8", "optim.learning_rate=3e-3", "optim.warmup_ratio=0.0",
        "log_every=1", "checkpoint.every=100", "checkpoint.async_save=false", "peak_flops_per_device=1e9"]


def run_steps(tmp_path, name, mesh_spec, steps=3, extra=()):
    cfg = load_config(None, [f"run_dir={tmp_path / name}", *BASE, *extra])
    devices = jax.devices()[: int(np.prod([int(x) for x in mesh_spec.split(",")]))]
    trainer = Trainer(cfg, MODEL, mesh=sharding.make_mesh(mesh_spec, devices))
    data = SyntheticData(MODEL.vocab_size, cfg.data.seq_len, cfg.global_batch_size)
    trainer.fit(data, steps)
    losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return losses, jax.tree.map(np.asarray, trainer.state.params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_steps(tmp_path_factory.mktemp("ref"), "single", "1,1,1")


@pytest.mark.parametrize("mesh_spec", ["8,1,1", "2,4,1", "2,2,2"])
def test_sharded_training_equals_single_device(tmp_path, reference, mesh_spec):
    losses, params = run_steps(tmp_path, "sharded", mesh_spec)
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)  # Adam turns float32 reduction-order noise into ~1e-5


def test_gradient_accumulation_equals_one_big_batch(tmp_path, reference):
    acc, params = run_steps(tmp_path, "acc", "1,1,1", extra=["micro_batch_size=2"])
    np.testing.assert_allclose(acc, reference[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1])):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    one, _ = run_steps(tmp_path, "tok", "1,1,1", steps=1, extra=["loss_averaging=per_token"])
    acc, _ = run_steps(tmp_path, "tok-acc", "1,1,1", steps=1, extra=["loss_averaging=per_token", "micro_batch_size=4"])
    np.testing.assert_allclose(acc, one, rtol=1e-5)
    assert abs(one[0] - reference[0][0]) > 1e-4  # per-token averaging is a different loss


def test_cross_entropy_matches_autodiff_of_log_softmax():
    import jax.numpy as jnp

    from selfrag_jax.training.trainer import cross_entropy

    k = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(k[0], (3, 7, 61)) * 4
    targets = jax.random.randint(k[1], (3, 7), 0, 61)
    weights = jax.random.uniform(k[2], (3, 7))

    def reference(x):
        return jnp.sum(weights * -jnp.take_along_axis(jax.nn.log_softmax(x), targets[..., None], -1)[..., 0])

    def ours(x):
        return jnp.sum(weights * cross_entropy(x, targets))

    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(logits), jax.grad(reference)(logits), atol=1e-6)


def test_loss_falls_on_repeated_data(tmp_path):
    class Repeat(SyntheticData):
        def batch(self, index):
            return super().batch(0)

    cfg = load_config(None, [f"run_dir={tmp_path}", *BASE, "optim.schedule=constant", "optim.learning_rate=1e-2"])
    trainer = Trainer(cfg, MODEL, mesh=sharding.make_mesh("1,1,1", jax.devices()[:1]))
    trainer.fit(Repeat(MODEL.vocab_size, 32, 8), 40)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.5 * losses[0]


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path):
    class Poisoned(SyntheticData):
        def batch(self, index):
            b = super().batch(index)
            if index == 4:
                b["loss_weights"] = b["loss_weights"] * np.nan
            return b

    cfg = load_config(None, [f"run_dir={tmp_path}", *BASE, "checkpoint.every=2", "log_every=3"])
    trainer = Trainer(cfg, MODEL, mesh=sharding.make_mesh("1,1,1", jax.devices()[:1]))
    with pytest.raises(NonFiniteLoss, match=r"at step 5; stopped\. The last good checkpoint is step 4"):
        trainer.fit(Poisoned(MODEL.vocab_size, 32, 8), 10)
    from selfrag_jax.models.checkpoint import complete_steps, load_model

    assert complete_steps(tmp_path / "checkpoints") == [2, 4]
    _, params, _, _ = load_model(tmp_path)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def _train_cmd(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "selfrag_jax", "train", "/dev/null", f"run_dir={run_dir}", "data.task=synthetic",
            f"num_steps={steps}", "checkpoint.every=2", "model.overrides={vocab_size: 128}", "mesh=2,2,2", *BASE[:4],
            "log_every=1", "peak_flops_per_device=1e9"]


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]  # a resumed run's record replaces the killed run's
    return out


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_uninterrupted_losses(tmp_path):
    env = {**os.environ, "SELFRAG_NO_PROGRESS": "1"}
    steps = 10
    subprocess.run(_train_cmd(tmp_path / "full", steps), check=True, env=env, capture_output=True)
    full = _losses_by_step(tmp_path / "full")

    run = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(run, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "4" / "_CHECKPOINT_METADATA").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # A half-written step (what a crash mid-save leaves) must never be taken as valid.
    (run / "checkpoints" / "8").mkdir(parents=True, exist_ok=True)
    (run / "checkpoints" / "8" / "params").mkdir(exist_ok=True)
    result = subprocess.run(_train_cmd(run, steps), env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = _losses_by_step(run)
    for step in range(5, steps + 1):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6), step


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    env = {**os.environ, "SELFRAG_NO_PROGRESS": "1"}
    run = tmp_path / "run"
    cmd = _train_cmd(run, 100000)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]  # saved and stopped, not finished
    from selfrag_jax.models.checkpoint import complete_steps

    last = complete_steps(run / "checkpoints")[-1]
    assert last > 2 and "SIGTERM: saved step" in out + err
    assert max(_losses_by_step(run)) == last


def test_schedule_steps_runs_a_prefix_of_the_longer_schedule():
    """A run of 40 steps with schedule_steps=100 follows the 100-step run's rates and stops."""
    from selfrag_jax.training.trainer import make_schedule

    for kind in ("cosine", "linear", "constant"):
        opts = ["optim.learning_rate=1e-3", "optim.warmup_ratio=0.1", f"optim.schedule={kind}"]
        full = make_schedule(load_config(None, opts), 100)
        prefix = make_schedule(load_config(None, opts + ["optim.schedule_steps=100"]), 40)
        np.testing.assert_allclose([prefix(t) for t in range(40)], [full(t) for t in range(40)])
    cosine = ["optim.learning_rate=1e-3", "optim.schedule=cosine"]
    assert make_schedule(load_config(None, cosine), 40)(39) < 0.01 * make_schedule(load_config(None, cosine), 100)(39)
    with pytest.raises(ValueError, match=r"schedule_steps=30 is shorter than the run \(40 steps\)"):
        make_schedule(load_config(None, ["optim.schedule_steps=30"]), 40)
    with pytest.raises(ValueError, match="schedule_steps=-1 must not be negative"):
        load_config(None, ["optim.schedule_steps=-1"])


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'learning_rate'"):
        load_config(None, ["learning_rate=1"])
    with pytest.raises(ValueError, match=r"config\.optim: unknown key 'lr'"):
        load_config(None, ["optim.lr=1"])
    with pytest.raises(ValueError, match=r"config\.global_batch_size: expected int"):
        load_config(None, ["global_batch_size=many"])
    assert load_config(None, ["optim.learning_rate=1e-5"]).optim.learning_rate == 1e-5
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    cfg = load_config(None, ["mesh=1,3,1", "global_batch_size=8"])
    with pytest.raises(ValueError, match="not divisible by the data x fsdp mesh axes"):
        Trainer(cfg, MODEL, mesh=sharding.make_mesh("1,3,1", jax.devices()[:3]))


def test_mixture_rates_per_critic_type_and_unknown_keys(tmp_path):
    from selfrag_jax.training.main import make_data
    from selfrag_jax.data.critic_prompts import LABELS

    from tests.helpers import make_tokenizer

    from selfrag_jax.tokenizer import SelfRAGTokenizer

    make_tokenizer(tmp_path / "tok")
    tok = SelfRAGTokenizer.from_pretrained(tmp_path / "tok")
    path = tmp_path / "critic.jsonl"
    with open(path, "w") as f:
        for i, kind in enumerate(["retrieve_input", "isrel", "issup", "isuse"] * 5):
            f.write(json.dumps({"instruction": "i", "input": f"x{i}", "output": LABELS[kind][0], "id": str(i),
                                "dataset_name": f"critic_{kind}"}) + "\n")
    cfg = load_config(None, ["data.task=critic", f"data.train_files=[{path}]", "data.seq_len=64",
                             "global_batch_size=4", "data.mixture_rates={isrel: 7.0}"])
    stream, _ = make_data(cfg, tok, MODEL)
    rates = {t.critic_type: t.rate for t in stream.cfg.tasks}
    assert rates == {"retrieve": 1.0, "isrel": 7.0, "issup": 1.0, "isuse": 1.0}
    cfg = load_config(None, ["data.task=critic", f"data.train_files=[{path}]", "data.mixture_rates={isrle: 2}"])
    with pytest.raises(ValueError, match=r"data\.mixture_rates: unknown key\(s\) \['isrle'\]"):
        make_data(cfg, tok, MODEL)
    # pretraining files are weighted by their stem; a stem of no train file is an unknown key
    texts = []
    for name in ("pretrain", "repeat"):
        texts.append(tmp_path / f"{name}.jsonl")
        texts[-1].write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(8)))
    files = f"data.train_files=[{texts[0]}, {texts[1]}]"
    cfg = load_config(None, ["data.task=pretrain", files, "data.seq_len=64", "global_batch_size=4",
                             "data.mixture_rates={repeat: 0.25}"])
    stream, _ = make_data(cfg, tok, MODEL)
    assert [(t.path, t.rate) for t in stream.cfg.tasks] == [(str(texts[0]), 1.0), (str(texts[1]), 0.25)]
    cfg = load_config(None, ["data.task=pretrain", files, "data.mixture_rates={anneal: 2}"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['anneal'\].*train files' stems"):
        make_data(cfg, tok, MODEL)


@pytest.mark.slow
def test_tiny_generator_learns_a_small_selfrag_set(tmp_path):
    """Loss falls by 90% on 16 world examples, and greedy decoding after each example's
    prompt (and passage, when it has one) reproduces its reflection tokens."""
    import jax.numpy as jnp

    from selfrag_jax import tokens as T
    from selfrag_jax.inference.decode import greedy_generate, pad_batch
    from selfrag_jax.tokenizer import SelfRAGTokenizer
    from selfrag_jax.training.main import make_data
    from helpers import build_test_world

    world = tmp_path / "world"
    build_test_world(world)
    records = [json.loads(x) for x in (world / "train" / "generator.jsonl").read_text().splitlines()]
    picked = [r for r in records if "[Continue" not in r["output"] and len(r["output"]) < 500][:16]
    (tmp_path / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in picked))
    tok = SelfRAGTokenizer.from_pretrained(world / "tokenizer")
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "data.task=generator", f"data.train_files=[{tmp_path / 'small.jsonl'}]",
                             "data.seq_len=256", "global_batch_size=8", "optim.learning_rate=3e-3", "optim.warmup_ratio=0.02",
                             "optim.schedule=cosine", "log_every=1", "checkpoint.every=1000", "peak_flops_per_device=1e9"])
    model = preset("tiny", vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2,
                   eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
    trainer = Trainer(cfg, model, tok, mesh=sharding.make_mesh("1,1,1", jax.devices()[:1]))
    data, _ = make_data(cfg, tok, model)
    trainer.fit(data, 160)
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])

    close = tok.control_id(T.PARAGRAPH_CLOSE)
    prompts, expected = [], []
    for r in picked:
        out = tok.encode_structured(r["output"]) + [tok.eos_id]
        cut = out.index(close) + 1 if close in out else 0  # the passage is given, as at inference
        prompts.append(tok.encode_prompt(r["instruction"], r["input"]) + out[:cut])
        expected.append([i for i in out[cut:] if i in tok.control_ids])
    ids, lengths = pad_batch(prompts, tok.pad_id)
    params = jax.tree.map(np.asarray, trainer.state.params)
    out, counts = greedy_generate(params, model, ids, lengths, 48, stop_ids=jnp.array([tok.eos_id]), pad_id=tok.pad_id)
    got = [[i for i in row[:n].tolist() if i in tok.control_ids] for row, n in zip(np.asarray(out), np.asarray(counts))]
    assert sum(g == e for g, e in zip(got, expected)) >= 15, list(zip(got, expected))


def test_restore_onto_a_different_mesh(tmp_path):
    """Two steps on (2,2,2), checkpoint, then the third step on (8,1,1): the losses and
    parameters of three uninterrupted single-device steps (constant rate, so the schedule
    does not depend on the planned length)."""
    const = ["checkpoint.every=2", "optim.schedule=constant"]
    ref_losses, ref_params = run_steps(tmp_path, "ref", "1,1,1", steps=3, extra=const)
    run_steps(tmp_path, "resume", "2,2,2", steps=2, extra=const)
    losses, params = run_steps(tmp_path, "resume", "8,1,1", steps=3, extra=const)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # metrics.jsonl holds steps 1-2, then 3
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_init_from_hf_llama_adds_reflection_rows(tmp_path):
    from helpers import make_hf_llama

    from selfrag_jax.training.trainer import build_model

    folder = make_hf_llama(tmp_path / "hf", tokenizer=True, vocab_size=300)
    cfg = load_config(None, [f"model.init_from={folder}", "model.new_token_init=normal"])
    model_config, params, tok = build_model(cfg)
    assert model_config.vocab_size == len(tok) == 316
    assert tok.control_id("[Retrieval]") == 301 and params["embedding"].shape[0] == 316


def test_smollm2_generator_config_is_the_papers_masking_from_a_real_base():
    from selfrag_jax.training.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "smollm2" / "generator.yaml")
    assert cfg.model.init_from == "runs/smollm2/base" and cfg.model.new_token_init == "mean"
    assert cfg.data.task == "generator" and cfg.data.masking == "paper" and cfg.loss_averaging == "per_sequence"
    assert cfg.optim.embedding_lr_scale == 10.0 and cfg.epochs == 3  # what the measured run used


def test_embedding_lr_scale_moves_only_the_embedding_faster():
    import jax.numpy as jnp

    from selfrag_jax.training.config import load_config
    from selfrag_jax.training.trainer import make_optimizer

    def updates(scale):
        cfg = load_config(None, [f"optim.embedding_lr_scale={scale}", "optim.schedule=constant", "optim.warmup_ratio=0",
                                 "optim.learning_rate=0.01", "run_dir=unused"])
        params = {"embedding": jnp.ones((3, 2)), "layers": {"wq": jnp.ones((2, 2))}, "lm_head": jnp.ones((2, 3))}
        tx = make_optimizer(cfg, 10)
        grads = {"embedding": jnp.full((3, 2), 0.5), "layers": {"wq": jnp.full((2, 2), 0.5)}, "lm_head": jnp.full((2, 3), 0.5)}
        return tx.update(grads, tx.init(params), params)[0]

    plain, fast = updates(1.0), updates(10.0)
    np.testing.assert_allclose(fast["layers"]["wq"], plain["layers"]["wq"])
    np.testing.assert_allclose(fast["embedding"], 10 * plain["embedding"], rtol=1e-6)
    np.testing.assert_allclose(fast["lm_head"], 10 * plain["lm_head"], rtol=1e-6)
