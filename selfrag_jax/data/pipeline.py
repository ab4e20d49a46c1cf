"""The training stream: tasks, mixture order, per-host sharding, packing and a resumable
position. Pure Python/numpy; the seqio path (seqio_tasks.py) only swaps the example source.

Order. Draw k of the global stream picks a task from the rates (blocks of draws seeded by
(seed, block), so any k is found without replay) and takes the next record of that task's
shuffled order (a permutation seeded by (seed, task, epoch)). Host h of H keeps the draws
with k % H == h, so hosts see disjoint examples and their batches together form the global
batch. A record whose example has no loss is dropped (counted), after it was drawn, so
every host agrees on the order.

Position. `state()` is a small JSON-able dict (next draw, each task's epoch and index, the
example carried over by the packer, counters); an iterator built with it yields exactly the
batches that would have followed. The position is per host: save one per process.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Iterator, Protocol, Sequence

import numpy as np

from .config import DataConfig, TaskSpec
from .encode import Example, MaskConfig, encode_record
from .pack import Packer
from .records import JsonlIndex

STATE_VERSION = 1
_BLOCK = 4096  # draws per block of mixture choices


class Source(Protocol):
    """Random access to one task's examples, already truncated to seq_len + 1 tokens."""

    def __len__(self) -> int: ...

    def example(self, i: int) -> Example: ...


class JsonlSource:
    """The numpy path: records read from JSON lines and encoded on demand."""

    def __init__(self, spec: TaskSpec, tokenizer, mask: MaskConfig, max_tokens: int):
        self.spec, self.tok, self.mask, self.max_tokens = spec, tokenizer, mask, max_tokens
        self.index = JsonlIndex.build(spec.path, spec.kind, spec.critic_type)
        if not len(self.index):
            what = f"critic records of type {spec.critic_type!r}" if spec.kind == "critic" else "records"
            raise ValueError(f"{spec.path}: no {what} (task {spec.name})")

    def __len__(self) -> int:
        return len(self.index)

    def example(self, i: int) -> Example:
        return encode_record(self.index[i], self.spec.kind, self.tok, self.mask, self.max_tokens)


def make_sources(cfg: DataConfig, tokenizer, backend: str = "numpy") -> list[Source]:
    """numpy: JSON lines read directly; seqio: the TFDS builder + seqio tasks (needs TF)."""
    if backend == "numpy":
        return [JsonlSource(t, tokenizer, cfg.mask, cfg.seq_len + 1) for t in cfg.tasks]
    if backend == "seqio":
        from .seqio_tasks import seqio_sources

        return seqio_sources(cfg, tokenizer)
    raise ValueError(f"backend must be 'numpy' or 'seqio', got {backend!r}")


class Order:
    """Draw k -> task (mixture rates); (task, epoch) -> shuffled record order."""

    def __init__(self, sizes: Sequence[int], rates: Sequence[float], seed: int):
        self.sizes, self.seed = list(sizes), seed
        p = np.asarray(rates, np.float64)
        self.p = p / p.sum()
        self._block: tuple[int, np.ndarray] | None = None
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def task_of(self, draw: int) -> int:
        if len(self.sizes) == 1:
            return 0
        b = draw // _BLOCK
        if self._block is None or self._block[0] != b:
            rng = np.random.default_rng([self.seed, 1_000_003, b])
            self._block = (b, rng.choice(len(self.sizes), size=_BLOCK, p=self.p))
        return int(self._block[1][draw % _BLOCK])

    def record(self, task: int, epoch: int, index: int) -> int:
        cached = self._perms.get(task)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, task, epoch]).permutation(self.sizes[task]))
            self._perms[task] = cached
        return int(cached[1][index])


