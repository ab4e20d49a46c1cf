"""Self-RAG against the baselines in the same engine: latency, and the bundled-world numbers.

`python -m bench.bench_pipelines [--small]` -> bench/results/pipelines[_small].json
    Latency of short-form Self-RAG against naive RAG on the same model (the 125M Llama
    shape, random weights), the same questions and the same K passages, in the same run,
    for K = 5 and 10; top1 and none beside them. Self-RAG runs with mode always (K
    candidate rows per question, all decoded in one compiled step); naive RAG decodes one
    row per question with the K passages concatenated. Goal: Self-RAG at most 1.3x naive.
    `selfrag_keep2` reads all K passages but decodes only the 2 with the highest IsRel
    (`--keep-top 2`); its accuracy against full Self-RAG is measured by `--world`.
    A word-level tokenizer over the preset's full vocabulary stands in for text (one word,
    one token), so prompts and passages have the lengths the workload says. Random
    weights rarely emit a boundary token, so every row decodes `new_tokens`: the worst
    case for Self-RAG, whose K rows each generate where naive RAG's one row does.
    Both pipelines prefill about the same tokens (the question once, then its passages),
    so the ratio is mostly the K-fold decode plus each pipeline's padding: 160 rows of 106
    tokens ran as 192 x 128 under the engine's earlier bucket ladder (1.51x at K=5) and
    run as 160 x 112 under the current one (1.10x); a workload between two buckets pays
    up to a fifth more.

`python -m bench.bench_pipelines --world --model DIR --index DIR [--world-dir DIR]`
    -> bench/results/pipelines_world.json: the bundled-world numbers with the trained
    generator (the index folder's passages file locates the world unless --world-dir):
    1. honest refusal, on test splits only, with the support bar chosen on the dev splits
       (the model's decoding.json, `demo.decoding.choose_refusal`): world_qa and each kind of
       unanswerable question (eval/unanswerable/<kind>_test.jsonl), selfrag vs
       selfrag+refuse. Goals: >= 80% of every kind refused; answerable accuracy within 5
       points. --plot: the dev grid's trade-off, the chosen bar and where it lands on test.
    2. corrective re-retrieval: world_qa with passages from the index (clean), then with
       every passage of the asked person replaced by the next-ranked passages of others
       (distractors, as static `ctxs`), selfrag vs selfrag+crag (extra rounds from the
       index). Goal: CRAG recovers at least half of the accuracy the distractors cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import machine_info, median_time, now, versions, write_result

os.environ.setdefault("SELFRAG_NO_PROGRESS", "1")
KEEP = 2
KEPT = f"selfrag_keep{KEEP}"  # Self-RAG with --keep-top KEEP
PIPELINES = ("selfrag", KEPT, "naive", "top1", "none")
GOAL_RATIO = 1.3


@dataclass(frozen=True)
class Workload:
    preset: str
    questions: int
    ks: tuple[int, ...]
    prompt_words: tuple[int, int]  # min, max
    passage_words: int
    new_tokens: int
    repeats: int


FULL = Workload("llama-125m", 32, (5, 10), (20, 60), 100, 24, 3)
SMALL = Workload("tiny", 4, (5, 10), (5, 10), 12, 6, 3)


# --- latency: Self-RAG vs naive RAG on random weights ------------------------------------------
def word_tokenizer(base_vocab: int):
    """A Self-RAG tokenizer whose base vocabulary is the words w3..w{base_vocab-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from selfrag_jax.tokenizer import SelfRAGTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, base_vocab)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return SelfRAGTokenizer(hf)


def make_items(w: Workload, k: int, base_vocab: int, seed: int = 0):
    from selfrag_jax.inference.items import parse_item

    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(3, base_vocab)}" for _ in range(n))

    items = []
    for q in range(w.questions):
        ctxs = [{"id": f"p{q}.{j}", "title": words(2), "text": words(w.passage_words - 2)} for j in range(k)]
        record = {"id": str(q), "question": words(rng.randint(*w.prompt_words)), "ctxs": ctxs}
        items.append(parse_item(json.dumps(record), f"bench:{q + 1}"))
    return items


