"""Decoder-only feature conversion: examples -> fixed-shape numpy batches.

An example of n tokens becomes n-1 positions: `inputs = tokens[:-1]`, `targets = tokens[1:]`,
`loss_weights = weights[1:]`. Shifting happens per example *before* packing, so no target
ever belongs to another segment. Packing is first-fit over the rows of one batch; the first
example that fits no row closes the batch and opens the next one (the packer's carry-over,
at most one example). Batch keys (what the trainer consumes):

    inputs [B, L] int32        tokens fed to the model (pad_id in padding)
    targets [B, L] int32       next tokens (pad_id in padding)
    loss_weights [B, L] float32
    segment_ids [B, L] int32   1, 2, ... per packed example; 0 = padding
    positions [B, L] int32     restart at 0 in each segment
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from .encode import Example

BATCH_KEYS = ("inputs", "targets", "loss_weights", "segment_ids", "positions")


@dataclass
class Packer:
    batch_size: int
    seq_len: int
    pad_id: int
    pack: bool = True
    _rows: list[list[Example]] = field(default_factory=list)
    _used: list[int] = field(default_factory=list)

    def add(self, ex: Example) -> bool:
        """Places `ex` in the open batch; False if it fits nowhere (the batch is then full)."""
        n = len(ex.tokens) - 1
        if n < 1 or n > self.seq_len:
            raise ValueError(f"example of {n + 1} tokens does not fit seq_len {self.seq_len} (truncate first)")
        if self.pack:
            for r, used in enumerate(self._used):
                if used + n <= self.seq_len:
                    self._rows[r].append(ex)
                    self._used[r] += n
                    return True
        if len(self._rows) < self.batch_size:
            self._rows.append([ex])
            self._used.append(n)
            return True
        return False

    @property
    def full(self) -> bool:
        """No more room for even a 2-token example (unpacked: every row taken)."""
        return len(self._rows) == self.batch_size and (not self.pack or min(self._used) >= self.seq_len)

    @property
    def empty(self) -> bool:
        return not self._rows

    def emit(self) -> dict[str, np.ndarray]:
        """The open batch as arrays (unused rows are padding); the packer is then empty."""
        b, l = self.batch_size, self.seq_len
        out = {"inputs": np.full((b, l), self.pad_id, np.int32), "targets": np.full((b, l), self.pad_id, np.int32),
               "loss_weights": np.zeros((b, l), np.float32), "segment_ids": np.zeros((b, l), np.int32),
               "positions": np.zeros((b, l), np.int32)}
        for r, row in enumerate(self._rows):
            at = 0
            for s, ex in enumerate(row, 1):
                n = len(ex.tokens) - 1
                out["inputs"][r, at:at + n] = ex.tokens[:-1]
                out["targets"][r, at:at + n] = ex.tokens[1:]
                out["loss_weights"][r, at:at + n] = ex.weights[1:]
                out["segment_ids"][r, at:at + n] = s
                out["positions"][r, at:at + n] = np.arange(n)
                at += n
        self._rows, self._used = [], []
        return out
