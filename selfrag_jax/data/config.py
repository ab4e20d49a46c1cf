"""What the training stream reads: its tasks and the whole stream's settings (docs/method.md
section 3 for the masks). Shared by the numpy pipeline and the seqio path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .encode import MaskConfig
from .records import CRITIC_TYPES, Kind


@dataclass(frozen=True)
class TaskSpec:
    """One task: a JSON-lines file read as generator data or as one critic token type."""

    name: str
    path: str
    kind: Kind = "generator"
    critic_type: str | None = None
    rate: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("generator", "critic", "text"):
            raise ValueError(f"task {self.name}: kind must be 'generator', 'critic' or 'text', got {self.kind!r}")
        if self.kind == "critic" and self.critic_type not in CRITIC_TYPES:
            raise ValueError(f"task {self.name}: critic_type must be one of {CRITIC_TYPES}, got {self.critic_type!r}")
        if not self.rate > 0:
            raise ValueError(f"task {self.name}: rate must be positive, got {self.rate}")


def generator_task(path: str, rate: float = 1.0, name: str = "generator") -> TaskSpec:
    return TaskSpec(name, str(path), "generator", None, rate)


def critic_tasks(path: str, rate: float = 1.0, types: Sequence[str] = CRITIC_TYPES, prefix: str = "critic",
                 type_rates: dict[str, float] | None = None) -> tuple[TaskSpec, ...]:
    """One task per reflection-token type, each with `rate` times its `type_rates` entry (1 if
    absent): a hard type (IsRel for a tiny critic) can be drawn more often."""
    type_rates = type_rates or {}
    return tuple(TaskSpec(f"{prefix}_{t}", str(path), "critic", t, rate * type_rates.get(t, 1.0)) for t in types)


@dataclass(frozen=True)
class DataConfig:
    """The whole stream. batch_size is rows per host; the global batch is batch_size x hosts.
    shard_index / num_shards default to jax.process_index() / jax.process_count()."""

    tasks: tuple[TaskSpec, ...]
    batch_size: int = 8
    seq_len: int = 2048
    pack: bool = True
    seed: int = 0
    num_epochs: int | None = None  # None: forever; else stop when a task would start epoch num_epochs
    mask: MaskConfig = field(default_factory=MaskConfig)
    shard_index: int | None = None
    num_shards: int | None = None

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("DataConfig needs at least one task")
        if len({t.name for t in self.tasks}) != len(self.tasks):
            raise ValueError("task names must be unique")
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("batch_size must be >= 1 and seq_len >= 2")

    def shard(self) -> tuple[int, int]:
        index, count = self.shard_index, self.num_shards
        if index is None or count is None:
            import jax

            index = jax.process_index() if index is None else index
            count = jax.process_count() if count is None else count
        if not 0 <= index < count:
            raise ValueError(f"shard_index {index} not in [0, {count})")
        return index, count
