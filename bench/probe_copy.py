"""Copying by content, from nothing: the project's Llama beside an independent minimal GPT.

Why: the bundled critic cannot tell "the passage states this value" from "it states another"
(IsSup, docs/experiments/default-models.md). The barest form of that skill is finding a
token in the context by its identity and copying what follows it (an induction head). This
probe trains the default base's shape (width 128, 4 layers, 4 heads of 32, tied embeddings,
RoPE; the base's optimizer) on it, and beside it a GPT written here from nothing (learned
positions, LayerNorm, GELU, no RoPE, untied), so a plateau can be told apart from a defect
of our model code.

Each row: BOS, a "passage" of P distinct random tokens, then queries `SEP v w` until the row
is full, v a passage token and w the token after it in the passage; the loss is on w only.
Uniform over the vocabulary scores ln V; knowing only that w is one of the passage's tokens,
ln P; copying, 0. Not a timing: run it alone or beside anything.

    python -m bench.probe_copy                      # V 1000, P 20 and 5, 500 steps, both models (~30 min)
    python -m bench.probe_copy --small              # a smoke run: 20 steps, V 100
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import RESULTS, machine_info, versions, write_result
from selfrag_jax.models.config import LlamaConfig
from selfrag_jax.models.llama import Llama, init_params
from selfrag_jax.training.config import load_config
from selfrag_jax.training.trainer import cross_entropy, make_optimizer

BOS, SEP, FIRST = 1, 3, 10  # ids below FIRST are never drawn as passage tokens
BASE = Path(__file__).resolve().parents[1] / "configs" / "default" / "base.yaml"


def copy_batch(rng: np.random.Generator, vocab: int, passage: int, rows: int, length: int):
    """(tokens [rows, length] int32, loss weights [rows, length]: 1 on each w)."""
    tokens = np.zeros((rows, length), np.int32)
    weights = np.zeros((rows, length), np.float32)
    for r in range(rows):
        p = rng.choice(np.arange(FIRST, vocab), passage, replace=False)
        tokens[r, 0], tokens[r, 1:passage + 1] = BOS, p
        at = passage + 1
        while at + 3 <= length:
            i = rng.integers(0, passage - 1)
            tokens[r, at:at + 3] = SEP, p[i], p[i + 1]
            weights[r, at + 2] = 1.0
            at += 3
    return tokens, weights


def llama_model(vocab: int):
    """The default base's shape and optimizer (configs/default/base.yaml), vocabulary `vocab`."""
    cfg = load_config(BASE)
    shape = {k: v for k, v in cfg.model.overrides.items() if k != "scan_layers"}
    config = LlamaConfig(vocab_size=vocab, **shape)
    model = Llama(config)
    return init_params(config, 0), lambda p, x: model.apply({"params": p}, x)[0], cfg


def reference_model(vocab: int, length: int, width: int = 128, layers: int = 4, heads: int = 4):
    """An independent GPT-2-style decoder: learned positions, LayerNorm, GELU, untied output."""
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 * layers + 3))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) * 0.02

    params = {"emb": normal(vocab, width), "pos": normal(length, width), "out": normal(width, vocab),
              "layers": [{"qkv": normal(width, 3 * width), "o": normal(width, width),
                          "up": normal(width, 4 * width), "down": normal(4 * width, width)} for _ in range(layers)]}

    def norm(x):
        return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def apply(p, x):
        b, s = x.shape
        h = p["emb"][x] + p["pos"][:s]
        causal = jnp.tril(jnp.ones((s, s), bool))
        for lp in p["layers"]:
            q, k, v = (t.reshape(b, s, heads, -1) for t in jnp.split(norm(h) @ lp["qkv"], 3, -1))
            a = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(width // heads)
            a = jax.nn.softmax(jnp.where(causal, a, -1e9), -1)
            h = h + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, s, width) @ lp["o"]
            h = h + jax.nn.gelu(norm(h) @ lp["up"]) @ lp["down"]
        return norm(h) @ p["out"]

    return params, apply


