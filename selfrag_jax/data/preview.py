"""`selfrag-jax data preview`: which tokens of an example carry loss.

Reads the first N records of a JSON-lines file, encodes them exactly as training does
(encode.encode_record) and prints them with the trained tokens highlighted (ANSI colour on
a terminal, `[[...]]` otherwise), or as JSON lines `{"tokens", "ids", "loss_weights"}`.
Without --tokenizer, the bundled generator's (the bundled world's tokenizer).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from selfrag_jax.bundled import ASSETS
from selfrag_jax.cli import CLIError

from .encode import MaskConfig, encode_record
from .records import iter_records

GREEN, YELLOW, RESET = "\x1b[1;32m", "\x1b[33m", "\x1b[0m"


def load_tokenizer(path: str | None):
    from selfrag_jax.tokenizer import SelfRAGTokenizer

    folder = Path(path) if path else ASSETS / "generator"
    try:
        return SelfRAGTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        hint = "" if path else " (the bundled generator's; give --tokenizer)"
        raise CLIError(f"cannot load tokenizer from {folder}{hint}: {err}") from None


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True, help="JSON-lines file (generator or critic layout)")
    parser.add_argument("--task", choices=("generator", "critic"), default="generator")
    parser.add_argument("--masking", choices=("paper", "released"), default="paper",
                        help="paper: mask each passage's content; released: first <paragraph> to last </paragraph>")
    parser.add_argument("--prompt-off-by-one", action="store_true", help="keep the last prompt token in the loss (reference quirk)")
    parser.add_argument("--passage-loss-weight", type=float, default=0.0, help="weight of passage content (paper: 0)")
    parser.add_argument("--critic-labels", choices=("text", "tokens"), default="text")
    parser.add_argument("--unsupported-weight", type=float, default=1.0,
                        help="weight of text rated [No support / Contradictory] (paper: 1)")
    parser.add_argument("--unhelpful-weight", type=float, default=1.0,
                        help="weight of a relevant segment's text in an output rated [Utility:1] or [Utility:2] (paper: 1)")
    parser.add_argument("--max-tokens", type=int, default=2049, help="truncate examples to this many tokens")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the bundled generator's, the world's tokenizer)")
    parser.add_argument("-n", type=int, default=3, help="number of examples")
    parser.add_argument("--json", action="store_true", help="JSON lines: tokens, ids, loss_weights per example")


def _weight(w: float) -> float | int:
    return int(w) if float(w).is_integer() else round(float(w), 6)


def _show(tok, ex, colour: bool) -> str:
    out, run_open = [], False
    for t, w in zip(ex.tokens.tolist(), ex.weights.tolist()):
        piece = tok.decode([t], skip_control=False)
        if colour:
            out.append(f"{GREEN if w >= 1 else YELLOW}{piece}{RESET}" if w > 0 else piece)
            continue
        if w > 0 and not run_open:
            out.append("[[")
        elif w == 0 and run_open:
            out.append("]]")
        run_open = w > 0
        out.append(piece)
    if run_open and not colour:
        out.append("]]")
    return "".join(out)


def run(args) -> int:
    if args.n < 1:
        raise CLIError("-n must be at least 1")
    if args.max_tokens < 2:
        raise CLIError("--max-tokens must be at least 2")
    try:
        mask = MaskConfig(masking=args.masking, prompt_off_by_one=args.prompt_off_by_one,
                          passage_loss_weight=args.passage_loss_weight, critic_labels=args.critic_labels,
                          unsupported_weight=args.unsupported_weight, unhelpful_weight=args.unhelpful_weight)
    except ValueError as err:
        raise CLIError(str(err)) from None
    tok = load_tokenizer(args.tokenizer)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    legend = "trained tokens in green (passage content at reduced weight in yellow)" if colour else \
        "trained tokens shown [[like this]]"
    shown = 0
    for line, rec in iter_records(args.input, args.task):
        ex = encode_record(rec, args.task, tok, mask, args.max_tokens)
        if shown == 0 and not args.json:
            print(f"# {args.input} as {args.task} data, masking={args.masking}; {legend}")
        if args.json:
            print(json.dumps({"line": line, "id": rec["id"], "truncated": ex.truncated,
                              "tokens": [tok.id_to_token(t) for t in ex.tokens.tolist()], "ids": ex.tokens.tolist(),
                              "loss_weights": [_weight(w) for w in ex.weights.tolist()]}, ensure_ascii=False))
        else:
            trained = int((ex.weights > 0).sum())
            print(f"\n# line {line} id={rec['id']!r} type={rec['type']!r}: {len(ex.tokens)} tokens, {trained} trained"
                  + (" (truncated)" if ex.truncated else "") + ("" if ex.has_loss else " -- no loss, dropped in training"))
            print(_show(tok, ex, colour))
        shown += 1
        if shown >= args.n:
            break
    if shown == 0:
        raise CLIError(f"{args.input}: no records")
    return 0