class DataIterator:
    """Batches (dicts of numpy arrays, keys pack.BATCH_KEYS) of this host's shard."""

    def __init__(self, cfg: DataConfig, sources: Sequence[Source], pad_id: int, state: dict | None = None):
        self.cfg, self.sources, self.pad_id = cfg, list(sources), pad_id
        self.shard_index, self.num_shards = cfg.shard()
        self.order = Order([len(s) for s in self.sources], [t.rate for t in cfg.tasks], cfg.seed)
        self.draw = 0
        self.cursors = [[0, 0] for _ in self.sources]  # [epoch, index] per task
        self.carry: list[int] | None = None  # [task, record] that closed the last batch
        self.stats = {"batches": 0, "examples": 0, "dropped": 0, "truncated": 0, "tokens": 0, "loss_weight": 0.0}
        self.done = False
        if state is not None:
            self.restore(state)

    # --- position ----------------------------------------------------------------------
    def state(self) -> dict:
        return {"version": STATE_VERSION, "seed": self.cfg.seed, "tasks": [t.name for t in self.cfg.tasks],
                "shard": [self.shard_index, self.num_shards], "draw": self.draw,
                "cursors": [{"epoch": e, "index": i} for e, i in self.cursors], "carry": self.carry,
                "done": self.done, "stats": dict(self.stats)}

    def restore(self, state: dict) -> None:
        state = json.loads(json.dumps(state))  # accept anything JSON-shaped, keep no aliases
        expect = {"version": STATE_VERSION, "seed": self.cfg.seed, "tasks": [t.name for t in self.cfg.tasks],
                  "shard": [self.shard_index, self.num_shards]}
        for key, want in expect.items():
            if state.get(key) != want:
                raise ValueError(f"data position does not match this config: {key} is {state.get(key)!r}, expected {want!r}")
        self.draw = int(state["draw"])
        self.cursors = [[int(c["epoch"]), int(c["index"])] for c in state["cursors"]]
        self.carry = state["carry"]
        self.done = bool(state.get("done", False))
        self.stats.update(state.get("stats", {}))

    # --- iteration ---------------------------------------------------------------------
    def _next_draw(self) -> tuple[int, int] | None:
        """This host's next (task, record), or None when the epochs are used up."""
        while True:
            k = self.draw
            t = self.order.task_of(k)
            epoch, index = self.cursors[t]
            if self.cfg.num_epochs is not None and epoch >= self.cfg.num_epochs:
                return None
            record = self.order.record(t, epoch, index)
            index += 1
            self.cursors[t] = [epoch + 1, 0] if index == len(self.sources[t]) else [epoch, index]
            self.draw += 1
            if k % self.num_shards == self.shard_index:
                return t, record

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        packer = Packer(self.cfg.batch_size, self.cfg.seq_len, self.pad_id, self.cfg.pack)
        if self.carry is not None:
            t, r = self.carry
            packer.add(self.sources[t].example(r))
            self.carry = None
        while not self.done and not packer.full:
            nxt = self._next_draw()
            if nxt is None:
                self.done = True
                break
            ex = self.sources[nxt[0]].example(nxt[1])
            self.stats["examples"] += 1
            self.stats["truncated"] += int(ex.truncated)
            if not ex.has_loss:
                self.stats["dropped"] += 1
                continue
            if not packer.add(ex):
                self.carry = list(nxt)
                break
        if packer.empty:
            raise StopIteration
        batch = packer.emit()
        self.stats["batches"] += 1
        self.stats["tokens"] += int((batch["segment_ids"] > 0).sum())
        self.stats["loss_weight"] += float(batch["loss_weights"].sum())
        return batch


def batches(cfg: DataConfig, tokenizer, state: dict | None = None, backend: str = "numpy") -> DataIterator:
    """The training iterator. backend "numpy" needs no TensorFlow; "seqio" reads through the
    TFDS builder and seqio tasks and yields identical batches for the same config."""
    return DataIterator(cfg, make_sources(cfg, tokenizer, backend), tokenizer.pad_id, state)


def config_dict(cfg: DataConfig) -> dict:
    """The config as plain data (for logs and checkpoints)."""
    return asdict(cfg)