def latency(w: Workload, on_k=None) -> dict[str, Any]:
    """Median seconds per pipeline and K; `on_k(by_k)` after each K (partial results)."""
    from selfrag_jax.inference.engine import ControlIds, Engine
    from selfrag_jax.inference.scoring import RetrieveOptions
    from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm
    from selfrag_jax.models.config import preset
    from selfrag_jax.models.llama import init_params

    config = preset(w.preset)
    tok = word_tokenizer(config.vocab_size - 16)
    assert len(tok) == config.vocab_size, (len(tok), config.vocab_size)
    engine = Engine(init_params(config, 0), config, ControlIds.from_tokenizer(tok), w.new_tokens)
    by_k: dict[str, Any] = {}
    for k in w.ks:
        items = make_items(w, k, config.vocab_size - 16, seed=k)
        rows = {}
        for pipeline in PIPELINES:
            selfrag = pipeline.startswith("selfrag")
            mode = RetrieveOptions(mode="always") if selfrag else RetrieveOptions()
            opts = GenerateOptions(ndocs=k, pipeline="selfrag" if selfrag else pipeline, retrieve=mode,
                                   keep_top=KEEP if pipeline == KEPT else 0)
            runner = ShortForm(engine, tok, opts)
            runner.run(items)  # compile this pipeline's shapes
            prefill, decode = engine.tokens.prefill, engine.tokens.decode
            median, times = median_time(lambda: runner.run(items), w.repeats)
            rows[pipeline] = {"median_s": median, "times_s": times, "per_question_ms": 1e3 * median / w.questions,
                              "prefill_tokens": (engine.tokens.prefill - prefill) // w.repeats,
                              "decode_tokens": (engine.tokens.decode - decode) // w.repeats}
        rows["selfrag_over_naive"] = rows["selfrag"]["median_s"] / rows["naive"]["median_s"]
        rows[f"{KEPT}_over_naive"] = rows[KEPT]["median_s"] / rows["naive"]["median_s"]
        by_k[str(k)] = rows
        if on_k:
            on_k(by_k)
    return {"by_k": by_k, "compiled_programs": engine.compiled_programs()}


def latency_summary(result: dict[str, Any], small: bool) -> list[dict[str, Any]]:
    rows = []
    for k, r in result["by_k"].items():
        for name, label in (("selfrag", "Self-RAG"), (KEPT, f"Self-RAG --keep-top {KEEP}")):
            if name not in r:
                continue
            ratio = r["naive"]["median_s"] / r[name]["median_s"]
            rows.append({"what": f"{label} vs naive RAG, same engine, K={k}{' (small)' if small else ''}",
                         "ours": f"{r[name]['median_s']:.3g} s", "peer": f"{r['naive']['median_s']:.3g} s",
                         "ratio": ratio, "goal": f"ratio >= {1 / GOAL_RATIO:.3f} (Self-RAG <= {GOAL_RATIO}x naive)",
                         "met": ratio >= 1 / GOAL_RATIO})
    return rows


# --- the bundled world: refusal and corrective re-retrieval ------------------------------------
def world_args(model: str, index: str, extra: list[str]) -> argparse.Namespace:
    """`compare`'s own flags and defaults, so the numbers are what the command gives."""
    from selfrag_jax.evaluation import compare

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(["--pipelines", "selfrag,naive", "--input", "-", "--model", model, "--index", index,
                              *extra])


def read_jsonl(path: Path, limit: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]


def with_distractors(records: list[dict[str, Any]], retrieve, entities: dict[str, dict[str, Any]], k: int):
    """Each record with static `ctxs`: the index's top passages for its question minus
    every passage of the asked person (and the gold ones), i.e. look-alike distractors."""
    hits = retrieve([r["question"] for r in records], k + 20)
    out = []
    for rec, hs in zip(records, hits):
        meta = rec.get("meta", {})
        banned = set(meta.get("gold_passage_ids", []))
        for eid in meta.get("entity_ids", []):
            banned.update(entities.get(eid, {}).get("passage_ids", []))
        ctxs = [{"id": h["id"], "title": h["title"], "text": h["text"]} for h in hs if h["id"] not in banned][:k]
        out.append({**rec, "ctxs": ctxs})
    return out


def world(args: argparse.Namespace) -> dict[str, Any]:
    from selfrag_jax.evaluation.compare import PipelineSpec, compare
    from selfrag_jax.inference.cli import Session, options_from_args
    from selfrag_jax.inference.items import parse_item
    from selfrag_jax.inference.settings import settings_file
    from selfrag_jax.world.judges import WorldFactJudge
    from selfrag_jax.world.unanswerable import KINDS

    world_dir = Path(args.world_dir) if args.world_dir else world_of_index(Path(args.index))
    found = settings_file(args.model)
    settings = json.loads(found.read_text()) if found else {}
    ndocs = args.ndocs or settings.get("ndocs", 5)
    extra = ["--ndocs", str(ndocs), "--max-new-tokens", str(args.max_new_tokens),
             "--batch-size", str(args.batch_size), "--max-rounds", str(args.max_rounds), "--task", "open",
             "--crag-rel-threshold", str(args.crag_rel_threshold)]
    if args.refuse_rel_threshold is not None:
        extra += ["--refuse-rel-threshold", str(args.refuse_rel_threshold)]
    cargs = world_args(args.model, args.index, extra)
    session = Session.load(cargs)
    judge = WorldFactJudge.from_world(world_dir)
    entities = {json.loads(line)["id"]: json.loads(line)
                for line in (world_dir / "entities.jsonl").read_text().splitlines() if line.strip()}
    qa = read_jsonl(world_dir / "eval" / "world_qa.jsonl", args.n)
    unanswerable = {k: read_jsonl(world_dir / "eval" / "unanswerable" / f"{k}_test.jsonl", args.n) for k in KINDS}
    distracted = with_distractors(qa, session.retrieve_fn, entities, ndocs)

    def items(records):
        return [parse_item(json.dumps(r), f"world:{i + 1}", "open") for i, r in enumerate(records)]

    def run(parsed, names, flags=cargs):
        return compare(session, parsed, [PipelineSpec.parse(n) for n in names], flags, judge, warmup=False)

    # Refusal on the test splits only, with the bar chosen on the dev splits (decoding.json).
    answerable = run(items(qa), ("selfrag", "selfrag+refuse", f"selfrag+keep{KEEP}"))
    refused = {k: run(items(r), ("selfrag", "selfrag+refuse")) for k, r in unanswerable.items()}
    clean, kept = answerable["selfrag"], answerable[f"selfrag+keep{KEEP}"]
    crag = run(items(distracted), ("selfrag", "selfrag+crag"))
    acc_drop = clean["accuracy"] - answerable["selfrag+refuse"]["accuracy"]
    lost = clean["accuracy"] - crag["selfrag"]["accuracy"]
    recovered = crag["selfrag+crag"]["accuracy"] - crag["selfrag"]["accuracy"]
    share = recovered / lost if lost > 0 else None
    bar = options_from_args(cargs, "selfrag", True, keep_top=0).refuse  # the bar selfrag+refuse ran with
    summary = [
        {"what": f"world: {k} unanswerable questions refused (selfrag+refuse, test)",
         "ours": f"{r['selfrag+refuse']['refusal_rate_unanswerable']:.1%}",
         "peer": f"{r['selfrag']['refusal_rate_unanswerable']:.1%} (selfrag)", "ratio": None,
         "goal": "refused >= 80%", "met": r["selfrag+refuse"]["refusal_rate_unanswerable"] >= 0.8}
        for k, r in refused.items()
    ] + [
        {"what": "world: answerable accuracy, selfrag+refuse vs selfrag (test)",
         "ours": f"{answerable['selfrag+refuse']['accuracy']:.1%}", "peer": f"{clean['accuracy']:.1%}",
         "ratio": None, "goal": "drop <= 5 points", "met": acc_drop <= 0.05},
        {"what": "world: distractor passages, accuracy recovered by selfrag+crag",
         "ours": f"{crag['selfrag+crag']['accuracy']:.1%}",
         "peer": f"{crag['selfrag']['accuracy']:.1%} distracted, {clean['accuracy']:.1%} clean",
         "ratio": share, "goal": "recovered >= half of the lost accuracy",
         "met": share is not None and share >= 0.5},
        {"what": f"world: answerable accuracy, selfrag+keep{KEEP} (decodes {KEEP} of {ndocs}) vs selfrag",
         "ours": f"{kept['accuracy']:.1%}", "peer": f"{clean['accuracy']:.1%}", "ratio": None,
         "goal": "drop <= 2 points", "met": clean["accuracy"] - kept["accuracy"] <= 0.02},
    ]
    if args.plot and settings.get("refuse", {}).get("dev_grid"):
        plot_refusal_tradeoff(settings["refuse"], refused, answerable, Path(args.plot))
    return {"world_dir": str(world_dir), "model": args.model, "index": args.index, "n_per_set": args.n, "ndocs": ndocs,
            "refusal_bar": {"rel_threshold": bar.rel_threshold, "sup_threshold": bar.sup_threshold, "issup": bar.issup,
                            "ret_threshold": bar.ret_threshold if math.isfinite(bar.ret_threshold) else None,
                            "use_threshold": bar.use_threshold if math.isfinite(bar.use_threshold) else None,
                            "combination": bar.combination.to_json() if bar.combination else None,
                            "chosen_on": "--refuse-rel-threshold" if args.refuse_rel_threshold is not None
                            else "dev splits (decoding.json)" if settings.get("refuse") else "RefuseOptions' defaults"},
            "crag_rel_threshold": args.crag_rel_threshold,
            "answerable": answerable, "unanswerable": refused, "distractors": crag,
            "accuracy_drop_from_refusal": acc_drop, "crag_lost": lost, "crag_recovered": recovered,
            "summary": summary}


def plot_refusal_tradeoff(dev: dict[str, Any], refused: dict[str, Any], answerable: dict[str, Any], path: Path) -> None:
    """Every bar of the dev grid (its least-refused kind against answerable accuracy, both on
    dev), the chosen one circled, and where that bar lands on each test kind."""
    from selfrag_jax.utils import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    grid = dev["dev_grid"]
    ax.scatter([100 * x for x in grid["min_refused"]], [100 * x for x in grid["answerable"]], s=10, color="0.6",
               label="a bar on dev (its worst kind)")
    thresholds = (f"rel > {dev['rel_threshold']:g}, "
                  + (f"sup > {dev['sup_threshold']:g}" if dev.get("issup", True) else "IsSup not consulted")
                  + (f", retriever > {dev['ret_threshold']:g}" if dev.get("ret_threshold") is not None else "")
                  + (f", utility > {dev['use_threshold']:g}" if dev.get("use_threshold") is not None else ""))
    worst = lambda d: 100 * min(v for k, v in d.items() if k != "answerable")  # noqa: E731
    if dev.get("combination"):  # the grid's best beside the learned bar that beat it
        ax.scatter([worst(dev["grid_best_dev"])], [100 * dev["grid_best_dev"]["answerable"]], s=80, marker="s",
                   facecolors="none", edgecolors="0.3", label=f"best of the grid: {thresholds}")
    ax.scatter([worst(dev["dev"])], [100 * dev["dev"]["answerable"]], s=80, facecolors="none", edgecolors="C0",
               label="chosen: " + ("the learned combination" if dev.get("combination") else thresholds))
    test_acc = 100 * answerable["selfrag+refuse"]["accuracy"]
    for i, (kind, r) in enumerate(refused.items()):
        ax.scatter([100 * r["selfrag+refuse"]["refusal_rate_unanswerable"]], [test_acc], marker="x", color=f"C{i + 1}",
                   label=f"test: {kind}")
    base = 100 * answerable["selfrag"]["accuracy"]
    ax.axhline(base, color="grey", ls="--", lw=1, label="test: selfrag, no refusal")
    ax.axhspan(base - 5, base, xmin=0.8, color="green", alpha=0.1, label="goal")
    ax.set_xlim(0, 100)
    ax.set_xlabel("unanswerable questions refused (%)")
    ax.set_ylabel("accuracy on answerable (%)")
    ax.set_title("honest refusal: bars chosen on dev, reported on test", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def world_of_index(index: Path) -> Path:
    """The world folder an index was built from (its manifest names the passages file)."""
    manifest = json.loads((index / "manifest.json").read_text())
    folder = Path(manifest.get("source", "")).parent
    if not (folder / "entities.jsonl").exists():
        raise SystemExit(f"{index}: cannot find the world folder of its passages ({folder}); give --world-dir")
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: checks that the benchmark runs")
    parser.add_argument("--world", action="store_true", help="the bundled-world numbers (needs trained models)")
    parser.add_argument("--model", help="--world: the trained generator")
    parser.add_argument("--index", help="--world: the index of the world's passages")
    parser.add_argument("--world-dir", help="--world: the world folder (default: where the index's passages are)")
    parser.add_argument("--n", type=int, default=200, help="--world: questions per eval set")
    parser.add_argument("--ndocs", type=int, default=None, help="retrieval depth [--world: the model's decoding.json, else 5; 5]")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-rounds", type=int, default=2)
    parser.add_argument("--refuse-rel-threshold", type=float, default=None,
                        help="--world: the support bar's IsRel threshold [the bar chosen on the dev splits, decoding.json]")
    parser.add_argument("--crag-rel-threshold", type=float, default=0.99,
                        help="--world: re-retrieve when every passage's IsRel is below this [0.99]")
    parser.add_argument("--plot", help="--world: write the refusal trade-off here (PNG)")
    parser.add_argument("--repeats", type=int, help="latency: timed runs per pipeline and K, after one warm-up [3]")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"date": now(), "machine": machine_info(), "versions": versions("transformers")}
    if args.world:
        if not (args.model and args.index):
            parser.error("--world needs --model and --index")
        result.update(world(args))
        name = "pipelines_world"
    else:
        w = SMALL if args.small else FULL
        if args.repeats:
            w = replace(w, repeats=args.repeats)
        result["workload"] = asdict(w)
        name = "pipelines_small" if args.small else "pipelines"

        def partial(by_k: dict[str, Any]) -> None:  # a run cut short keeps the K values it finished
            write_result(name, {**result, "by_k": by_k, "summary": latency_summary({"by_k": by_k}, args.small)})

        result.update(latency(w, partial))
        result["summary"] = latency_summary(result, args.small)
    path = write_result(name, result)
    for row in result["summary"]:
        print(f"{row['what']}: {row['ours']} vs {row['peer']}"
              + (f", ratio {row['ratio']:.3g}" if row["ratio"] is not None else "")
              + (f" [{row['goal']}: {'met' if row['met'] else 'not met'}]" if row["goal"] else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
