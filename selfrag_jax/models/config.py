"""Llama model configuration: one frozen dataclass, presets, and the Hugging Face mapping.

The config is the single source of shapes. Hugging Face `config.json` files are read through
an explicit key table so an unexpected key (a feature this model does not implement) fails
loudly instead of producing a silently different network.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_qkv_out")
ROPE_TYPES = ("default", "linear", "llama3")
# Parameter (and KV cache) dtypes the inference commands take.
INFERENCE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported (one of {ROPE_TYPES})")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None
    # Execution choices: they change speed and memory, never the function computed.
    scan_layers: bool = True
    remat_policy: str = "none"
    dtype: str = "float32"  # compute dtype (and the KV cache's)
    param_dtype: str = "float32"  # float32 for training; inference may store bfloat16

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; set head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r} is not one of {REMAT_POLICIES}")

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # --- sizes used by MFU accounting and memory plans -------------------------------
    def num_params(self, include_embeddings: bool = True) -> int:
        e, m, h, kv, d = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        layer = e * (h * d) + 2 * e * (kv * d) + (h * d) * e + 3 * e * m + 2 * e
        total = self.num_layers * layer + e
        if include_embeddings:
            total += self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as MaxText counts them: 6 x matmul params (incl. the
        output projection) plus causal attention (QK^T and AV, halved for causality)."""
        matmul_params = self.num_params(include_embeddings=False) + self.vocab_size * self.hidden_size
        attention = 6 * self.num_layers * self.num_heads * self.head_dim * seq_len  # 12 * ... / 2
        return 6.0 * matmul_params + attention

    # --- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> "LlamaConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown config key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LlamaConfig":
        return cls.from_dict(json.loads(Path(path).read_text()), where=str(path))


# Hugging Face config.json <-> LlamaConfig. Real files carry keys no Llama computation reads
# (bookkeeping, generation defaults, special-token ids, a hub name): those are noted once and
# ignored. Only keys that change the computation, with a value this model does not implement
# (HF_MUST_BE), are refused, naming key and value.
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
HF_IGNORED = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "pretraining_tp",
    "attention_dropout", "tokenizer_class", "max_length", "rope_scaling", "rope_parameters",
}
# Features whose non-default values this implementation does not support.
HF_MUST_BE = {
    "hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
    "sliding_window": (None,), "use_sliding_window": (False,), "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,), "partial_rotary_factor": (1.0, None), "qk_norm": (False,),
    "use_qk_norm": (False,), "logits_scaling": (1.0, None), "embedding_multiplier": (1.0, None),
    "residual_multiplier": (1.0, None), "attention_multiplier": (None,), "num_experts": (None, 0, 1),
    "num_local_experts": (None, 0, 1), "quantization_config": (None,),
}


def from_hf_dict(hf: dict[str, Any], where: str = "config.json", **overrides) -> LlamaConfig:
    """Build a LlamaConfig from a Hugging Face Llama `config.json` dictionary."""
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type={hf['model_type']!r} is not a Llama model")
    kwargs: dict[str, Any] = {}
    unknown: list[str] = []
    for key, value in hf.items():
        if key in HF_KEYS:
            kwargs[HF_KEYS[key]] = value
        elif key in HF_MUST_BE:
            if value not in HF_MUST_BE[key]:
                raise ValueError(f"{where}: {key}={value!r} is not supported (expected {HF_MUST_BE[key][0]!r})")
        elif key not in HF_IGNORED:
            unknown.append(key)
    if unknown:
        logging.getLogger(__name__).warning("%s: ignoring keys a Llama does not compute with: %s", where,
                                            ", ".join(sorted(unknown)))
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    # Transformers 5 writes rope_parameters (with rope_theta inside); older files rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "rope_theta" in rope:
        kwargs["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    allowed = {f.name for f in dataclasses.fields(RopeScaling)}
    extra = sorted(set(rope) - allowed)
    if extra:
        raise ValueError(f"{where}: unknown rope scaling key {extra[0]!r}")
    kwargs["rope_scaling"] = RopeScaling(rope_type=rope_type, **rope)
    if kwargs.get("head_dim") is None:
        kwargs.pop("head_dim", None)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def to_hf_dict(cfg: LlamaConfig) -> dict[str, Any]:
    """A Hugging Face Llama `config.json` dictionary for this config (transformers 5 layout)."""
    out: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for hf_key, ours in HF_KEYS.items():
        out[hf_key] = getattr(cfg, ours)
    out.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    rope = {"rope_type": cfg.rope_scaling.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.rope_type == "linear":
        rope["factor"] = cfg.rope_scaling.factor
    elif cfg.rope_scaling.rope_type == "llama3":
        rope.update({k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if k != "rope_type"})
    out["rope_parameters"] = rope
    out["dtype"] = "float32"
    return out


SELFRAG_VOCAB = 32016  # Llama-2's 32,000 pieces + 15 reflection tokens + <pad>

# Each preset as the fields it sets: `preset(name, **overrides)` builds a new config from them,
# so what the preset leaves derived (head_dim = hidden_size // num_heads) is derived from the
# overridden shape (`preset("tiny", hidden_size=128)` has heads of 32, not tiny's 16).
_PRESET_FIELDS: dict[str, dict[str, Any]] = {
    # Test size: small enough to compile in seconds, with GQA.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_position_embeddings=512),
    # Benchmark shape used across bench/ (hidden 768, 12 layers, GQA 12/4).
    "llama-125m": dict(vocab_size=SELFRAG_VOCAB, hidden_size=768, intermediate_size=2048, num_layers=12,
                       num_heads=12, num_kv_heads=4, max_position_embeddings=2048),
    "llama-1b": dict(vocab_size=SELFRAG_VOCAB, hidden_size=2048, intermediate_size=5632, num_layers=22,
                     num_heads=32, num_kv_heads=4, max_position_embeddings=2048),
    "llama2-7b": dict(),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), bos_token_id=128000,
                      eos_token_id=128001),
}
_PRESET_FIELDS["selfrag-7b"] = {**_PRESET_FIELDS["llama2-7b"], "vocab_size": SELFRAG_VOCAB, "pad_token_id": 32015}
_PRESET_FIELDS["selfrag-13b"] = {**_PRESET_FIELDS["llama2-13b"], "vocab_size": SELFRAG_VOCAB, "pad_token_id": 32015}
PRESETS: dict[str, LlamaConfig] = {name: LlamaConfig(**fields) for name, fields in _PRESET_FIELDS.items()}


def preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (one of {', '.join(PRESETS)})")
    return LlamaConfig(**{**_PRESET_FIELDS[name], **overrides})
