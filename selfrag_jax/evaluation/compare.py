"""`selfrag-jax compare`: two (or more) pipelines on the same inputs, side by side.

One model, engine and retriever serve every pipeline, so the numbers differ only by the
pipeline: `selfrag` (refusal and re-retrieval off), `selfrag+refuse`, `selfrag+crag`
(re-retrieval with `--max-rounds`, at least 2), `selfrag+refuse+crag`, `+keepM` on any of
these (decode only the M passages with the highest IsRel, `--keep-top`), and the baselines
`naive`, `top1`, `none`. Reports accuracy, faithfulness (with `--world DIR`: the bundled
world's ground truth; with `--judge MODULE:NAME`: any NLI judge), refusal accuracy (when
the input marks records `"answerable": false`), and the cost fields of `report`. Each
pipeline first runs one untimed batch so compilation does not land on whichever runs first.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrag_jax.inference.cli import add_engine_arguments
from selfrag_jax.inference.scoring import PIPELINES

@dataclass(frozen=True)
class PipelineSpec:
    """A `compare` pipeline name parsed: the base pipeline and Self-RAG's add-ons."""

    name: str
    pipeline: str
    refuse: bool = False
    crag: bool = False
    keep_top: int | None = None  # None: the --keep-top flag

    @classmethod
    def parse(cls, name: str) -> "PipelineSpec":
        base, *mods = name.strip().split("+")
        if base not in PIPELINES:
            raise ValueError(f"pipeline {name!r}: {base!r} is not one of {', '.join(PIPELINES)}")
        keeps = [m for m in mods if m.startswith("keep")]
        keep = int(keeps[0][4:]) if len(keeps) == 1 and keeps[0][4:].isdigit() else 0
        if (mods and base != "selfrag") or len(keeps) > 1 or (keeps and keep < 1) \
                or any(m not in ("refuse", "crag") for m in mods if not m.startswith("keep")):
            raise ValueError(f"pipeline {name!r}: only selfrag takes +refuse, +crag and one +keepM (M >= 1)")
        return cls(name.strip(), base, "refuse" in mods, "crag" in mods, keep or None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipelines", required=True,
                   help="comma-separated, of: selfrag, selfrag+refuse, selfrag+crag, selfrag+refuse+crag "
                        "(each may add +keepM: decode the M best passages by IsRel), naive, top1, none")
    p.add_argument("--model", required=True, help="checkpoint of this project or Hugging Face Llama folder")
    p.add_argument("--input", required=True, help="JSON lines: question, answers?, answerable?, ctxs?, meta?")
    add_engine_arguments(p)
    p.add_argument("--max-rounds", type=int, default=2, help="retrieval rounds of the +crag pipelines")
    p.add_argument("--world", metavar="DIR", help="bundled-world folder (entities.jsonl): judges faithfulness")
    p.add_argument("--judge", metavar="MODULE:NAME",
                   help="faithfulness judge: a class or factory returning an object with "
                        "supported(record, prediction, passages) or entails(premise, hypothesis)")
    p.add_argument("--out", metavar="FILE", help="write the comparison as JSON")
    p.add_argument("--predictions-dir", metavar="DIR", help="write each pipeline's predictions and report here")
    p.add_argument("--no-warmup", action="store_true", help="do not run an untimed first batch per pipeline")


def run(args: argparse.Namespace) -> int:
    from selfrag_jax.cli import CLIError
    from selfrag_jax.distributed import is_main
    from selfrag_jax.inference.cli import Session, check_arguments
    from selfrag_jax.inference.items import read_items
    from selfrag_jax.inference.report import format_table

    specs = [PipelineSpec.parse(n) for n in args.pipelines.split(",") if n.strip()]
    if len(specs) < 2 or len({s.name for s in specs}) != len(specs):
        raise CLIError("--pipelines needs at least two different pipelines, e.g. selfrag,naive")
    if args.long_form:
        raise CLIError("compare runs short-form pipelines (no --long-form)")
    args.pipeline, args.refuse, args.cache = "selfrag", None, None
    check_arguments(args, CLIError)
    judge = make_judge(args)
    items = read_items(args.input, args.task)
    session = Session.load(args)
    reports = compare(session, items, specs, args, judge, warmup=not args.no_warmup)
    if not is_main():  # every host ran the same pipelines; one reports
        return 0
    print(format_table(reports))
    if args.out:
        from selfrag_jax.utils import atomic_file

        with atomic_file(args.out) as handle:
            json.dump({"input": args.input, "model": args.model, "n": len(items), "pipelines": reports}, handle,
                      indent=1)
            handle.write("\n")
    return 0


def compare(session, items: list, specs: list[PipelineSpec], args: argparse.Namespace, judge=None,
            warmup: bool = True) -> dict[str, dict[str, Any]]:
    """Run each pipeline over `items` on one session; a report per pipeline name."""
    from selfrag_jax.distributed import is_main
    from selfrag_jax.inference.cli import options_from_args

    reports = {}
    inputs = [it.record for it in items]
    for spec in specs:
        opts = options_from_args(args, spec.pipeline, spec.refuse, max(2, args.max_rounds) if spec.crag else 1,
                                 spec.keep_top)
        if warmup:
            session.run(items[: args.batch_size], opts, args.batch_size)
        out = session.run(items, opts, args.batch_size)
        reports[spec.name] = out.report(inputs, judge, opts.refuse.message)
        if args.predictions_dir and is_main():
            write_predictions(Path(args.predictions_dir), spec.name, out.records, reports[spec.name])
    return reports


def write_predictions(folder: Path, name: str, records: list[dict[str, Any]], report: dict[str, Any]) -> None:
    from selfrag_jax.utils import atomic_file

    folder.mkdir(parents=True, exist_ok=True)
    with atomic_file(folder / f"{name}.jsonl") as handle:
        handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with atomic_file(folder / f"{name}.jsonl.report.json") as handle:
        handle.write(json.dumps(report, indent=1) + "\n")


def make_judge(args: argparse.Namespace):
    """The faithfulness judge the flags ask for, or None."""
    from selfrag_jax.inference.report import EntailmentJudge
    from selfrag_jax.world.judges import WorldFactJudge

    if args.world and args.judge:
        raise ValueError("give --world or --judge, not both")
    if args.world:
        return WorldFactJudge.from_world(args.world)
    if not args.judge:
        return None
    module, _, name = args.judge.partition(":")
    if not name:
        raise ValueError(f"--judge {args.judge!r}: expected MODULE:NAME")
    judge = getattr(importlib.import_module(module), name)()
    if hasattr(judge, "supported"):
        return judge
    if hasattr(judge, "entails"):
        return EntailmentJudge(judge)
    raise ValueError(f"--judge {args.judge}: the object has neither supported() nor entails()")
