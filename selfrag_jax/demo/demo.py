"""`selfrag-jax demo`: the whole method on the bundled world, in a few minutes on a laptop.

1. build the world (deterministic, seconds) and index its passages with the bundled MiniLM;
2. answer the held-out sets with the bundled generator under four settings that share one
   compiled engine: Self-RAG (adaptive retrieval, the paper's score over the retriever's top
   K, K chosen for these models on the dev split: `decoding.json`), always retrieve top-1
   (standard RAG), no retrieval, and Self-RAG without IsSup in the score; and a fifth chosen
   again from Self-RAG's candidates without decoding: its score plus the retriever's prior;
3. measure the bundled critic against the world's ground truth on held-out examples;
4. print a table and one traced example; write predictions, report.json, report.md and a
   plot to the work folder. `--retrain` first reruns the whole training pipeline at a
   reduced budget and reports its numbers beside the shipped models'.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.bundled import ASSETS
from selfrag_jax.demo.decoding import PAPER_NDOCS, load_engine, load_items, model_ndocs, run_batches
from selfrag_jax.demo.pipeline import Stages
from selfrag_jax.models.config import INFERENCE_DTYPES

# task file -> (engine task, questions used by default)
TASKS = {
    "world_qa": ("open", 300),
    "world_factcheck": ("fever", 150),
    "world_mc": ("arc_c", 150),
    "world_noretrieval": ("open", 150),
}
SETTINGS = ("selfrag", "selfrag_ret", "always_top1", "no_retrieval", "selfrag_no_issup")
# `selfrag_ret`: Self-RAG's candidates chosen again with the retriever's p(passage|question)
# added at this weight (`ScoreOptions.w_ret`, beyond the paper): where the critique tokens
# cannot tell passages apart, the choice falls back to the retriever's order. Chosen on the dev
# split with `generate --cache` and `sweep` for the shipped and the reduced models
# (docs/experiments/default-models.md, "The retriever prior").
DEMO_W_RET = 0.1


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="demo_out", help="where the world, index and report go [demo_out]")
    parser.add_argument("--models", default=None, help="folder with critic/ and generator/ [the bundled models]")
    parser.add_argument("--generator", default=None, metavar="PATH",
                        help="evaluate this generator instead of the folder's (checkpoint, HF folder or GGUF file); "
                             "its depth from its own decoding.json, else the paper's 5")
    parser.add_argument("--critic", default=None, metavar="PATH", help="measure this critic instead of the folder's")
    parser.add_argument("--limit", type=int, default=0, help="questions per task (0: the defaults, ~750 in all)")
    parser.add_argument("--retrain", action="store_true",
                        help="first rerun the whole pipeline at a reduced budget (~45 min on 2 cores)")
    parser.add_argument("--batch-size", type=int, default=32, help="questions per engine call [32]")
    parser.add_argument("--encoder", default=None, help="HF BERT folder for the index [the bundled MiniLM]")
    parser.add_argument("--mesh", default=None, metavar="SPEC", help="decode over a device mesh (as `generate --mesh`)")
    parser.add_argument("--dtype", choices=INFERENCE_DTYPES, default="float32",
                        help="the generator's parameters and KV cache [float32]")


@dataclass(frozen=True)
class Models:
    """The generator and critic the demo evaluates, and the folder whose `decoding.json`
    holds the depth chosen for that generator."""

    generator: Path
    critic: Path
    depth_dir: Path

    @classmethod
    def of(cls, folder: Path, generator: str | None = None, critic: str | None = None) -> "Models":
        gen = Path(generator) if generator else folder / "generator"
        return cls(gen, Path(critic) if critic else folder / "critic", gen if generator else folder)


def evaluate_models(models: Models, world: Path, index: Path, out: Path, limit: int, batch_size: int,
                    mesh: str | None = None, dtype: str = "float32") -> dict[str, Any]:
    """Accuracy and retrieval frequency per task and setting, critic agreement, a trace."""
    from selfrag_jax.metrics import match
    from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
    from selfrag_jax.inference.scoring import ScoreOptions
    from selfrag_jax.retrieval.retriever import Retriever

    engine, tok = load_engine(models.generator, mesh=mesh, dtype=dtype)
    retrieve = Retriever.from_dir(index).retrieve
    ndocs, depth = model_ndocs(models.depth_dir)
    options = {
        "selfrag": GenerateOptions(ndocs=ndocs),
        "always_top1": GenerateOptions(ndocs=1, pipeline="top1"),
        "no_retrieval": GenerateOptions(pipeline="none"),
        "selfrag_no_issup": GenerateOptions(ndocs=ndocs, score=ScoreOptions(w_sup=0.0)),
    }
    report: dict[str, Any] = {"tasks": {}, "distractor_top1": {}, "ndocs": ndocs, "depth": depth}
    (out / "predictions").mkdir(parents=True, exist_ok=True)
    trace = None
    for name, (task, default_n) in TASKS.items():
        items = load_items(world / "eval" / f"{name}.jsonl", limit or default_n)
        report["tasks"][name] = {}
        per_setting = {}

        def keep(setting: str, runner: ShortForm, results: list) -> None:
            records = [runner.record(r) for r in results]
            hits = [match(rec["prediction"], it.record["answers"]) for rec, it in zip(records, items)]
            per_setting[setting] = (records, hits)
            report["tasks"][name][setting] = {"accuracy": float(np.mean(hits)),
                                              "retrieval_frequency": float(np.mean([r["retrieved"] for r in records])),
                                              "n": len(records)}
            with open(out / "predictions" / f"{name}.{setting}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)

        for setting, opts in options.items():
            runner = ShortForm(engine, tok, replace(opts, task=task, trace=setting == "selfrag"), retrieve)
            results = run_batches(runner, items, batch_size, f"{name}/{setting}")
            keep(setting, runner, results)
            if setting == "selfrag":
                if trace is None and name == "world_qa":
                    records = per_setting["selfrag"][0]
                    trace = next((r for r in records if r["retrieved"] and r["candidates"]), records[0])
                prior = ShortForm(engine, tok, replace(runner.opts, trace=False,
                                                       score=replace(runner.opts.score, w_ret=DEMO_W_RET)))
                prior.rechoose(results)
                keep("selfrag_ret", prior, results)
        if name == "world_qa":  # questions whose top-1 passage is a look-alike, not the gold one
            gold = [set(it.record.get("meta", {}).get("gold_passage_ids", [])) for it in items]
            top1 = [r["candidates"][0]["passage"]["id"] if r["candidates"] else None
                    for r in per_setting["always_top1"][0]]
            hard = [i for i, (g, t) in enumerate(zip(gold, top1)) if g and t not in g]
            report["distractor_top1"] = {s: {"accuracy": float(np.mean([per_setting[s][1][i] for i in hard]))
                                             if hard else None, "n": len(hard)}
                                         for s in ("selfrag", "selfrag_ret", "always_top1")}
            report["gold_passage"] = gold_passage_reading(engine, tok, replace(options["always_top1"], task=task),
                                                          world, items, gold, batch_size, out)
    report["critic_agreement"], own_issup = critic_agreement(models.critic, *([max(limit // 5, 10)] if limit else []))
    if own_issup is not None:  # a reading critic: its own label, beside the decision
        report["critic_issup_label"] = own_issup
    report["trace"] = trace
    return report


def evaluate_to_file(path: Path, *args) -> None:
    """`evaluate_models(*args)` in a process of its own (`demo --retrain`), quietly, its report
    written whole to `path`."""
    import os

    from selfrag_jax.utils import atomic_file

    os.environ["SELFRAG_NO_PROGRESS"] = "1"  # the training's bars own the terminal
    report = evaluate_models(*args)
    with atomic_file(path) as f:
        json.dump(report, f)


def gold_passage_reading(engine, tok, opts, world: Path, items: list, gold: list[set[str]], batch_size: int,
                         out: Path) -> dict[str, Any]:
    """The generator's reading ceiling: each factual question with one of its gold passages
    (`gold`: ids per item) as the only passage. Beside always-top-1 and Self-RAG it tells
    reading apart from selection. Predictions go beside the other settings'."""
    from selfrag_jax.metrics import match
    from selfrag_jax.inference.selfrag import ShortForm
    from selfrag_jax.world.passages import read_jsonl

    passages = {p["id"]: p for p in read_jsonl(world / "passages.jsonl")}
    with_gold = [replace(it, ctxs=[passages[min(ids & passages.keys())]]) for it, ids in zip(items, gold)
                 if ids & passages.keys()]
    runner = ShortForm(engine, tok, opts)
    records = [runner.record(r) for start in range(0, len(with_gold), batch_size)
               for r in runner.run(with_gold[start:start + batch_size])]
    with open(out / "predictions" / "world_qa.gold_passage.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    hits = [match(rec["prediction"], it.record["answers"]) for rec, it in zip(records, with_gold)]
    by: dict[str, list[bool]] = {}  # a small model reads some attributes and not others
    for h, it in zip(hits, with_gold):
        by.setdefault("+".join(it.record.get("meta", {}).get("attributes", [])) or "-", []).append(bool(h))
    return {"accuracy": float(np.mean(hits)) if hits else None, "n": len(hits),
            "by_attribute": {a: float(np.mean(v)) for a, v in sorted(by.items())}}


def critic_agreement(critic_dir: Path, per_type: int = 300) -> tuple[dict[str, float], float | None]:
    """Share of held-out critic examples where the critic's label equals the ground truth,
    per type (300 per type by default: small samples of the same critic disagree by tenths). A critic that writes IsSup
    reading lines is scored by the decision annotation uses (`read_support`); the second value
    is then its own label's agreement after the lines (None for a critic without them)."""
    from selfrag_jax.data.annotate import Critic, parse_label, read_support
    from selfrag_jax.models.checkpoint import load_model
    from selfrag_jax.world import WorldConfig
    from selfrag_jax.world.build import world_of
    from selfrag_jax.data.critic_prompts import issup_output
    from selfrag_jax.world.critic_data import make_critic_records

    config, params, tok, _ = load_model(critic_dir)
    critic = Critic(params, config, tok)
    # the bundled world's own held-out people, the ones the demo's questions ask about
    records = make_critic_records(world_of(WorldConfig()), per_type, seed=1, split="heldout")
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["dataset_name"].removeprefix("critic_"), []).append(r)
    out, own_issup = {}, None
    for kind, recs in by_type.items():
        texts = critic.generate([T.CRITIC_PROMPT.format(instruction=r["instruction"], input=r["input"]) for r in recs])
        outputs = [issup_output(r["input"]) if kind == "issup" else None for r in recs]
        out[kind] = float(np.mean([parse_label(kind, t, o) == r["output"] for t, o, r in zip(texts, outputs, recs)]))
        if kind == "issup" and any(read_support(t, o) is not None for t, o in zip(texts, outputs)):
            own_issup = float(np.mean([parse_label(kind, t) == r["output"] for t, r in zip(texts, recs)]))
    return out, own_issup


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------
def table(report: dict[str, Any]) -> str:
    head = f"{'task':<20}" + "".join(f"{s:>20}" for s in SETTINGS)
    lines = [head, "-" * len(head)]
    for task, rows in report["tasks"].items():
        cells = "".join(f"{rows[s]['accuracy']:>12.3f} ({rows[s]['retrieval_frequency']:.2f})" for s in SETTINGS)
        lines.append(f"{task:<20}{cells}")
    lines.append("accuracy (retrieval frequency), released `match` metric")
    d = report.get("distractor_top1") or {}
    if d.get("selfrag", {}).get("n"):
        ret = f", with the retriever prior {d['selfrag_ret']['accuracy']:.3f}," if "selfrag_ret" in d else ""
        lines.append(f"questions whose top-1 passage is a look-alike (n={d['selfrag']['n']}): "
                     f"Self-RAG {d['selfrag']['accuracy']:.3f}{ret} vs always-top-1 {d['always_top1']['accuracy']:.3f}")
    lines.append(f"selfrag_ret: Self-RAG's candidates, score + {DEMO_W_RET:g} x retriever p(passage|question) "
                 "(beyond the paper)")
    depth = report.get("depth")
    if depth:
        lines.append(f"Self-RAG chose among the retriever's top {report['ndocs']}, the depth chosen on the dev split "
                     f"(n={depth['n']}; dev match by depth: " + ", ".join(f"{k}: {v:.3f}" for k, v in depth["dev_match"].items())
                     + f"; the paper: {PAPER_NDOCS} or 10)")
    g = report.get("gold_passage") or {}
    if g.get("n"):
        lines.append(f"reading ceiling, factual questions with their gold passage only (n={g['n']}): {g['accuracy']:.3f}"
                     + (" (" + ", ".join(f"{a} {v:.2f}" for a, v in g["by_attribute"].items()) + ")"
                        if g.get("by_attribute") else ""))
    if report.get("critic_agreement"):
        lines.append("critic agreement with ground truth: " +
                     ", ".join(f"{k} {v:.2f}" for k, v in report["critic_agreement"].items()))
    if report.get("critic_issup_label") is not None:
        lines.append(f"issup decided by the critic's reading line (beyond the paper); its own label after the line: "
                     f"{report['critic_issup_label']:.2f}")
    return "\n".join(lines)


