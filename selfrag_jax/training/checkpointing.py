"""Orbax checkpoints of a training run: one folder per step, written asynchronously.

A step folder holds `params/` (the model, restorable alone by `load_model`), `opt_state/`
(optimizer state and step) and `meta/` (JSON: data position, train and model configs and
the tokenizer files), so a step folder is a complete, self-describing model. Orbax writes a
step under a temporary name and renames it when complete: a process killed mid-save leaves
only a temporary folder, which is never listed as a step.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from selfrag_jax.models.config import LlamaConfig
from selfrag_jax.training.state import TrainState

ITEMS = ("params", "opt_state", "meta")


def tokenizer_files(tokenizer) -> dict[str, Any]:
    """The tokenizer's JSON files, to embed in the step's metadata."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        return {p.name: json.loads(p.read_text()) for p in Path(tmp).glob("*.json")}


class CheckpointIO:
    def __init__(self, directory: Path, cfg, model_config: LlamaConfig, tokenizer=None):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self.cfg = cfg
        self._set_aside_incomplete_steps()
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, create=True,
                                               enable_async_checkpointing=cfg.checkpoint.async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self.meta = {"train_config": cfg.to_dict(), "model_config": model_config.to_dict(),
                     "tokenizer": tokenizer_files(tokenizer)}
        self._ocp = ocp

    def _set_aside_incomplete_steps(self) -> None:
        """A step folder left half-written by a crash is renamed, never restored or reused."""
        from selfrag_jax import distributed
        from selfrag_jax.models.checkpoint import is_complete_step

        if not distributed.is_main() or not self.directory.is_dir():
            return
        for step_dir in self.directory.iterdir():
            if step_dir.name.isdigit() and not is_complete_step(step_dir):
                aside = step_dir.with_name(f"{step_dir.name}.incomplete-{int(time.time())}")
                step_dir.rename(aside)
                print(f"checkpoint {step_dir} was never completed; moved to {aside.name}", file=sys.stderr)

    def latest_step(self) -> int | None:
        """The newest step whose every item was committed (never a half-written one)."""
        from selfrag_jax.models.checkpoint import complete_steps

        steps = complete_steps(self.directory)
        return steps[-1] if steps else None

    def save(self, step: int, state, data_state: dict[str, Any], force_sync: bool = False) -> None:
        from selfrag_jax import distributed

        args = self._ocp.args
        # One data position per host: each host reads its own shard of the stream.
        meta = {**self.meta, "step": step, "data_states": distributed.gather_json(data_state)}
        self.manager.save(step, args=args.Composite(
            params=args.StandardSave(state.params),
            opt_state=args.StandardSave({"opt_state": state.opt_state, "step": state.step}),
            meta=args.JsonSave(meta)), force=True)
        if force_sync:
            self.manager.wait_until_finished()

    def restore_latest(self, abstract_state, shardings):
        """(TrainState placed by `shardings`, meta) for the latest complete step, or None."""
        step = self.latest_step()
        if step is None:
            return None
        args = self._ocp.args

        def target(tree, shard_tree):
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shard_tree)

        restored = self.manager.restore(step, args=args.Composite(
            params=args.StandardRestore(target(abstract_state.params, shardings.params)),
            opt_state=args.StandardRestore({"opt_state": target(abstract_state.opt_state, shardings.opt_state),
                                            "step": target(abstract_state.step, shardings.step)}),
            meta=args.JsonRestore()))
        state = TrainState(step=restored["opt_state"]["step"], params=restored["params"],
                           opt_state=restored["opt_state"]["opt_state"], first_bad_step=jnp.full((), -1, jnp.int32))
        return state, restored["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
