"""Short-form Self-RAG decoding: our engine against the released algorithm in PyTorch.

`python -m bench.bench_decode [--small]` -> bench/results/decode[_small].json
`python -m bench.bench_decode --accelerator` -> decode_gpu.json: JAX's default device and
PyTorch on CUDA, both with bfloat16 weights (the float32 CPU run is the default);
`--preset selfrag-7b` runs the released size (random weights) instead of the 125M shape;
`--model PATH` a real model (e.g. SmolLM2-135M-Instruct's GGUF: decode_smollm2-135m-instruct.json).
The results file is rewritten after each part, so a run cut short keeps what it measured.

Workload (default): 32 questions x 5 passages of ~150 tokens, up to 64 new tokens, the
125M Llama shape with random weights (so rows rarely stop early: the worst case).
- ours: `Engine` with mode always: one prefill of all prompts (the retrieve decision comes
  from its softmax), then one compiled segment step over all 160 candidate rows.
- reference: the released algorithm written with transformers' PyTorch `generate` on the
  same weights (exported with `export_hf`): per question a no-retrieval decode (which is how
  the release reads the retrieve-token probabilities), then its K passages batched, with the
  critique scores read from `output_scores` on the host.
Also reported: ours against decoding candidate rows one at a time, the share of the
float32 matmul peak (measured in the same run) that the required FLOPs reach, and how
time grows with K. Random ids stand in for text: the engine only sees ids.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import write_result



@dataclass(frozen=True)
class Workload:
    preset: str
    questions: int
    k: int
    prompt_tokens: tuple[int, int]  # min, max
    passage_tokens: int
    new_tokens: int
    k_sweep: tuple[int, ...]
    one_at_a_time_rows: int


FULL = Workload("llama-125m", 32, 5, (40, 90), 150, 64, (1, 2, 5, 10, 20), 10)
SMALL = Workload("tiny", 4, 3, (10, 20), 20, 8, (1, 2, 3), 3)


def make_inputs(w: Workload, vocab: int, k: int, seed: int = 0):
    """Prompts and, per question, k passage suffixes `[Retrieval]<paragraph>...</paragraph>`."""
    rng = np.random.default_rng(seed)
    b = vocab - 16
    prompts = [[1] + rng.integers(3, b, rng.integers(*w.prompt_tokens)).tolist() for _ in range(w.questions)]
    passages = [[[b + 1, b + 5] + rng.integers(3, b, w.passage_tokens - 3).tolist() + [b + 6] for _ in range(k)]
                for _ in range(w.questions)]
    return prompts, passages


def run_ours(engine, prompts, passages):
    state = engine.prefill(prompts)
    src = [q for q, ps in enumerate(passages) for _ in ps]
    return engine.decode(state, src, [p for ps in passages for p in ps])


def run_reference(model, ids, prompts, passages, new_tokens: int):
    """The released short-form algorithm: no-retrieval pass, then the K passages batched."""
    import torch

    stop = list(ids.boundary)
    dev = model.device
    for prompt, psgs in zip(prompts, passages):
        with torch.no_grad():
            first = model.generate(torch.tensor([prompt + [ids.retrieve[0]]], device=dev), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=stop, pad_token_id=ids.pad,
                                   output_scores=True, return_dict_in_generate=True)
            _ = torch.log_softmax(first.scores[0][0], -1)[list(ids.retrieve)]
            rows = [prompt + p for p in psgs]
            width = max(map(len, rows))
            tokens = torch.tensor([[ids.pad] * (width - len(r)) + r for r in rows], device=dev)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=dev)
            out = model.generate(tokens, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=stop, pad_token_id=ids.pad, output_scores=True,
                                 return_dict_in_generate=True)
            reference_scores(out, ids, width)
        if dev.type == "cuda":
            torch.cuda.synchronize()


def reference_scores(out, ids, width):
    """seq / rel / sup / use from the per-step scores, as the release does on the host."""
    import torch

    logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)  # [rows, steps, vocab]
    gen = out.sequences[:, width:]
    tok_lp = logp.gather(-1, gen[:, :, None])[..., 0]
    seq = tok_lp.mean(-1)
    probs = logp[:, 0].exp()
    rel = probs[:, ids.isrel[1]] / probs[:, list(ids.isrel)].sum(-1)
    is_sup = torch.isin(gen, torch.tensor(ids.issup, device=gen.device))
    is_use = torch.isin(gen, torch.tensor(ids.isuse, device=gen.device))
    return seq, rel, is_sup.any(-1), is_use.any(-1)


def matmul_peak(n: int, accelerator: bool = False) -> dict[str, float]:
    """n^3 matmul GFLOP/s, best of 3: float32 with numpy (MKL/OpenBLAS) and JAX on a CPU,
    bfloat16 with JAX on an accelerator."""
    import jax
    import jax.numpy as jnp

    from selfrag_jax.training.trainer import measure_matmul_peak

    out = {"jax": measure_matmul_peak(n, 3, jnp.bfloat16 if accelerator else jnp.float32) / 1e9}
    if not accelerator:
        a = np.random.default_rng(0).standard_normal((n, n), np.float32)
        a @ a
        out["numpy"] = 2 * n**3 / min(_timed(lambda: a @ a) for _ in range(3)) / 1e9
    jax.clear_caches()
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def required_flops(config, prompts, passages, new_tokens: int) -> float:
    """Model FLOPs the workload needs: each prompt once, each passage once, every new token,
    attention over the real context (no padding counted)."""
    body = 2 * config.num_params(include_embeddings=False)
    head = 2 * config.vocab_size * config.hidden_size
    attn = 4 * config.num_layers * config.num_heads * config.head_dim  # per (query, key) pair
    total = 0.0
    for prompt, psgs in zip(prompts, passages):
        p = len(prompt)
        total += body * p + attn * p * (p + 1) / 2 + head
        for s in psgs:
            total += body * len(s) + attn * len(s) * (p + len(s) / 2) + head
            ctx = p + len(s)
            total += new_tokens * (body + head) + attn * sum(ctx + i for i in range(new_tokens))
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: checks that the benchmark runs")
    parser.add_argument("--accelerator", action="store_true",
                        help="JAX's default device and PyTorch on CUDA, bfloat16 weights on both")
    parser.add_argument("--out", type=Path, help="results file [bench/results/decode{,_small,_gpu}.json]")
    parser.add_argument("--preset", help="another model shape, e.g. selfrag-7b (the released size) on a GPU")
    parser.add_argument("--model", help="a real model instead of random weights (a checkpoint, HF folder or GGUF "
                                        "file), its reflection tokens appended as `generate` appends them")
    args = parser.parse_args(argv)
    w = SMALL if args.small else FULL
    if args.preset or args.model:
        from dataclasses import replace

        w = replace(w, preset=args.preset or Path(args.model).name)
    if not args.accelerator:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark against PyTorch on CPU
    os.environ.setdefault("SELFRAG_NO_PROGRESS", "1")
    import jax
    import torch

    from selfrag_jax.inference.engine import ControlIds, Engine
    from selfrag_jax.models.config import preset
    from selfrag_jax.models.hf import export_hf
    from selfrag_jax.models.llama import init_params

    torch.set_num_threads(os.cpu_count() or 1)
    dtypes = {"dtype": "bfloat16", "param_dtype": "bfloat16"} if args.accelerator else {}
    if args.model:  # the reflection tokens sit at the end of its vocabulary, as ControlIds.appended expects
        from selfrag_jax.models.checkpoint import load_model

        config, params, _, _ = load_model(args.model, dtype=dtypes.get("dtype"))
    else:
        config = preset(w.preset, **dtypes)
        params = init_params(config, 0)
    ids = ControlIds.appended(config.vocab_size)
    prompts, passages = make_inputs(w, config.vocab_size, w.k)
    result = {"workload": w.__dict__, "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                                   "load_average_at_start": os.getloadavg(),
                                                   "device": jax.devices()[0].device_kind},
              "weights": "bfloat16" if args.accelerator else "float32",
              "versions": {"jax": jax.__version__, "torch": torch.__version__}}
    name = "decode_small" if args.small else "decode_gpu" if args.accelerator else "decode"
    name += f"_{Path(args.model).stem.split('.')[0].lower()}" if args.model else ""

    def save() -> Path:
        """Rewrite the results file with what is measured so far."""
        return write_result(name, result, args.out)

    engine = Engine(params, config, ids, w.new_tokens)
    t_first = _timed(lambda: run_ours(engine, prompts, passages))  # includes compilation
    t_ours = _timed(lambda: run_ours(engine, prompts, passages))
    seg = run_ours(engine, prompts, passages)
    result["ours"] = {"first_call_s_incl_compile": t_first, "seconds": t_ours,
                      "generated_tokens": int(seg.counts.sum()), "compiled_programs": engine.compiled_programs()}
    save()

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(params, config, Path(tmp) / "hf")
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.bfloat16 if args.accelerator
                                                 else torch.float32).eval()
    model.to("cuda" if args.accelerator else "cpu")
    if args.accelerator:  # CUDA context and kernels warmed on one question, as ours was compiled
        run_reference(model, ids, prompts[:1], passages[:1], w.new_tokens)
    t_ref = _timed(lambda: run_reference(model, ids, prompts, passages, w.new_tokens))
    result["reference"] = {"seconds": t_ref, "what": "transformers generate: no-retrieval pass + K passages batched"}
    result["speedup_vs_reference"] = t_ref / t_ours
    result["summary"] = [{"what": f"short-form Self-RAG decode, {w.questions} questions x {w.k} passages, "
                                  f"{w.preset}, {result['weights']} on {result['machine']['device']}",
                          "ours": f"{t_ours:.2f} s", "peer": f"transformers generate {t_ref:.2f} s",
                          "ratio": t_ref / t_ours, "goal": "ratio >= 3", "met": t_ref / t_ours >= 3}]
    save()

    def one_at_a_time():
        for i in range(w.one_at_a_time_rows):
            q = i % w.questions
            run_ours(engine, [prompts[q]], [[passages[q][0]]])

    one_at_a_time()  # compile the one-row programs
    one_row_s = _timed(one_at_a_time) / w.one_at_a_time_rows
    n_rows = w.questions * w.k
    result["one_at_a_time"] = {"seconds_per_row": one_row_s, "extrapolated_seconds": one_row_s * n_rows,
                               "speedup_of_batching": one_row_s * n_rows / t_ours}
    save()

    peak = matmul_peak(512 if args.small else 8192 if args.accelerator else 2048, args.accelerator)
    flops = required_flops(config, prompts, passages, w.new_tokens)
    result["roofline"] = {"required_gflop": flops / 1e9, "matmul_peak_gflops": peak,
                          "achieved_gflops": flops / t_ours / 1e9,
                          "share_of_peak": flops / t_ours / 1e9 / max(peak.values())}
    share = result["roofline"]["share_of_peak"]
    result["summary"].append({"what": f"short-form Self-RAG decode ({w.preset}): required FLOPs / time against the "
                                      f"in-run {result['weights']} matmul peak",
                              "ours": f"{flops / t_ours / 1e9:.0f} GFLOP/s", "peer": f"peak {max(peak.values()):.0f} GFLOP/s",
                              "ratio": share, "goal": "ratio >= 0.5", "met": share >= 0.5})
    save()

    sweep = {}
    for k in w.k_sweep:
        p_k, s_k = make_inputs(w, config.vocab_size, k, seed=1)
        run_ours(engine, p_k, s_k)  # compile this row count
        sweep[str(k)] = _timed(lambda: run_ours(engine, p_k, s_k))
        result["seconds_by_k"] = sweep
        save()
    result["compiled_programs_total"] = engine.compiled_programs()
    path = save()
    print(json.dumps({k: result[k] for k in ("ours", "reference", "speedup_vs_reference", "one_at_a_time",
                                             "roofline", "seconds_by_k")}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