def traced_example(trace: dict[str, Any] | None, tok) -> str:
    if not trace:
        return "(no traced example)"
    lines = [f"question: {trace['question']}", f"p(retrieve) = {trace['p_retrieve']:.3f}, retrieved: {trace['retrieved']}"]
    for j, c in enumerate(trace["candidates"][:5]):
        marks = "".join(tok.id_to_token(i) for i in c.get("token_ids", []) if i in tok.control_ids)
        s = c["scores"]
        star = "*" if j == trace["chosen"] else " "
        lines.append(f"{star} [{c['passage']['title']}] -> {c['text']!r} {marks}  "
                     f"final {s['final']:.2f} (rel {s['rel']:.2f} sup {s['sup']:.2f} use {s['use']:.2f})")
    lines.append(f"prediction: {trace['prediction']!r}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from selfrag_jax.utils import pyplot

    plt = pyplot()
    tasks = list(report["tasks"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.16
    for k, s in enumerate(SETTINGS):
        ax.bar(np.arange(len(tasks)) + k * width, [report["tasks"][t][s]["accuracy"] for t in tasks], width, label=s)
    ax.set_xticks(np.arange(len(tasks)) + (len(SETTINGS) - 1) / 2 * width, tasks)
    ax.set_ylabel("accuracy (match)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Self-RAG on the bundled world (held-out questions)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(args: argparse.Namespace) -> int:
    from selfrag_jax.cli import CLIError

    t0 = time.time()
    work = Path(args.workdir)
    folder = Path(args.models) if args.models else ASSETS
    models = Models.of(folder, args.generator, args.critic)
    for name, path in (("generator", models.generator), ("critic", models.critic)):
        if not path.exists():
            raise CLIError(f"{path}: no {name} (give --{name}, or --models with generator/ and critic/; "
                           "the bundled ones come from `make train-default`)")
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages(work, encoder=args.encoder)
    stages.stage("world", lambda: stages.world(training=False))  # evaluation reads passages and eval sets only
    stages.stage("index", stages.index)
    runs = {"shipped": models}
    reports = {}
    if args.retrain:
        # The shipped models' evaluation needs nothing from the retraining: a second process
        # runs it meanwhile, on the cores one training process leaves idle.
        import multiprocessing

        shipped = work / "shipped" / "report.json"
        shipped.unlink(missing_ok=True)
        child = multiprocessing.get_context("spawn").Process(target=evaluate_to_file, args=(
            shipped, models, work / "world", work / "index", work / "shipped", args.limit, args.batch_size, args.mesh,
            args.dtype))
        child.start()
        try:
            retrain = Stages(work / "retrain", budget="reduced", encoder=args.encoder)
            retrain.run_all(export=False)
            retrain.stage("export", lambda: retrain.export(work / "retrain" / "models"))
        except BaseException:
            child.terminate()
            raise
        child.join()
        if child.exitcode != 0:
            raise CLIError(f"evaluating the shipped models (a second process) failed with exit code {child.exitcode}; "
                           "its error is above")
        reports["shipped"] = json.loads(shipped.read_text())
        runs = {"retrained": Models.of(work / "retrain" / "models")}
    for name, pair in runs.items():
        reports[name] = evaluate_models(pair, work / "world", work / "index", work / name, args.limit, args.batch_size,
                                        args.mesh, args.dtype)
    report = dict(reports["shipped"])
    report["seconds"] = round(time.time() - t0, 1)
    if args.generator or args.critic:  # named only when chosen (the bundled ones' paths are this machine's)
        report["models"] = {"generator": args.generator, "critic": args.critic}
    if "retrained" in reports:
        report["retrained"] = {k: reports["retrained"][k] for k in ("tasks", "critic_agreement", "distractor_top1", "gold_passage",
                                                                     "ndocs", "depth")}
        if "critic_issup_label" in reports["retrained"]:
            report["retrained"]["critic_issup_label"] = reports["retrained"]["critic_issup_label"]
        reading = work / "retrain" / "base_reading.done"
        if reading.exists():
            report["retrained"]["base_reading"] = {k: v for k, v in json.loads(reading.read_text()).items()
                                                   if k in ("with_passage", "closed_book", "n", "by_attribute")}
    from selfrag_jax.models.checkpoint import load_model

    tok = load_model(models.generator)[2]
    text = table(report)
    example = traced_example(report.pop("trace"), tok)
    print(text, "\n\nA traced example (reflection tokens the generator emitted):\n" + example)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    md = ["# Self-RAG demo on the bundled world", "", "```", text, "```", "", "## A traced example", "", "```",
          example, "```", ""]
    if "retrained" in report:
        md += ["## Retrained at the reduced budget", "", "```", table(report["retrained"]), "```", ""]
    md.append(f"Took {report['seconds']:.0f} s. Predictions in `{work / 'shipped' / 'predictions'}`.")
    (work / "report.md").write_text("\n".join(md) + "\n")
    plot(report, work / "accuracy.png")
    print(f"\nwrote {work / 'report.md'}, {work / 'report.json'}, {work / 'accuracy.png'}")
    return 0