def train(name: str, params, apply, tx: optax.GradientTransformation, args, passage: int, log=print):
    """Trains on fresh batches; every `args.every` steps records (step, loss, accuracy on w).
    With `args.first` = (P0, n), the first n steps ask with passages of P0 tokens instead."""
    first_p, first_n = args.first or (passage, 0)

    def length_at(i: int) -> int:
        return first_p if i <= first_n else passage

    def loss_fn(p, x, w):
        logits = apply(p, x[:, :-1])
        nll = cross_entropy(logits, x[:, 1:])
        m = w[:, 1:]
        return jnp.sum(nll * m) / jnp.sum(m), jnp.sum((jnp.argmax(logits, -1) == x[:, 1:]) * m) / jnp.sum(m)

    @jax.jit
    def step(p, s, x, w):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x, w)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, acc

    rng = np.random.default_rng(args.seed)
    state, curve, t0 = tx.init(params), [], time.time()
    x, w = copy_batch(rng, args.vocab, length_at(1), args.rows, args.length)
    curve.append((0, *(float(v) for v in jax.jit(loss_fn)(params, x, w))))
    for i in range(1, args.steps + 1):
        params, state, loss, acc = step(params, state, *copy_batch(rng, args.vocab, length_at(i), args.rows, args.length))
        if i % args.every == 0 or i == args.steps:
            curve.append((i, float(loss), float(acc)))
            rate = i / (time.time() - t0)
            log(f"[{name} P={length_at(i)}] step {i}/{args.steps} loss {float(loss):.3f} acc {float(acc):.3f} "
                f"({rate:.2f} steps/s, ETA {(args.steps - i) / rate:.0f} s)")
    return curve


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--passages", default="20,5", help="passage lengths P, comma-separated [20,5]")
    ap.add_argument("--models", default="llama,reference")
    ap.add_argument("--rows", type=int, default=32, help="rows per step (the base's batch)")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", default=None, metavar="P0:STEPS",
                    help="a curriculum: the first STEPS steps with passages of P0 tokens, then --passages")
    ap.add_argument("--small", action="store_true", help="20 steps, vocabulary 100: a smoke run")
    ap.add_argument("--out", default=None, help="results file [bench/results/probe_copy(_small).json]")
    args = ap.parse_args(argv)
    if args.small:
        args.steps, args.vocab, args.every = 20, 100, 10
    passages = [int(p) for p in args.passages.split(",")]
    if args.first:
        parts = args.first.split(":")
        if len(parts) != 2 or not all(v.isdigit() for v in parts) or not 0 < int(parts[1]) < args.steps:
            ap.error(f"--first {args.first!r}: want P0:STEPS with 0 < STEPS < --steps")
        args.first = (int(parts[0]), int(parts[1]))
        passages_checked = passages + [args.first[0]]
    else:
        passages_checked = passages
    if any(not 2 <= p <= args.vocab - FIRST for p in passages_checked):
        ap.error(f"--passages: each P must lie in 2..{args.vocab - FIRST} (distinct tokens below --vocab)")

    runs = {}
    for name in args.models.split(","):
        for p in passages:
            if name == "llama":
                params, apply, cfg = llama_model(args.vocab)
                tx = make_optimizer(cfg, args.steps)
            elif name == "reference":
                params, apply = reference_model(args.vocab, args.length)
                tx = optax.adamw(1e-3, weight_decay=0.01)
            else:
                ap.error(f"--models: unknown model {name!r} (llama, reference)")
            runs[run_key(name, p, args.first)] = train(name, params, apply, tx, args, p)

    out = Path(args.out) if args.out else RESULTS / ("probe_copy_small.json" if args.small else "probe_copy.json")
    result = {"machine": machine_info(), "versions": versions("jax", "flax", "optax"),
              "task": {"vocab": args.vocab, "passages": passages, "rows": args.rows, "length": args.length,
                       "steps": args.steps, "first": args.first, "chance": {"uniform": math.log(args.vocab - FIRST),
                                                        **{f"P{p}": math.log(p) for p in passages}}},
              "curves": {k: [{"step": s, "loss": l, "acc": a} for s, l, a in v] for k, v in runs.items()}}
    if "llama" in args.models:  # one README row per passage length
        result["summary"] = [summary_row(runs, p, args) for p in passages]
    write_result(out.stem, result, out)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


def run_key(name: str, passage: int, first) -> str:
    return f"{name}_P{first[0]}x{first[1]}_P{passage}" if first else f"{name}_P{passage}"


def summary_row(runs: dict, passage: int, args) -> dict:
    """The loss on the copied token at the last step, ours beside the reference when it ran
    (ratio > 1: ours lower). A learning probe, not a timing: no goal."""
    ours, peer = runs[run_key("llama", passage, args.first)][-1], runs.get(run_key("reference", passage, args.first))
    first = f"P={args.first[0]} for {args.first[1]} steps, then " if args.first else ""
    return {"what": f"copy by content from nothing, vocabulary {args.vocab}, {args.rows} x {args.length} per step, "
                    f"{first}P={passage}: loss at step {args.steps} (ln P = {math.log(passage):.2f})",
            "ours": f"{ours[1]:.2f} (acc {ours[2]:.2f})",
            "peer": f"reference GPT {peer[-1][1]:.2f} (acc {peer[-1][2]:.2f})" if peer else "-",
            "ratio": peer[-1][1] / ours[1] if peer else None, "goal": None, "met": None}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in result["curves"].items():
        ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=name,
                linestyle="-" if name.startswith("llama") else "--")
    for label, y in result["task"]["chance"].items():
        ax.axhline(y, color="grey", linewidth=0.6)
        ax.text(0, y, f" ln {label}", va="bottom", fontsize=7, color="grey")
    t = result["task"]
    ax.set(xlabel="step", ylabel="loss on the copied token",
           title=f"copy by content: vocabulary {t['vocab']}, {t['rows']} rows of {t['length']} per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


if __name__ == "__main__":
    main()
