"""One XLA CPU device against two (`distributed.split_host_cpu`), in the same run: the embedded
default's base-model train step (1.2M parameters, batch 32 x 256, data-parallel mesh
"-1,1,1", the configs' own) and a greedy forward on device 0 (what annotation, the probes
and the demo's evaluation run, which the second device must not slow down).

Each count runs in its own process (XLA_FLAGS is read once, at backend start-up), one after
the other, never side by side: both time the same cores.

    python -m bench.bench_host_devices [--steps 40] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import machine_info, now, versions, write_result

FLAG = "--xla_force_host_platform_device_count"


def measure(steps: int, small: bool) -> dict:
    """Runs inside the child: median train-step and forward times on this process's devices."""
    import jax
    import jax.numpy as jnp

    from selfrag_jax.models.config import preset
    from selfrag_jax.models.llama import Llama
    from selfrag_jax.training.config import load_config
    from selfrag_jax.training.synthetic import SyntheticData
    from selfrag_jax.training.trainer import Trainer, make_optimizer, make_schedule

    # configs/default/base.yaml's model on the bundled world's vocabulary size
    config = preset("tiny", vocab_size=3016, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, head_dim=16,
                    num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=512, scan_layers=False)
    batch, seq = (8, 64) if small else (32, 256)
    cfg = load_config(None, [f"global_batch_size={batch}", f"data.seq_len={seq}", "loss_averaging=per_token",
                             "mesh=-1,1,1", "run_dir=/tmp/bench-host-devices"])
    trainer = Trainer(cfg, config)
    tx = make_optimizer(cfg, 1000)
    state = trainer.create_state(tx)
    step = trainer.jit_train_step(tx, make_schedule(cfg, 1000), trainer.state_shardings)  # what `fit` runs
    data = SyntheticData(config.vocab_size, seq, batch)
    times = []
    with jax.set_mesh(trainer.mesh):
        for i in range(steps + 1):
            b = trainer.global_batch(data.batch(i))
            t = time.perf_counter()
            state, m = step(state, b)
            jax.block_until_ready(m["loss"])
            times.append(time.perf_counter() - t)
    params = jax.device_put(jax.device_get(state.params), jax.devices()[0])
    model = Llama(config)
    forward = jax.jit(lambda p, ids: model.apply({"params": p}, ids)[0].argmax(-1))
    ids = jnp.asarray(data.batch(0)["inputs"][: min(batch, 50)], device=jax.devices()[0])
    forward(params, ids).block_until_ready()
    fwd = []
    for _ in range(max(5, steps // 4)):
        t = time.perf_counter()
        forward(params, ids).block_until_ready()
        fwd.append(time.perf_counter() - t)
    step_s = statistics.median(times[1:])
    return {"devices": jax.device_count(), "mesh": dict(trainer.mesh.shape), "step_s": step_s,
            "tokens_per_s": batch * seq / step_s, "forward_s": statistics.median(fwd), "loss": float(m["loss"])}


def child(devices: int, steps: int, small: bool) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FLAG)]
                                  + [f"{FLAG}={devices}"]))
    code = f"import json; from bench.bench_host_devices import measure; print(json.dumps(measure({steps}, {small})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed train steps per device count [40]")
    parser.add_argument("--small", action="store_true", help="batch 8 x 64: a quick correctness run")
    args = parser.parse_args(argv)
    runs = {}
    for devices in (1, 2):
        runs[devices] = child(devices, args.steps, args.small)
        print(f"{devices} host device(s): {runs[devices]['tokens_per_s']:,.0f} tok/s train, "
              f"forward {runs[devices]['forward_s'] * 1e3:.1f} ms", flush=True)
    one, two = runs[1], runs[2]
    result = {"date": now(), "machine": machine_info(), "versions": versions("flax", "optax"), "steps": args.steps,
              "small": args.small, "runs": {str(k): v for k, v in runs.items()},
              "summary": [
                  {"what": "default base train step, 2 host devices vs 1", "ours": f"{two['tokens_per_s']:,.0f} tok/s",
                   "peer": f"{one['tokens_per_s']:,.0f} tok/s", "ratio": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                   "goal": "ratio > 1", "met": two["tokens_per_s"] > one["tokens_per_s"]},
                  {"what": "forward on device 0 beside a second host device", "ours": f"{two['forward_s'] * 1e3:.1f} ms",
                   "peer": f"{one['forward_s'] * 1e3:.1f} ms", "ratio": round(one["forward_s"] / two["forward_s"], 3),
                   "goal": "ratio >= 0.95", "met": one["forward_s"] / two["forward_s"] >= 0.95}]}
    write_result("host_devices_small" if args.small else "host_devices", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
