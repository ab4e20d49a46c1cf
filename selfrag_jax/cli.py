"""`selfrag-jax` command line: one sub-command per stage of the data's path.

Each command lives in the module that owns it and is imported only when it runs, so
`selfrag-jax --help` stays fast and a command never drags in another's heavy dependencies.
A module named here exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module, one-line help). Nested commands use "group sub".
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("selfrag_jax.demo", "run Self-RAG end to end on the bundled world"),
    "train-default": ("selfrag_jax.demo", "train the bundled world's base, critic and generator (make train-default)"),
    "convert hf-to-ckpt": ("selfrag_jax.models.convert", "Hugging Face Llama folder -> selfrag-jax checkpoint"),
    "convert ckpt-to-hf": ("selfrag_jax.models.convert", "selfrag-jax checkpoint -> Hugging Face Llama folder"),
    "convert gguf-to-ckpt": ("selfrag_jax.models.convert", "Llama GGUF file (llama.cpp) -> selfrag-jax checkpoint"),
    "annotate": ("selfrag_jax.data.annotate", "the critic turns instruction-output pairs into generator training data"),
    "train": ("selfrag_jax.training.main", "train the critic or the generator from a YAML config"),
    "index build": ("selfrag_jax.retrieval.cli", "embed passages and build a persistent ScaNN (or exact) index"),
    "index search": ("selfrag_jax.retrieval.cli", "top-k passages of an index for one query"),
    "serve-retrieval": ("selfrag_jax.retrieval.cli", "HTTP retrieval service over an index folder, or a fan-out over shards' services (--shard)"),
    "data preview": ("selfrag_jax.data.preview", "show how examples are tokenized and which tokens carry loss"),
    "generate": ("selfrag_jax.inference.cli", "Self-RAG inference (short or long form) over a JSON-lines file"),
    "serve": ("selfrag_jax.inference.server", "Self-RAG answers over HTTP, batched across requests (POST /generate)"),
    "compare": ("selfrag_jax.evaluation.compare", "two pipelines on the same inputs: accuracy, faithfulness, refusal, latency"),
    "eval": ("selfrag_jax.evaluation.evaluate", "metrics of a predictions file (released match, EM, F1, ASQA citations)"),
    "sweep": ("selfrag_jax.evaluation.sweep_cli", "re-rank a --cache under a grid of weights and thresholds (CSV + plots)"),
    "plan": ("selfrag_jax.plan", "will a config fit a TPU slice or GPUs? AOT-compile train and decode steps, bytes per chip"),
}


class CLIError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfrag-jax", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (module, help_text) in COMMANDS.items():
        words = name.split()
        subs = top
        if len(words) == 2:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            subs = groups[words[0]]
        sub = subs.add_parser(words[-1], help=help_text, description=help_text)
        sub.set_defaults(_module=module, _name=name)
        # Argument definitions are cheap to import lazily only when this command is chosen;
        # for --help of a specific command we import its module then.
        sub.set_defaults(_parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    # First pass: find the command without parsing its own flags (nor --help, which must
    # wait until the command's module has added its arguments).
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    if not getattr(known, "_module", None):
        if argv and argv[0] not in ("-h", "--help"):
            parser.parse_args(argv)  # prints the usage error of a group without a subcommand
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(known._module)
    except ImportError as err:  # an optional extra this command needs (the message names it)
        print(f"selfrag-jax {known._name}: error: {err}", file=sys.stderr)
        return 2
    sub = known._parser
    module.add_arguments(sub, known._name) if _takes_name(module.add_arguments) else module.add_arguments(sub)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except CLIError as err:
        print(f"selfrag-jax {known._name}: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, KeyError) as err:
        # Library code raises these with a message that names the file, line or field.
        print(f"selfrag-jax {known._name}: error: {err}", file=sys.stderr)
        return 2


def _takes_name(fn) -> bool:
    import inspect

    return len(inspect.signature(fn).parameters) >= 2


if __name__ == "__main__":
    raise SystemExit(main())
