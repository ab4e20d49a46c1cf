"""Training configuration: typed dataclasses, read from YAML with dotted overrides.

`selfrag-jax train configs/generator_7b.yaml optim.learning_rate=1e-5 mesh=data=2,fsdp=-1`
loads the YAML, applies each `key=value` (values parsed as YAML scalars), and rejects any
key that is not a field, naming it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelSection:
    preset: str | None = "tiny"  # a name from selfrag_jax.models.config.PRESETS
    init_from: str | None = None  # a HF Llama folder or a selfrag-jax checkpoint (the paper fine-tunes Llama 2)
    tokenizer: str | None = None  # tokenizer folder (default: the one of init_from)
    new_token_init: str = "mean"  # rows for added reflection tokens: mean | normal
    overrides: dict[str, Any] = field(default_factory=dict)  # LlamaConfig fields (remat_policy, dtype, ...)


@dataclass
class DataSection:
    task: str = "generator"  # generator | critic | mixture | pretrain
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    critic_files: list[str] = field(default_factory=list)  # for task=mixture
    # Task weights by name: generator, critic, a critic type (isrel ..) or, for task pretrain,
    # a train file's stem (repeat: 0.25 draws repeat.jsonl's documents a quarter as often)
    mixture_rates: dict[str, float] = field(default_factory=dict)
    masking: str = "paper"  # paper | released
    prompt_off_by_one: bool = False
    passage_loss_weight: float = 0.0
    unsupported_weight: float = 1.0  # weight of text the annotation rates [No support / Contradictory]
    unhelpful_weight: float = 1.0  # weight of a relevant segment's text in an output rated [Utility:1] or [Utility:2]
    seq_len: int = 512
    packing: bool = True
    seed: int = 0
    backend: str = "auto"  # auto | numpy | seqio


@dataclass
class OptimSection:
    learning_rate: float = 2e-5
    schedule: str = "linear"  # linear | cosine | constant
    warmup_ratio: float = 0.03
    end_lr_ratio: float = 0.0
    # The schedule's length in steps (0: num_steps). Longer than num_steps, the run stops
    # partway along it: a prefix of a longer run, its rate not yet decayed (MaxText's
    # learning_rate_schedule_steps).
    schedule_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    # The embedding (and an untied lm_head) learns at this multiple of the rate. Appended
    # reflection rows start identical (the mean row) and must pull apart; in a short fine-tune
    # at a pretrained model's rate they barely move (docs/experiments/smollm2.md).
    embedding_lr_scale: float = 1.0


@dataclass
class CheckpointSection:
    every: int = 500
    keep: int = 3
    async_save: bool = True


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    global_batch_size: int = 128  # sequences per optimizer step, over all hosts
    micro_batch_size: int = 0  # per step and device group; 0 = no accumulation
    # "per_sequence": mean over each sequence's trained tokens, then over sequences (the
    # released trainer: micro-batch 1 + accumulation). "per_token": one mean over all trained
    # tokens of the global batch.
    loss_averaging: str = "per_sequence"
    num_steps: int = 0  # 0: derived from epochs
    epochs: float = 3.0
    mesh: str = "1,-1,1"  # data, fsdp, tensor (one axis may be -1)
    rules: list[list[Any]] | None = None  # logical axis rules; None = selfrag_jax.sharding.DEFAULT_RULES
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 8
    peak_flops_per_device: float = 0.0  # 0: known accelerator table, or measured on CPU

    def __post_init__(self):
        if self.loss_averaging not in ("per_sequence", "per_token"):
            raise ValueError(f"loss_averaging={self.loss_averaging!r} must be per_sequence or per_token")
        if self.optim.schedule not in ("linear", "cosine", "constant"):
            raise ValueError(f"optim.schedule={self.optim.schedule!r} must be linear, cosine or constant")
        if self.optim.schedule_steps < 0:
            raise ValueError(f"optim.schedule_steps={self.optim.schedule_steps} must not be negative")
        if self.micro_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not a multiple of "
                             f"micro_batch_size={self.micro_batch_size}")

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size if self.micro_batch_size else 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls, values: dict[str, Any], where: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ValueError(f"{where}.{name}: expected a mapping, got {value!r}")
            value = _build(hint, value, f"{where}.{name}")
        else:
            value = _coerce(value, hint, f"{where}.{name}")
        kwargs[name] = value
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """YAML reads `1e-5` as a string and `3` where a float is meant: convert by field type."""
    target = hint if hint in (int, float, bool, str) else None
    if target is None and typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and type(None) in typing.get_args(hint):
            return None
        target = args[0] if len(args) == 1 and args[0] in (int, float, bool, str) else None
    if target is None or isinstance(value, target) and not (target is int and isinstance(value, bool)):
        return value
    try:
        if target is bool:
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return target(float(value)) if target is int else target(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {target.__name__}, got {value!r}") from None


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """YAML file (or none) + `key=value` overrides -> TrainConfig; errors name the key."""
    values: dict[str, Any] = {}
    where = "config"
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: config file not found")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        where = str(path)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        value = yaml.safe_load(raw) if raw else ""
        if key in ("mesh",):  # keep mesh specs as strings ("2,2,2" would parse as a number)
            value = raw
        _set_dotted(values, key.strip(), value)
    return _build(TrainConfig, values, where)
