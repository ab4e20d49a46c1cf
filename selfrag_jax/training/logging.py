"""Training metrics: metrics.jsonl (the contract), TensorBoard events and a progress bar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selfrag_jax.utils import progress


class MetricsLogger:
    def __init__(self, run_dir: Path, total: int, initial: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.bar = progress(total=total, initial=initial, desc="train", unit="step", disable=not enabled or None)
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # TensorBoard files are a convenience, metrics.jsonl is the record
            self.tb = None

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "step":
                    self.tb.add_scalar(f"train/{key}", value, metrics["step"])
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{metrics['tokens_per_s']:.0f}", mfu=f"{metrics['mfu']:.1%}", refresh=False)

    def advance(self, step: int) -> None:
        self.bar.update(step - self.bar.n)

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
