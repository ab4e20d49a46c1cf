"""Parameter-tree operations shared by conversion, training and inference."""

from __future__ import annotations

from typing import Any

import numpy as np

from selfrag_jax.models.config import LlamaConfig


def stack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """`layers_0 .. layers_{n-1}` (unscanned) -> `layers` with a leading layer axis (scanned)."""
    import jax

    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                 *[params[f"layers_{i}"] for i in range(num_layers)])
    return out


def unstack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Inverse of `stack_layers`; each layer stays where its stack was (host or device)."""
    import jax

    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda x: x[i], params["layers"])
    return out


def to_layout(params: dict[str, Any], config: LlamaConfig) -> dict[str, Any]:
    """Convert a parameter tree to the scanned/unscanned layout that `config` asks for."""
    scanned = "layers" in params
    if scanned and not config.scan_layers:
        return unstack_layers(params, config.num_layers)
    if not scanned and config.scan_layers:
        return stack_layers(params, config.num_layers)
    return params


def for_decoding(params: dict[str, Any], config: LlamaConfig, shardings=None) -> tuple[dict[str, Any], LlamaConfig]:
    """(params, config) in the unscanned layout decoding runs (models/llama.py). A scanned
    tree is split per layer once, where its arrays are, instead of a layer scan slicing every
    weight and cache buffer at every step; `shardings` (a function of the new config, as
    `Placement.params`) then puts the split layers in the rules' layout."""
    if not config.scan_layers:
        return params, config
    import jax

    config = config.replace(scan_layers=False)
    params = to_layout(params, config)
    return (params if shardings is None else jax.device_put(params, shardings(config))), config


def resize_vocab(params: dict[str, Any], config: LlamaConfig, new_vocab: int, method: str = "mean",
                 seed: int = 0) -> tuple[dict[str, Any], LlamaConfig]:
    """Grow the embedding (and untied output) matrix to `new_vocab` rows.

    method="mean": new rows are the mean of the existing rows (well-behaved: the new tokens
    start with the average logit); "normal": N(0, initializer_range), the reference's default.
    """
    if method not in ("mean", "normal"):
        raise ValueError(f"embedding init method {method!r} must be 'mean' or 'normal'")
    old = config.vocab_size
    if new_vocab < old:
        raise ValueError(f"cannot shrink the vocabulary from {old} to {new_vocab}")
    if new_vocab == old:
        return params, config
    rng = np.random.default_rng(seed)
    extra = new_vocab - old

    def grow(matrix: np.ndarray, axis: int) -> np.ndarray:
        matrix = np.asarray(matrix)
        if method == "mean":
            rows = np.repeat(matrix.mean(axis=axis, keepdims=True), extra, axis=axis)
        else:
            shape = list(matrix.shape)
            shape[axis] = extra
            rows = rng.normal(0.0, config.initializer_range, shape)
        return np.concatenate([matrix, rows.astype(matrix.dtype)], axis=axis)

    params = dict(params)
    params["embedding"] = grow(params["embedding"], 0)
    if "lm_head" in params:
        params["lm_head"] = grow(params["lm_head"], 1)
    return params, config.replace(vocab_size=new_vocab)
