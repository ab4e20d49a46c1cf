"""The Llama model shared by training, annotation and inference."""

from selfrag_jax.models.config import PRESETS, LlamaConfig, preset
from selfrag_jax.models.llama import KVCache, Llama, abstract_params, init_params

__all__ = ["PRESETS", "LlamaConfig", "preset", "KVCache", "Llama", "abstract_params", "init_params"]
