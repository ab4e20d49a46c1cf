"""The embedded default: `selfrag-jax demo` and `selfrag-jax train-default`."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "train-default":
        parser.add_argument("--out", default="runs/default", help="work folder [runs/default]")
        parser.add_argument("--budget", choices=("full", "reduced", "continue"), default="full",
                            help="training budget: full (shipped models), reduced (~45 min) or continue (the shipped "
                                 "models trained again from themselves on this world's data, no new base) [full]")
        parser.add_argument("--no-export", action="store_true", help="do not copy the models into the package")
        parser.add_argument("--seed", type=int, default=None,
                            help="init seed of the base stage: another draw of the base (pretraining is a draw) "
                                 "[the config's, 0]")
        parser.add_argument("--force-export", action="store_true",
                            help="export even when the base failed to learn to read (below "
                                 "pipeline.MIN_BASE_READING, where export is skipped)")
        return
    from selfrag_jax.demo.demo import add_demo_arguments

    add_demo_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from selfrag_jax.distributed import split_host_cpu

    split_host_cpu()  # before any JAX work: the configs' data-parallel mesh then uses both cores
    if args._name == "train-default":
        from pathlib import Path

        from selfrag_jax.demo.pipeline import Stages

        Stages(Path(args.out), args.budget, base_seed=args.seed).run_all(export=not args.no_export,
                                                                          force_export=args.force_export)
        return 0
    from selfrag_jax.demo.demo import run_demo

    return run_demo(args)
