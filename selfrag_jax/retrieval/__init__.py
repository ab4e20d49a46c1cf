"""Dense retrieval: Flax BERT encoders, ScaNN / exact indexes, the HTTP service and clients.

Importing this package is cheap: names resolve on first use, and ScaNN (which loads
TensorFlow when it is installed) is imported only by the ScaNN backend, so the inference
engine runs on machines without either.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TextEncoder": "encoder",
    "EncoderConfig": "encoder",
    "EncoderSpec": "encoder",
    "BertConfig": "encoder",
    "read_encoder_spec": "encoder",
    "DEFAULT_ENCODER": "encoder",
    "Passage": "passages",
    "PassageStore": "passages",
    "iter_passages": "passages",
    "EmbedConfig": "embed",
    "embed_store": "embed",
    "VectorIndex": "index",
    "ExactIndex": "index",
    "ScannIndex": "index",
    "ScannParams": "index",
    "ShardedIndex": "index",
    "build_index": "index",
    "BuildConfig": "build",
    "build_index_folder": "build",
    "read_manifest": "build",
    "Retriever": "retriever",
    "RetrieverClient": "retriever",
    "ShardedRetriever": "retriever",
    "ShardedResults": "retriever",
    "ShardUnavailable": "retriever",
    "RetrievalError": "retriever",
    "ServerConfig": "server",
    "BackgroundServer": "server",
    "serve": "server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
