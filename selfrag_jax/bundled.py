"""Where the bundled models live inside the package (`make train-default` writes them, the
demo and `data preview` read them): critic/, generator/ and the depth chosen for them."""

from __future__ import annotations

from pathlib import Path

from selfrag_jax.inference.settings import SETTINGS_FILE

ASSETS = Path(__file__).resolve().parent / "assets" / "default"
# Self-RAG's retrieval depth K and refusal bar chosen for a set of models on dev data, kept beside them
DEPTH_FILE = SETTINGS_FILE
