"""One GPU, five minutes: is this machine's accelerator doing what it should?

`python bench/gpu_check.py [--small] [--out bench/results/gpu_check.json]` reports
1. train-step MFU of the trainer's own jitted step (`Trainer.jit_train_step`) for the
   llama-1b preset at bfloat16 compute on synthetic batches (MaxText's FLOP count);
2. decode tokens/s of the Self-RAG engine's segment step (`Engine.decode`, K candidate rows per
   question, bfloat16 weights and KV cache) and its share of the memory-bandwidth roofline:
   bytes of weights + KV cache read per step / HBM bandwidth;
3. logits parity: the same small random float32 model on the CPU and on the accelerator
   (max abs difference at "highest" matmul precision).
It imports only jax, flax, optax, numpy and selfrag_jax's model, trainer and decoder (the
GPU image has no TensorFlow, seqio or ScaNN, and no network). `--small` shrinks everything
so the script runs on a CPU in seconds (that is how it is tested).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

from selfrag_jax.models.config import SELFRAG_VOCAB, preset  # noqa: E402
from selfrag_jax.models.llama import Llama, init_params  # noqa: E402
from selfrag_jax.chips import chip_of  # noqa: E402
from selfrag_jax.data.pack import BATCH_KEYS  # noqa: E402
from selfrag_jax.sharding import make_mesh  # noqa: E402
from selfrag_jax.training.config import load_config  # noqa: E402
from selfrag_jax.training.synthetic import SyntheticData  # noqa: E402
from selfrag_jax.training.trainer import Trainer, make_optimizer, make_schedule, measure_matmul_peak  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "gpu_check.json"


@dataclass(frozen=True)
class Sizes:
    """What each check runs at: the real sizes, or `--small` ones for a CPU."""

    model: str
    batch: int
    seq_len: int
    train_steps: int
    decode_batch: int  # candidate rows: questions x ndocs
    ndocs: int
    prompt_len: int
    new_tokens: int


FULL = Sizes("llama-1b", batch=8, seq_len=2048, train_steps=10, decode_batch=160, ndocs=5, prompt_len=128,
             new_tokens=256)
SMALL = Sizes("tiny", batch=4, seq_len=64, train_steps=3, decode_batch=6, ndocs=3, prompt_len=8, new_tokens=16)


def accelerator() -> tuple[jax.Device, float, float]:
    """(device, dense bf16 peak FLOP/s, HBM bytes/s); on a CPU the measured float32 matmul
    rate and no bandwidth figure."""
    device = jax.devices()[0]
    chip = chip_of(device.device_kind)
    peak, bandwidth = (chip.peak_flops, chip.hbm_bandwidth) if chip else (0.0, 0.0)
    if device.platform == "cpu":
        peak = measure_matmul_peak()
    return device, peak, bandwidth


def timed(fn, *args, repeats: int = 1):
    """Best wall time of `fn(*args)` after one warm-up call (which compiles)."""
    out = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best, out


def check_train(s: Sizes, peak: float) -> dict:
    """Steps/s of the trainer's jitted step, as MFU of the device's peak."""
    overrides = [f"model.preset={s.model}", "model.overrides={dtype: bfloat16, remat_policy: full}",
                 f"data.seq_len={s.seq_len}", f"global_batch_size={s.batch}", "mesh=1,-1,1", "run_dir=/tmp/gpu_check"]
    cfg = load_config(None, overrides)
    model_config = preset(s.model, dtype="bfloat16", remat_policy="full")
    trainer = Trainer(cfg, model_config, mesh=make_mesh("1,1,1", jax.devices()[:1]))
    tx, schedule = make_optimizer(cfg, 1000), make_schedule(cfg, 1000)
    state = trainer.create_state(tx)
    step = trainer.jit_train_step(tx, schedule, trainer.state_shardings)
    data = iter(SyntheticData(model_config.vocab_size, s.seq_len, s.batch))
    batches = [trainer.global_batch({k: b[k] for k in BATCH_KEYS}) for b in (next(data), next(data))]
    with jax.set_mesh(trainer.mesh):
        start = time.perf_counter()
        state, metrics = step(state, batches[0])
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(s.train_steps):
            state, metrics = step(state, batches[i % 2])
        loss = float(metrics["loss"])
        elapsed = time.perf_counter() - start
    tokens = s.batch * s.seq_len
    flops = model_config.flops_per_token(s.seq_len) * tokens
    step_s = elapsed / s.train_steps
    return {"model": s.model, "params": model_config.num_params(), "batch": s.batch, "seq_len": s.seq_len,
            "steps": s.train_steps, "first_step_s": round(compile_s, 2), "step_s": step_s,
            "tokens_per_s": tokens / step_s, "model_flops_per_step": flops, "mfu": flops / step_s / peak,
            "final_loss": loss, "finite": bool(np.isfinite(loss))}


def check_decode(s: Sizes, bandwidth: float) -> dict:
    """The engine's segment step (`Engine.decode`: K candidate rows per question) with
    bfloat16 weights and KV cache. The suffix prefill is timed apart (a one-token budget) and
    subtracted; per step the weights and every row's cache are read once."""
    from selfrag_jax.inference.engine import ControlIds, Engine

    # The released vocabulary, so that a random model rarely emits one of its boundary ids.
    config = preset(s.model, dtype="bfloat16", param_dtype="bfloat16", vocab_size=SELFRAG_VOCAB)
    v = config.vocab_size
    ids = ControlIds.appended(v)
    params = init_params(config, 0)
    rng = np.random.default_rng(0)
    questions = max(1, s.decode_batch // s.ndocs)
    prompts = rng.integers(3, v - 16, (questions, s.prompt_len)).tolist()
    src = [q for q in range(questions) for _ in range(s.ndocs)]
    suffixes = rng.integers(3, v - 16, (len(src), s.prompt_len)).tolist()
    engines = {n: Engine(params, config, ids, n) for n in (1, s.new_tokens)}
    state = engines[1].prefill(prompts)

    def run(n):
        return engines[n].decode(state, src, suffixes)

    prefill_s, _ = timed(lambda: run(1), repeats=2)
    total_s, seg = timed(lambda: run(s.new_tokens), repeats=2)
    steps = s.new_tokens - 1
    decode_s = max(total_s - prefill_s, 1e-9)
    rows = engines[1].bucket_rows(len(src))
    c = config
    weights = 2 * c.num_params()
    width = state.cache.max_len + len(suffixes[0]) + s.new_tokens  # every step attends over the full width
    cache = 2 * 2 * c.num_layers * rows * c.num_kv_heads * width * c.head_dim
    roofline_step = (weights + cache) / bandwidth if bandwidth else 0.0
    return {"model": s.model, "questions": questions, "ndocs": s.ndocs, "rows": len(src), "prompt_len": s.prompt_len,
            "new_tokens": s.new_tokens, "prefill_s": prefill_s, "decode_s": decode_s,
            "tokens_per_s": len(src) * steps / decode_s, "step_ms": 1e3 * decode_s / steps,
            "bytes_per_step": weights + cache, "hbm_bandwidth": bandwidth or None,
            "roofline_share": roofline_step / (decode_s / steps) if bandwidth else None,
            "all_rows_full": bool(np.all(seg.counts == s.new_tokens))}


def check_parity(device: jax.Device) -> dict:
    """The same small random float32 model on the CPU and on `device`: max |logits diff|."""
    config = preset("tiny", vocab_size=256)
    cpu = jax.devices("cpu")[0]
    host_params = jax.tree.map(np.asarray, jax.device_get(init_params(config, 0)))
    tokens = np.random.default_rng(1).integers(3, config.vocab_size, (4, 48)).astype(np.int32)
    model = Llama(config)
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t)[0])
    with jax.default_matmul_precision("highest"):
        on = {d.platform: np.asarray(apply(jax.device_put(host_params, d), jax.device_put(tokens, d)))
              for d in (cpu, device)}
    ref = on["cpu"]
    diff = float(np.max(np.abs(on[device.platform] - ref)))
    return {"model": "tiny", "devices": [cpu.platform, device.platform], "max_abs_diff": diff,
            "logits_scale": float(np.max(np.abs(ref))), "ok": diff < 1e-3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (runs on a CPU in seconds)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"JSON report [{OUT}]")
    args = parser.parse_args(argv)
    sizes = SMALL if args.small else FULL
    started = time.perf_counter()
    device, peak, bandwidth = accelerator()
    print(f"device: {device.device_kind} ({device.platform}), peak {peak / 1e12:.3g} TFLOP/s, "
          f"HBM {bandwidth / 1e12:.2f} TB/s", flush=True)
    report = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "python": platform.python_version(), "sizes": asdict(sizes), "peak_flops": peak}
    report["train"] = check_train(sizes, peak)
    print(f"train: {report['train']['tokens_per_s']:.0f} tokens/s, MFU {report['train']['mfu']:.1%}", flush=True)
    report["decode"] = check_decode(sizes, bandwidth)
    d = report["decode"]
    share = f", {d['roofline_share']:.0%} of the bandwidth roofline" if d["roofline_share"] is not None else ""
    print(f"decode: {d['tokens_per_s']:.0f} tokens/s ({d['step_ms']:.2f} ms per step{share})", flush=True)
    report["parity"] = check_parity(device)
    print(f"parity: max |logits diff| {report['parity']['max_abs_diff']:.2e} ({report['parity']['devices']})")
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({report['seconds']} s)")
    return 0 if report["parity"]["ok"] and report["train"]["finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
