"""Train step of the 125M Llama shape (or a real model's, `--model`): ours (jitted, sharded
trainer step) against a PyTorch step of transformers' LlamaForCausalLM with AdamW, identical
shapes and weights, in the same run.

Reports tokens/s of both, their ratio, and MFU of ours against the float32 matmul peak that
JAX and numpy reach in this run (FLOPs counted analytically, as MaxText does:
`cost_analysis()` undercounts scanned layers).

    python -m bench.bench_train [--small] [--steps 3]
    python -m bench.bench_train --model FILE.gguf            # a real model: its weights on both sides
    python -m bench.bench_train --accelerator [--out FILE]   # on a GPU: both sides on it

On an accelerator both sides compute in bfloat16 with float32 master weights (JAX: the
model's `dtype`; PyTorch: autocast) on a larger batch, and MFU is against the bfloat16
matmul rate JAX reaches in the run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import machine_info, now, versions, write_result


def numpy_matmul_peak(n: int = 2048, repeats: int = 3) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_ours(config, batch: int, seq: int, steps: int, peak_dtype: str = "float32", params=None) -> dict:
    import jax
    import jax.numpy as jnp

    from selfrag_jax import sharding
    from selfrag_jax.training.config import load_config
    from selfrag_jax.training.synthetic import SyntheticData
    from selfrag_jax.training.trainer import Trainer, make_optimizer, make_schedule, make_train_step

    cfg = load_config(None, [f"global_batch_size={batch}", f"data.seq_len={seq}", "optim.learning_rate=1e-4",
                             "loss_averaging=per_token", "run_dir=/tmp/bench-train"])
    trainer = Trainer(cfg, config, mesh=sharding.make_mesh("1,1,1", jax.devices()[:1]), init_params=params)
    tx = make_optimizer(cfg, 1000)
    state = trainer.create_state(tx)
    step = jax.jit(make_train_step(cfg, config, tx, make_schedule(cfg, 1000), trainer.rules),
                   in_shardings=(trainer.state_shardings, trainer.batch_sharding),
                   out_shardings=(trainer.state_shardings, None), donate_argnums=(0,))
    data = SyntheticData(config.vocab_size, seq, batch)
    batches = [trainer.global_batch(data.batch(i)) for i in range(steps + 1)]
    t = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        state, m = step(state, batches[0])
        jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t
    times = []
    for b in batches[1:]:
        t = time.perf_counter()
        with jax.set_mesh(trainer.mesh):
            state, m = step(state, b)
            jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    return {"first_step_s": compile_s, "step_s": statistics.median(times), "times": times,
            "loss": float(m["loss"]), "jax_matmul_peak": _jax_peak(peak_dtype)}


def _jax_peak(dtype: str) -> float:
    import jax

    from selfrag_jax.training.trainer import measure_matmul_peak

    n = 2048 if jax.default_backend() == "cpu" else 8192
    return measure_matmul_peak(n, 3 if n == 2048 else 10, dtype=dtype)


def bench_torch(config, batch: int, seq: int, steps: int, device: str = "cpu", hf_dir=None) -> dict:
    import contextlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfrag_jax.models.config import to_hf_dict

    if device == "cpu":
        torch.set_num_threads(2)
        torch.set_flush_denormal(True)
    hf = {k: v for k, v in to_hf_dict(config).items() if k not in ("architectures", "model_type", "dtype")}
    model = (LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32) if hf_dir else
             LlamaForCausalLM(LlamaConfig(**hf))).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    rng = np.random.default_rng(0)
    times = []
    for i in range(steps + 1):
        ids = torch.tensor(rng.integers(3, config.vocab_size, (batch, seq)), device=device)
        t = time.perf_counter()
        with autocast():
            out = model(input_ids=ids, labels=ids)  # transformers shifts the labels itself
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times), "times": times, "loss": float(out.loss.detach())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: a quick correctness run")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first [3]")
    parser.add_argument("--accelerator", action="store_true",
                        help="JAX's default device and PyTorch on CUDA, bfloat16 compute, batch 32")
    parser.add_argument("--out", help="results file [bench/results/train.json, train_gpu.json, train_small.json]")
    parser.add_argument("--model", help="a real model (checkpoint, HF folder or GGUF file): its shape and weights, "
                                        "batch 4 x 512 [the 125M random shape]")
    args = parser.parse_args(argv)
    import jax

    from selfrag_jax.models.config import preset

    if not args.accelerator:
        jax.config.update("jax_default_matmul_precision", "highest")
    params, model_name = None, "tiny" if args.small else "llama-125m"
    if args.model:
        from selfrag_jax.models.checkpoint import load_model

        config, params, _, _ = load_model(args.model, dtype="bfloat16" if args.accelerator else None)
        batch, seq = (32 if args.accelerator else 4), min(512, config.max_position_embeddings)
        model_name = Path(args.model).stem.split(".")[0].lower()
    elif args.small:
        config, batch, seq = preset("tiny", vocab_size=512), 2, 64
    elif args.accelerator:
        config, batch, seq = preset("llama-125m", scan_layers=False, dtype="bfloat16"), 32, 512
    else:
        config, batch, seq = preset("llama-125m", scan_layers=False), 4, 512
    precision = "bfloat16" if args.accelerator else "float32"
    tokens = batch * seq
    flops = config.flops_per_token(seq) * tokens
    ours = bench_ours(config, batch, seq, args.steps, peak_dtype=precision, params=params)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = None
        if params is not None:  # the same weights on the PyTorch side
            from selfrag_jax.models.hf import export_hf

            hf_dir = Path(tmp) / "hf"
            export_hf(params, config, hf_dir)
        peer = bench_torch(config, batch, seq, args.steps, device="cuda" if args.accelerator else "cpu", hf_dir=hf_dir)
    peak = ours["jax_matmul_peak"] if args.accelerator else max(ours["jax_matmul_peak"], numpy_matmul_peak())
    ours_tps, peer_tps = tokens / ours["step_s"], tokens / peer["step_s"]
    result = {
        "benchmark": "train_step", "date": now(), "machine": machine_info(), "versions": versions("torch", "flax",
                                                                                                "transformers"),
        "shape": {"model": model_name, "weights": "real" if params is not None else "random", "batch": batch, "seq_len": seq,
                  "params": config.num_params(), "compute": precision},
        "ours": {**ours, "tokens_per_s": ours_tps, "mfu": flops / ours["step_s"] / peak},
        "pytorch": {**peer, "tokens_per_s": peer_tps, "mfu": flops / peer["step_s"] / peak},
        "matmul_peak_flops": peak, "flops_per_step": flops,
        "summary": [
            {"what": f"train step, {model_name} Llama, {batch}x{seq} tokens, {precision}"
                     + (f" on {jax.devices()[0].device_kind}" if args.accelerator else ""),
             "ours": f"{ours_tps:,.0f} tok/s", "peer": f"PyTorch {peer_tps:,.0f} tok/s",
             "ratio": ours_tps / peer_tps, "goal": "ratio >= 0.8", "met": ours_tps / peer_tps >= 0.8},
            {"what": f"train step MFU ({precision} matmul peak measured in the run)",
             "ours": f"{flops / ours['step_s'] / peak:.1%}", "peer": f"PyTorch {flops / peer['step_s'] / peak:.1%}",
             "ratio": None, "goal": "MFU >= 50%", "met": flops / ours["step_s"] / peak >= 0.5},
        ],
    }
    name = "train_small" if args.small else "train_gpu" if args.accelerator else "train"
    name += f"_{model_name}" if args.model else ""
    path = write_result(name, result, args.out)
    print(f"ours {ours_tps:,.0f} tok/s, PyTorch {peer_tps:,.0f} tok/s, ratio {ours_tps / peer_tps:.2f}, "
          f"MFU {result['ours']['mfu']:.1%} (peak {peak / 1e9:.0f} GFLOP/s) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
