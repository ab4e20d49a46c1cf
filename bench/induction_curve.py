"""Induction heads over training: `demo.probe.induction_accuracy` at every checkpoint of a run.

Why: the IsSup account in `docs/experiments/default-models.md` turns on whether a base
model copies by content, and that skill arrives as a phase change (Olsson et al., 2022): the
second copy of a random sequence goes from unpredicted to predicted in a short window of
training. This walks a run's kept checkpoints (train with `checkpoint.keep` large enough) and
scores each on 32 rows of 40 random name pieces said twice, as words (the repeat documents'
form, `repeat_rows(spaced=True)`) and glued together (text no document has), then plots the
second copy's greedy accuracy against the step, one colour per run. Not a timing.

    python -m bench.induction_curve RUN_DIR[=LABEL] [RUN_DIR[=LABEL] ...] --name induction_curve
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import RESULTS, machine_info, versions, write_result
from selfrag_jax.demo.probe import induction_accuracy, probe_model


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/ folder (not a training run directory)")
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def curve(run_dir: str | Path, rows: int = 32, length: int = 40, log=print) -> list[dict]:
    """[{"step", "words", "glued": second-copy accuracy, "words_loss": [first, second]}] per
    checkpoint, in step order."""
    out, steps, start = [], checkpoint_steps(run_dir), time.time()
    for i, step in enumerate(steps):
        model = probe_model(Path(run_dir) / "checkpoints" / str(step))  # read once, probed both ways
        words = induction_accuracy(model, rows, length, spaced=True)
        glued = induction_accuracy(model, rows, length)
        out.append({"step": step, "words": words["second_accuracy"], "glued": glued["second_accuracy"],
                    "words_loss": [words["first_loss"], words["second_loss"]]})
        rate = (time.time() - start) / (i + 1)
        log(f"{run_dir} step {step}: as words {words['second_accuracy']:.3f}, glued {glued['second_accuracy']:.3f} "
            f"[{i + 1}/{len(steps)}, {rate:.0f} s each, ETA {rate * (len(steps) - i - 1):.0f} s]")
    return out


def summary_row(label: str, points: list[dict]) -> dict:
    """A learning probe, not a timing: the last checkpoint's accuracy and where it crossed 0.9."""
    first = next((p["step"] for p in points if p["words"] >= 0.9), None)
    return {"what": f"induction probe, {label}: second copy of 40 random name pieces, as words (glued)",
            "ours": f"{points[-1]['words']:.3f} ({points[-1]['glued']:.3f}) at step {points[-1]['step']}; "
                    + (f">= 0.9 from step {first}" if first is not None else "never >= 0.9"),
            "peer": "-", "ratio": None, "goal": None, "met": None}


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, points) in enumerate(curves.items()):
        steps = [p["step"] for p in points]
        ax.plot(steps, [p["words"] for p in points], color=f"C{i}", marker=".", label=f"{label}, as words")
        ax.plot(steps, [p["glued"] for p in points], color=f"C{i}", linestyle="--", label=f"{label}, glued")
    ax.set(xlabel="step", ylabel="second copy, greedy accuracy", ylim=(-0.02, 1.02),
           title="induction heads: a random sequence's second copy predicted")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR[=LABEL]")
    parser.add_argument("--name", default="induction_curve", help="bench/results/NAME.json and NAME.png")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    curves = {}
    for spec in args.runs:
        run_dir, _, label = spec.partition("=")
        curves[label or Path(run_dir).name] = curve(run_dir, args.rows, args.length)
    result = {"machine": machine_info(), "versions": versions(), "rows": args.rows, "length": args.length,
              "curves": curves, "summary": [summary_row(label, points) for label, points in curves.items()]}
    write_result(args.name, result, args.results / f"{args.name}.json")
    plot(curves, args.results / f"{args.name}.png")
    return result


if __name__ == "__main__":
    main()
