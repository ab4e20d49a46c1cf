"""Two processes joined by jax.distributed train exactly like one process with all devices.

Each process has 4 virtual CPU devices; together they form the same 8-device mesh as the
single-process reference. Each feeds only its own rows of the global batch (SyntheticData
takes host / num_hosts), and Orbax writes one checkpoint for both.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 3
ARGS = ["data.task=synthetic", f"num_steps={STEPS}", "model.preset=tiny", "model.overrides={vocab_size: 128}",
        "data.seq_len=32", "global_batch_size=8", "optim.learning_rate=3e-3", "optim.warmup_ratio=0.0",
        "log_every=1", "checkpoint.every=100", "checkpoint.async_save=false", "peak_flops_per_device=1e9",
        "mesh=2,4,1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               SELFRAG_NO_PROGRESS="1", **extra)
    return env


# The single-process reference: the same trainer and config on 8 devices, fed the global
# batch that the two hosts assemble (host 0's rows, then host 1's).
REFERENCE = """
import sys
import numpy as np
from selfrag_jax.training.config import load_config
from selfrag_jax.training.synthetic import SyntheticData
from selfrag_jax.training.trainer import Trainer, build_model

class BothHosts(SyntheticData):
    def batch(self, index):
        parts = [SyntheticData(self.vocab, self.seq_len, self.rows, self.seed, h, 2).batch(index) for h in (0, 1)]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

cfg = load_config(None, sys.argv[1:])
model_config, _, _ = build_model(cfg)
data = BothHosts(model_config.vocab_size, cfg.data.seq_len, cfg.global_batch_size, cfg.data.seed)
Trainer(cfg, model_config).fit(data, cfg.num_steps)
"""


def run_two_and_one(commands: list[list[str]], reference: list[str]) -> None:
    """Two processes (4 devices each) joined by jax.distributed, beside one process with 8,
    all at once; each must exit 0."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i, cmd in enumerate(commands)]
    procs.append(subprocess.Popen(reference, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(8)))
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]


def _train(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "selfrag_jax", "train", "/dev/null", f"run_dir={run_dir}", *ARGS]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(tmp_path):
    multi = tmp_path / "multi"
    run_two_and_one([_train(multi)] * 2, [sys.executable, "-c", REFERENCE, f"run_dir={tmp_path / 'single'}", *ARGS])

    reference = _losses(tmp_path / "single")
    assert len(reference) == STEPS
    assert _losses(multi) == pytest.approx(reference, rel=1e-5)
    # Only process 0 logs; the checkpoint of the last step is written once, complete.
    assert len(_losses(multi)) == STEPS
    step_dir = multi / "checkpoints" / str(STEPS)
    assert (step_dir / "_CHECKPOINT_METADATA").exists()
    assert sorted(p.name for p in (multi / "checkpoints").iterdir() if p.name.isdigit()) == [str(STEPS)]


def test_generate_over_two_processes_is_the_single_process_output(tmp_path):
    """`generate` on 2 processes x 4 devices (one SPMD program over a 2,1,4 mesh) writes what
    one process with 8 devices writes, and only process 0 writes."""
    import numpy as np
    from test_engine_sharded import SHAPE, split
    from test_inference import make_items, make_selfrag_model

    model = make_selfrag_model(tmp_path / "model", base_vocab=304, **SHAPE)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(it.record) + "\n" for it in make_items(6, seed=11)))

    def generate(out: Path) -> list[str]:
        return [sys.executable, "-m", "selfrag_jax", "generate", "--model", str(model), "--input", str(inputs),
                "--output", str(out), "--mesh", "2,1,4", "--mode", "always", "--max-new-tokens", "8",
                "--batch-size", "4", "--trace"]

    outs = [tmp_path / "multi0.jsonl", tmp_path / "multi1.jsonl", tmp_path / "single.jsonl"]
    run_two_and_one([generate(outs[0]), generate(outs[1])], generate(outs[2]))
    single = [json.loads(line) for line in outs[2].read_text().splitlines()]
    assert len(single) == 6 and all(r["candidates"] for r in single)
    multi = [json.loads(line) for line in outs[0].read_text().splitlines()]
    want_floats, got_floats = [], []
    assert split(multi, got_floats) == split(single, want_floats)  # tokens, decisions, passages
    np.testing.assert_allclose(got_floats, want_floats, rtol=0, atol=1e-5)  # cross-process sums
    assert not outs[1].exists() and not Path(f"{outs[1]}.report.json").exists()
