"""Shared test fixtures: tiny random Hugging Face Llama folders and a tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_HF = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. Where was Alice Mbeki born? She was born in Lurvik.",
    "### Instruction:\nAnswer the question.\n\n### Response:\n",
    "Paris is the capital of France. 1 2 3 4 5 6 7 8 9 0 [ ] < > / : ( )",
]


def make_hf_llama(folder: Path, seed: int = 0, dtype: str = "float32", tokenizer: bool = False, **overrides) -> Path:
    """Save a randomly initialised transformers LlamaForCausalLM (PyTorch) to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_HF, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm scales, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    if tokenizer:
        make_tokenizer(folder, vocab_size=cfg.vocab_size)
    return folder


def make_tokenizer(folder: Path, vocab_size: int = 300):
    from selfrag_jax.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(TOKENIZER_TEXT * 20, vocab_size=vocab_size, out_dir=folder)


def ragged_batch(vocab: int, lengths=(23, 17, 9, 1), seed: int = 0):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    tokens = rng.integers(3, vocab, (len(lengths), width)).astype(np.int32)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return tokens, mask, list(lengths)


def build_test_world(out) -> dict:
    """The bundled world as `make train-default` builds it (same people, passages, training
    and eval files), with fewer fresh-people pretraining documents: the tokenizer is trained
    on less text, so the build takes seconds instead of a minute or two."""
    from selfrag_jax.world import WorldConfig, build_world
    from selfrag_jax.world.pretrain import PretrainConfig

    return build_world(str(out), config=WorldConfig(pretrain=PretrainConfig(n_fresh_reading=2000, n_anneal_reading=500, n_relevance=500)))
