"""A synthetic data source with the pipeline's batch layout, for tests and benchmarks.

Batch i is a pure function of (seed, i, host): packed rows of random "examples", each with
a prompt (no loss) and a target (loss), so resume, sharding and accumulation can be checked
without the data pipeline.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np


class SyntheticData:
    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0, host: int = 0,
                 num_hosts: int = 1):
        if batch_size % num_hosts:
            raise ValueError(f"batch_size={batch_size} is not divisible by {num_hosts} hosts")
        self.vocab, self.seq_len, self.rows = vocab_size, seq_len, batch_size // num_hosts
        self.seed, self.host, self.index = seed, host, 0

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index, self.host])
        shape = (self.rows, self.seq_len)
        out = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
        out["loss_weights"] = np.zeros(shape, np.float32)
        for r in range(self.rows):
            pos, seg = 0, 1
            while pos < self.seq_len - 4:
                n = int(rng.integers(4, max(5, self.seq_len // 2)))
                n = min(n, self.seq_len - pos)
                prompt = int(rng.integers(1, n))
                seq = rng.integers(3, self.vocab, n + 1)
                sl = slice(pos, pos + n)
                out["inputs"][r, sl], out["targets"][r, sl] = seq[:-1], seq[1:]
                out["segment_ids"][r, sl], out["positions"][r, sl] = seg, np.arange(n)
                out["loss_weights"][r, pos + prompt - 1: pos + n] = 1.0
                pos, seg = pos + n, seg + 1
        return out

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            b = self.batch(self.index)
            self.index += 1
            yield b

    def state(self) -> dict[str, Any]:
        return {"index": self.index}

    def restore(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
